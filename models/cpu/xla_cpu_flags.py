"""XLA:CPU settings meshserve runs with: set in XLA_FLAGS before the CPU backend starts (the CLI, the tests
and the SDXL bench call `apply_cpu_defaults()` first; a library user keeps XLA's defaults unless they call it).

- `--xla_cpu_experimental_ynn_fusion_type=-individual_convolution`: convolutions go to XLA's Eigen kernels,
  which use every intra-op thread, instead of YNNPACK, which here ran a convolution on one thread of two
  (dots, element-wise and reduction fusions keep YNNPACK). Measured with bench/sdxl_vs_diffusers.py
  (2026-11-22, 2-core Xeon, alternating rounds, medians, speed-up over diffusers), width 64: at 128x128 the
  VAE decode went 0.82x -> 1.07x and the CFG step 1.01x -> 1.14x; at 256x256 the step 0.86x -> 0.91x.
- Dots are not moved to Eigen (`-individual_dot`, set here until 2026-11-23), although that read 2-6 % faster
  at 256x256 on the Xeon: Eigen's matmul picks its blocking from the matrix sizes, so a row's result then
  depends on how many rows were batched with it. On a 2-core AMD EPYC (Zen 3) a seed's latents moved by up
  to 1.9e-5 relative (ddim, 3 steps) between a batch of 1 and of 2, over the 1e-5 that
  tests/models/test_seeds.py allows; with YNNPACK's dots they are bit-identical at every batch position.

The flag is experimental in XLA, and an XLA_FLAGS entry that a jaxlib does not know aborts the process, so it
is added only for the jaxlib minor versions it was checked with. A flag the user already set wins.

Only where JAX will run on the CPU (`cpu_is_the_platform`): these flags, and the worker's host-device count and
CPU scheduler flags (workers/main.py), were measured on and are meant for XLA:CPU, not for a GPU or TPU host.
XLA reads XLA_FLAGS once, when the first backend starts, so the platform is decided before JAX is imported
and without importing it, the way JAX will decide it:

- `JAX_PLATFORMS` set (e.g. "cpu", "cuda", "tpu,cpu"): its first entry is the default backend (JAX gives the
  listed platforms falling priority); CPU flags apply when that is "cpu". Same for the older
  `JAX_PLATFORM_NAME`.
- Unset: JAX uses an accelerator when its plugin is installed (a `jax_plugins` module or entry point, e.g.
  jax-cuda12-plugin, or libtpu), the CPU otherwise; CPU flags apply when none is installed. A host with an
  accelerator plugin but serving on the CPU sets JAX_PLATFORMS=cpu (as tests/conftest.py does).
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
from collections.abc import Mapping, MutableMapping
from importlib.metadata import PackageNotFoundError, entry_points, version

# jaxlib "major.minor" -> the flags known good there.
_CHECKED = {
    "0.10": ("--xla_cpu_experimental_ynn_fusion_type=-individual_convolution",),
}


def jaxlib_minor(jaxlib_version: str | None = None) -> str:
    """ "major.minor" of `jaxlib_version` (default: the installed jaxlib's; "" when none is installed)."""
    if jaxlib_version is None:
        try:
            jaxlib_version = version("jaxlib")
        except PackageNotFoundError:
            return ""
    return ".".join(jaxlib_version.split(".")[:2])


def cpu_default_flags(jaxlib_version: str | None = None) -> tuple[str, ...]:
    """The flags meshserve adds for this jaxlib (none for a version they were not checked with)."""
    return _CHECKED.get(jaxlib_minor(jaxlib_version), ())


def accelerator_plugins() -> list[str]:
    """The JAX accelerator plugins installed here, found as JAX finds them but without importing JAX: modules
    of the `jax_plugins` namespace package, entry points of the `jax_plugins` group, and libtpu."""
    names = {entry.name for entry in entry_points(group="jax_plugins")}
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        names |= {module.name for module in pkgutil.iter_modules(spec.submodule_search_locations)}
    if importlib.util.find_spec("libtpu") is not None:
        names.add("libtpu")
    return sorted(names)


def cpu_is_the_platform(environ: Mapping[str, str] = os.environ, plugins: list[str] | None = None) -> bool:
    """Whether JAX will run on the CPU in a process with this environment (the rule in the module docstring).
    `plugins`: the installed accelerator plugins (default: accelerator_plugins())."""
    platforms = environ.get("JAX_PLATFORMS", "").strip() or environ.get("JAX_PLATFORM_NAME", "").strip()
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    return not (accelerator_plugins() if plugins is None else plugins)


def apply_cpu_defaults(
    environ: MutableMapping[str, str] = os.environ, jaxlib_version: str | None = None
) -> str:
    """Adds meshserve's XLA:CPU flags to XLA_FLAGS, each unless XLA_FLAGS already names it, where JAX will run
    on the CPU (cpu_is_the_platform(environ)); returns the result. Effective only before JAX's CPU backend
    starts (XLA reads the variable once)."""
    flags = environ.get("XLA_FLAGS", "")
    if not cpu_is_the_platform(environ):
        return flags
    for flag in cpu_default_flags(jaxlib_version):
        name = flag.split("=", 1)[0]
        if name not in flags:
            flags = f"{flags} {flag}".strip()
    if flags:
        environ["XLA_FLAGS"] = flags
    return flags

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
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from importlib.metadata import PackageNotFoundError, version

# jaxlib "major.minor" -> the flags known good there.
_CHECKED = {
    "0.10": ("--xla_cpu_experimental_ynn_fusion_type=-individual_convolution",),
}


def cpu_default_flags(jaxlib_version: str | None = None) -> tuple[str, ...]:
    """The flags meshserve adds for this jaxlib (none for a version they were not checked with)."""
    if jaxlib_version is None:
        try:
            jaxlib_version = version("jaxlib")
        except PackageNotFoundError:
            return ()
    return _CHECKED.get(".".join(jaxlib_version.split(".")[:2]), ())


def apply_cpu_defaults(
    environ: MutableMapping[str, str] = os.environ, jaxlib_version: str | None = None
) -> str:
    """Adds meshserve's XLA:CPU flags to XLA_FLAGS, each unless XLA_FLAGS already names it; returns the result.
    Effective only before JAX's CPU backend starts (XLA reads the variable once)."""
    flags = environ.get("XLA_FLAGS", "")
    for flag in cpu_default_flags(jaxlib_version):
        name = flag.split("=", 1)[0]
        if name not in flags:
            flags = f"{flags} {flag}".strip()
    if flags:
        environ["XLA_FLAGS"] = flags
    return flags

"""XLA settings of the test processes, and the options that give a test's programs serving's code back.

The test processes compile at XLA's backend optimisation level 0 and, on the jaxlib it was checked with, with
XLA:CPU's older LLVM IR fusion emitters instead of the MLIR ones (`TEST_XLA_FLAGS`, set by tests/conftest.py,
which says what each saves): the suite is mostly compiling. Both move results at rounding level only, which
every tolerance against diffusers and every layout check absorbs. What they do change is code: level 0 runs
element-wise code unvectorised (jnp.tanh and jnp.sin over 2048 x 2048, 20 times: 2.3 s at level 0, 0.49 s at
2), and the older emitters round some fusions differently from one program to another, where serving's do not
(2026-11-27, jaxlib 0.10.2: the embedded SDXL's pictures with cached prompt rows moved by up to 6e-6 from the
uncached call's, and a padded schedule's loop by 4.4e-4 relative from the exact one at zero terminal SNR).

So two kinds of test compile as serving does, through a pipeline's `xla_options` (docs/compilation.md), the
training's, or `jax.jit(compiler_options=...)`:
- `SERVING_EMITTERS`: a test of a property that rests on the code being the same across programs (a cached
  prompt row equal bit for bit to the batch's encoding, a padded schedule equal to the exact one to 1e-6);
- `SERVING_LEVEL` (serving's level and emitters): a test that runs its programs many times (the held-out
  evaluations of the trained models: 24 captions x 20 steps; the Wan VAE's training step), which also makes
  them the code serving runs.
"""

from __future__ import annotations

from meshserve.models.cpu.xla_cpu_flags import jaxlib_minor

# XLA aborts the process on a flag or option it does not know, so the emitters' switch is used only with the
# jaxlib it was checked with (0.10: `xla_cpu_use_fusion_emitters`, on by default).
_EMITTERS_CHECKED = jaxlib_minor() == "0.10"

TEST_XLA_FLAGS = " ".join(
    ["--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"]
    + (["--xla_cpu_use_fusion_emitters=false"] if _EMITTERS_CHECKED else [])
)
SERVING_EMITTERS: dict = {"xla_cpu_use_fusion_emitters": True} if _EMITTERS_CHECKED else {}
# XLA's default level (DebugOptions' xla_backend_optimization_level), the level `meshserve serve` compiles at.
SERVING_LEVEL = {"xla_backend_optimization_level": 3, **SERVING_EMITTERS}

"""A pool's XLA options (load_pipeline's `xla_options`): checked when the pipeline loads, passed to every program
the pipeline compiles, and carried from the pool config (docs/compilation.md)."""

import jax
import numpy as np
import pytest
from pydantic import ValidationError

from meshserve.models import PipelineError, load_pipeline
from meshserve.models.engine.programs import check_compiler_options, compiler_options
from meshserve.models.flux.pipeline import FluxPipeline
from meshserve.models.sdxl.pipeline import StableDiffusionXLPipeline
from meshserve.models.wan.pipeline import WanPipeline
from meshserve.workers.config import ModelSpec, PoolConfig
from meshserve.workers.pool import runner_options
from tests.xla_level import SERVING_LEVEL


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"xla_no_such_option": True}, "No such compile option: 'xla_no_such_option'"),
        (
            {"xla_backend_optimization_level": "fast"},
            "xla_backend_optimization_level, 'fast' is not a valid int32",
        ),
    ],
)
def test_options_xla_does_not_take_fail_the_load_with_its_reason(tiny_sdxl_path, options, reason):
    with pytest.raises(PipelineError, match=f"xla_options: .*{reason}"):
        load_pipeline(tiny_sdxl_path, xla_options=options)


def test_every_program_compiles_with_the_options_and_computes_the_same(tiny_sdxl_path, monkeypatch):
    seen = []
    compile_lowered = jax.stages.Lowered.compile

    def spy(self, compiler_options=None, **kw):
        seen.append(compiler_options)
        return compile_lowered(self, compiler_options=compiler_options, **kw)

    call = dict(height=32, width=32, num_inference_steps=2, guidance_scale=5.0, seed=0, output_type="np")
    plain = load_pipeline(tiny_sdxl_path)("a cat", **call).images
    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    pipe = load_pipeline(tiny_sdxl_path, xla_options=SERVING_LEVEL)
    images = pipe("a cat", **call).images
    # The text encode, the denoise loop and the decode, each with the pool's options (the tests' processes
    # compile at level 0 otherwise: tests/conftest.py).
    assert pipe.programs.count == 3 and seen[-3:] == [SERVING_LEVEL] * 3, seen
    # Another optimisation level computes the same picture, to rounding.
    assert float(np.abs(images - plain).max()) <= 1e-4


def test_a_pool_passes_its_xla_options_to_its_pipelines():
    options = {"xla_gpu_enable_latency_hiding_scheduler": True}
    pool = PoolConfig(name="p", models=["m"], xla_options=options)
    assert runner_options(pool, ModelSpec())["xla_options"] == options
    assert "xla_options" not in runner_options(PoolConfig(name="p", models=["m"]), ModelSpec())
    with pytest.raises(ValidationError, match="xla_options"):
        PoolConfig(name="p", models=["m"], xla_options={"backend": "cpu"})  # XLA's names only


def test_a_family_sets_its_gpu_options_under_the_pools_own():
    """SDXL turns XLA:GPU's dot merger off on GPUs (models/sdxl/pipeline.py, measured 1.03-1.04x); a pool's own
    value wins; other backends get none of a family's GPU options."""
    gpu = StableDiffusionXLPipeline.gpu_xla_options
    assert gpu == {"xla_gpu_dot_merger_threshold_mb": 0}
    check_compiler_options(gpu)  # a name this XLA knows
    assert compiler_options(gpu, "gpu", None) == gpu
    assert compiler_options(gpu, "gpu", SERVING_LEVEL) == gpu | SERVING_LEVEL
    assert compiler_options(gpu, "gpu", {"xla_gpu_dot_merger_threshold_mb": 32}) == {
        "xla_gpu_dot_merger_threshold_mb": 32
    }
    assert compiler_options(gpu, "cpu", None) is None
    assert compiler_options(gpu, "cpu", SERVING_LEVEL) == SERVING_LEVEL
    assert FluxPipeline.gpu_xla_options == {} and WanPipeline.gpu_xla_options == {}


def test_a_cpu_pipeline_compiles_with_the_pools_options_alone(tiny_sdxl_path):
    assert load_pipeline(tiny_sdxl_path).programs.compiler_options is None
    assert load_pipeline(tiny_sdxl_path, xla_options=SERVING_LEVEL).programs.compiler_options == SERVING_LEVEL

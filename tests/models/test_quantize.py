"""Weight-only int8 (load_pipeline(quantize="int8"), models/components/quantize.py): what is stored on the
devices, how far the pictures move from full precision on the tiny random SDXL and Flux and on the trained
embedded SDXL (which still draws what it is asked), LoRA on top, sharding, and the refused modes.

The bounds are the measured errors (docs/weights.md, "Quantization") with about 3x margin; each is also held
against a floor, so a quantization that did nothing (or an adapter that did nothing) fails.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshserve.models import PipelineError, load_pipeline
from meshserve.models.components.layers import Linear
from meshserve.models.components.quantize import quantize_int8
from tests.fixtures.tiny_lora import pipelines_with_adapter

# The shapes and settings of tests/models/test_lora.py, so the full-precision programs are the ones that file
# compiles (read back from the persistent compilation cache).
H, W = 32, 48
SDXL_TEST_TARGETS = r"(attn[12]\.(to_[qkv]|to_out\.0)|ff\.net\.0\.proj)$"
FLUX_H, FLUX_W, TEXT = 32, 32, 16
PROMPT = "a photo of a cat"


def _abs(a, b) -> tuple[float, float]:
    d = np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))
    return float(d.max()), float(d.mean())


def test_int8_numbers_are_symmetric_per_output_channel():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 5)).astype(np.float32) * np.array([1e-3, 0.1, 1.0, 30.0, 0.0], np.float32)
    q, scale = quantize_int8(w)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (5,)
    np.testing.assert_allclose(scale[:4], np.abs(w[:, :4]).max(0) / 127, rtol=1e-6)
    assert scale[4] == 1.0 and not q[:, 4].any()  # an all-zero column: zeros, no division by zero
    assert np.abs(q).max() == 127 and q.min() >= -127  # symmetric: -128 is never used
    # Rounding to the nearest step: at most half a step per weight, per column.
    assert (np.abs(q * scale - w) <= scale / 2 * (1 + 1e-6)).all()


def _denoiser_layers(pipe):
    from flax import nnx

    module = nnx.merge(pipe._graphs[pipe.denoiser_name], pipe._states[pipe.denoiser_name])
    return [node for _, node in nnx.iter_graph(module) if isinstance(node, Linear)]


def _check_stored_int8(full, quantized):
    """Every Linear of the quantized denoiser holds an int8 kernel and an fp32 scale per output channel; the
    full-precision one none; the denoiser's bytes drop by what that saves."""
    layers = _denoiser_layers(quantized)
    assert (
        layers
        and all(
            layer.kernel.dtype == np.int8
            and layer.kernel_scale.dtype == np.float32
            # A stacked block's Linear (models/components/block_stack.py): [blocks, in, out], scales [blocks, out].
            and layer.kernel_scale.shape == (*layer.kernel.shape[:-2], layer.kernel.shape[-1])
            for layer in layers
        )
    )
    assert not any(hasattr(layer, "kernel_scale") for layer in _denoiser_layers(full))
    name = full.denoiser_name

    def nbytes(pipe):
        return sum(x.nbytes for x in jax.tree.leaves(pipe._states[name]))

    kernels = sum(layer.kernel.size for layer in layers)
    scales = sum(layer.kernel_scale.size for layer in layers)
    assert nbytes(full) - nbytes(quantized) == 3 * kernels - 4 * scales  # fp32 -> int8 kernels, + fp32 scales


# --------------------------------------------------------------------------------------------------
# Tiny random SDXL: int8 against fp32, without and with a LoRA adapter


@pytest.fixture(scope="module")
def sdxl(tiny_sdxl_path, tmp_path_factory):
    """(fp32, int8) pipelines of the tiny SDXL with the same LoRA adapter `a` (rank 4) loaded in both."""
    import torch
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(str(tiny_sdxl_path / "unet"), torch_dtype=torch.float32)
    options = dict(max_loras=2, max_lora_rank=8, lora_budget_mb=4, lora_targets=SDXL_TEST_TARGETS)
    adapter = tmp_path_factory.mktemp("q_lora") / "a.safetensors"
    variants = ({"quantize": None}, {"quantize": "int8"})
    return tuple(
        pipelines_with_adapter(
            tiny_sdxl_path,
            unet,
            SDXL_TEST_TARGETS,
            adapter,
            prefix="unet",
            seed=1,
            variants=variants,
            **options,
        )
    )


def _run_sdxl(pipe, **kw):
    latents = np.random.default_rng(0).standard_normal((1, 4, H // 2, W // 2)).astype(np.float32)
    return pipe(
        PROMPT,
        height=H,
        width=W,
        num_inference_steps=3,
        guidance_scale=5.0,
        latents=latents,
        output_type="np",
        **kw,
    ).images


def test_sdxl_int8_stores_int8_and_stays_close(sdxl):
    full, quantized = sdxl
    _check_stored_int8(full, quantized)
    expected, got = _run_sdxl(full), _run_sdxl(quantized)
    worst, mean = _abs(got, expected)
    # Measured: max 1.6e-3, mean 2.7e-4 per pixel in [0, 1] (images' std 0.16).
    assert 1e-5 < worst <= 1e-2 and mean <= 1.5e-3, (worst, mean)


def test_sdxl_int8_takes_lora_adapters(sdxl):
    """The adapter adds to the int8 layer's dequantized output exactly as to the fp32 one: int8 + adapter is
    as close to fp32 + adapter as int8 is to fp32, while the adapter itself moves the picture far more."""
    full, quantized = sdxl
    with_adapter = {"loras": [{"name": "a", "scale": 0.7}]}
    expected = _run_sdxl(full, **with_adapter)
    worst, mean = _abs(_run_sdxl(quantized, **with_adapter), expected)
    effect, _ = _abs(expected, _run_sdxl(full))  # measured: 3.2e-3 / 4.6e-4 against fp32; the adapter 0.16
    assert worst <= 1e-2 and mean <= 1.5e-3, (worst, mean)
    assert effect > 10 * worst, (effect, worst)


# --------------------------------------------------------------------------------------------------
# Tiny random Flux.1-dev


def test_flux_int8_stores_int8_and_stays_close(tiny_flux_dev_path):
    full, quantized = (load_pipeline(tiny_flux_dev_path, quantize=q) for q in (None, "int8"))
    _check_stored_int8(full, quantized)
    latents = np.random.default_rng(0).standard_normal((1, (FLUX_H // 4) * (FLUX_W // 4), 16))
    kw = dict(
        height=FLUX_H,
        width=FLUX_W,
        num_inference_steps=3,
        guidance_scale=3.5,
        max_sequence_length=TEXT,
        latents=latents.astype(np.float32),
        output_type="np",
    )
    worst, mean = _abs(quantized(PROMPT, **kw).images, full(PROMPT, **kw).images)  # measured 2.4e-3 / 4.2e-4
    assert 1e-5 < worst <= 1e-2 and mean <= 1.5e-3, (worst, mean)


# --------------------------------------------------------------------------------------------------
# Sharding and refused modes


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (XLA_FLAGS host device count)")
def test_int8_keeps_the_weight_sharding_and_the_scale_follows_the_output_axis(tiny_sdxl_path):
    """tensor2 x data2 with the weights split over data: to_q's int8 kernel is split like the fp32 one
    (input width over data, heads over tensor), its scale over tensor like the output; to_out's scale over
    data like its output. Loading only: nothing compiles."""
    pipe = load_pipeline(
        tiny_sdxl_path,
        quantize="int8",
        mesh={"data": 2, "tensor": 2},
        devices=jax.devices()[:4],
        weights={"shard_over": ["data"]},
    )
    attn = pipe._states["unet"]["down_blocks"][1]["attentions"][0]["transformer_blocks"][0]["attn1"]
    to_q, to_out = attn["to_q"], attn["to_out"][0]
    assert to_q["kernel"].get_value().dtype == np.int8
    assert to_q["kernel"].get_value().sharding.spec == P("data", "tensor")
    assert to_q["kernel_scale"].get_value().sharding.spec == P("tensor")
    assert to_out["kernel_scale"].get_value().sharding.spec == P("data")
    kernel = to_q["kernel"].get_value()
    assert {s.data.nbytes for s in kernel.addressable_shards} == {kernel.size // 4}  # 1 byte, 1/4 each


def test_refused_modes_name_the_reason(tiny_sdxl_path):
    with pytest.raises(PipelineError, match="fp8 needs a GPU with fp8 dots"):
        load_pipeline(tiny_sdxl_path, quantize="fp8")
    with pytest.raises(PipelineError, match="quantize must be one of none, int8, fp8"):
        load_pipeline(tiny_sdxl_path, quantize="int4")


# --------------------------------------------------------------------------------------------------
# The trained embedded SDXL: close to fp32, and it still draws the asked colours and shapes


def test_embedded_sdxl_int8_draws_what_it_is_asked(embedded_sdxl):
    from meshserve.training.evaluate import evaluate

    quantized = load_pipeline(None, quantize="int8")
    result, got = evaluate(quantized, (0,))
    # The bars of tests/models/test_embedded.py (fp32 and bf16 meet them on the same 24 held-out captions).
    assert result.colour >= 0.9 and result.background >= 0.9 and result.shape >= 0.7, result
    _, expected = evaluate(embedded_sdxl, (0,))
    worst, mean = _abs(got / 255.0, expected / 255.0)
    # Measured: max 2.4e-2 (6 of 255), mean 5.4e-4; shape read right in 18 of 24 pictures (fp32: 20).
    assert worst <= 0.1 and 1e-4 < mean <= 2e-3, (worst, mean)


def test_a_pools_quantize_reaches_load_pipeline():
    from pydantic import ValidationError

    from meshserve.workers.config import ModelSpec, PoolConfig
    from meshserve.workers.pool import runner_options

    assert (
        runner_options(PoolConfig(name="p", models=["m"], quantize="int8"), ModelSpec())["quantize"] == "int8"
    )
    assert "quantize" not in runner_options(PoolConfig(name="p", models=["m"]), ModelSpec())
    with pytest.raises(ValidationError, match="quantize"):
        PoolConfig(name="p", models=["m"], quantize="int4")
    # The VAE's dtype is a pool field too (docs/outputs.md), passed only when set.
    bf16 = PoolConfig(name="p", models=["m"], vae_dtype="bfloat16")
    assert runner_options(bf16, ModelSpec())["vae_dtype"] == "bfloat16"
    assert "vae_dtype" not in runner_options(PoolConfig(name="p", models=["m"]), ModelSpec())
    assert runner_options(bf16, ModelSpec(options={"vae_dtype": "float32"}))["vae_dtype"] == "float32"
    with pytest.raises(ValidationError, match="vae_dtype"):
        PoolConfig(name="p", models=["m"], vae_dtype="int8")

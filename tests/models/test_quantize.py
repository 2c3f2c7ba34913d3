"""Quantized weights (load_pipeline(quantize="int8" | "fp8"), models/components/quantize.py): what is stored on
the devices, how far the pictures move from full precision on the tiny random SDXL, Flux and Wan and on the
trained embedded SDXL (which still draws what it is asked), LoRA on top, sharding, fp8's activation path
(its numbers, and the fp8 dot it lowers to for a GPU), and the refused modes.

The bounds are the measured errors (docs/weights.md, "Quantization") with about 3x margin; each is also held
against a floor, so a quantization that did nothing (or an adapter that did nothing) fails.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshserve.models import PipelineError, load_pipeline
from meshserve.models.components import quantize as qz
from meshserve.models.components.layers import Linear
from meshserve.models.components.quantize import quantize_int8
from tests.fixtures.tiny_lora import pipelines_with_adapter
from tests.xla_level import SERVING_LEVEL

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


def test_fp8_numbers_are_e4m3_per_output_channel():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 5)).astype(np.float32) * np.array([1e-3, 0.1, 1.0, 30.0, 0.0], np.float32)
    q, scale = qz.quantize_fp8(w)
    assert q.dtype == qz.FP8 and scale.dtype == np.float32 and scale.shape == (5,)
    np.testing.assert_allclose(scale[:4], np.abs(w[:, :4]).max(0) / 448, rtol=1e-6)
    assert scale[4] == 1.0 and not q[:, 4].astype(np.float32).any()
    values = q.astype(np.float32)
    assert np.abs(values[:, :4]).max(0).tolist() == [448.0] * 4  # each column's largest weight maps to 448
    # Nearest e4m3 value: half a step, 2^-4 of the value for normals (3 mantissa bits), 2^-10 below 2^-6.
    err = np.abs(values * scale - w)
    assert (err <= np.maximum(np.abs(w) * 2**-4, 2**-10 * scale) * (1 + 1e-6)).all()
    assert err[:, :4].max() > 0  # it did round


def test_quantization_in_row_blocks_equals_one_pass_over_the_kernel():
    """The host quantizes a kernel in blocks of ROW_BLOCK rows on threads: the same bits as one pass, with a
    column's largest weight in the last, partial block."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((2 * qz.ROW_BLOCK + 77, 9)).astype(np.float32)
    w[-1, 3] = 50.0
    for quantize, top, convert in (
        (qz.quantize_int8, 127.0, lambda s: np.clip(np.rint(s), -127, 127).astype(np.int8)),
        (qz.quantize_fp8, 448.0, lambda s: np.clip(s, -448, 448).astype(qz.FP8)),
    ):
        scale = (np.abs(w).max(0) / top).astype(np.float32)
        q, got_scale = quantize(w)
        assert np.array_equal(got_scale, scale)
        assert np.array_equal(q.view(np.uint8), convert(w / scale).view(np.uint8))


def _host_fp8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The activation rows' quantization, on the host: e4m3 values as float32 and each row's scale."""
    scale = np.abs(x).max(-1, keepdims=True) / 448
    return np.clip(x / scale, -448, 448).astype(qz.FP8).astype(np.float32), scale


def test_fp8_matmul_weight_only_and_with_activations_match_the_host():
    """Weight-only: x @ (q * scale); with activations, each row of x quantized with its own scale and both
    e4m3 operands multiplied: the same numbers computed on the host, and a further error over weight-only."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 7, 96)) * rng.uniform(0.01, 10, (3, 7, 1))).astype(np.float32)
    w = rng.standard_normal((96, 40)).astype(np.float32)
    bias = rng.standard_normal(40).astype(np.float32)
    q, scale = qz.quantize_fp8(w)
    dequantized = q.astype(np.float32) * scale
    run = jax.jit(qz.quantized_matmul, static_argnames=("dtype", "activations"))

    weight_only = np.asarray(run(x, q, scale, bias, dtype=None))
    np.testing.assert_allclose(weight_only, x @ dequantized + bias, rtol=1e-5, atol=1e-4)

    rows, row_scale = _host_fp8(x)
    with_activations = np.asarray(run(x, q, scale, bias, dtype=None, activations="fp8-upcast"))
    np.testing.assert_allclose(
        with_activations, (rows @ q.astype(np.float32)) * row_scale * scale + bias, rtol=1e-5, atol=1e-4
    )
    full = x @ w + bias
    rel = lambda y: float(np.abs(y - full).max() / np.abs(full).max())  # noqa: E731
    # Measured: weight-only 1.1e-2, with activations 2.0e-2 of the largest output.
    assert 1e-3 < rel(weight_only) < rel(with_activations) < 5e-2, (rel(weight_only), rel(with_activations))
    with pytest.raises(qz.QuantizeError, match="on a int8 kernel"):
        qz.quantized_matmul(x, *quantize_int8(w), None, None, activations="fp8-upcast")


def test_fp8_activations_lower_to_an_fp8_dot_with_fast_accumulation_for_a_gpu():
    """What XLA:GPU gets (lowered for CUDA here, nothing compiled): the dot takes both operands as e4m3 with
    the fast-accumulation algorithm (issue 24: a plain e4m3 dot_general ran no faster than bf16 on an H100);
    weight-only, the dot takes the kernel converted to the compute dtype. Inputs of fewer than FP8_MIN_ROWS
    rows run weight-only: XLA:GPU rewrites a one-row dot into a multiply and a reduce, which refuses the fp8
    algorithm (the FLUX.1-dev step at batch 1 failed to compile so on an H200, 2026-11-26)."""

    def dot_lines(activations, rows=(16,)):
        lowered = (
            jax.jit(qz.quantized_matmul, static_argnames=("dtype", "activations"))
            .trace(
                jax.ShapeDtypeStruct((*rows, 64), jax.numpy.bfloat16),
                jax.ShapeDtypeStruct((64, 32), qz.FP8),
                jax.ShapeDtypeStruct((32,), jax.numpy.float32),
                None,
                dtype=None,
                activations=activations,
            )
            .lower(lowering_platforms=("cuda",))
        )
        return [line for line in lowered.as_text().splitlines() if "stablehlo.dot_general" in line]

    assert qz.FP8_MIN_ROWS == 16
    for rows in ((16,), (2, 8)):
        (fp8,) = dot_lines("fp8", rows)
        shape = "x".join(map(str, rows))
        assert f"tensor<{shape}x64xf8E4M3FN>, tensor<64x32xf8E4M3FN>" in fp8, fp8
        assert "allow_imprecise_accumulation = true" in fp8
    (weight_only,) = dot_lines(None)
    assert "f8E4M3FN" not in weight_only and "tensor<64x32xbf16>" in weight_only
    for rows in ((1,), (1, 1), (15,)):
        (few_rows,) = dot_lines("fp8", rows)
        assert "f8E4M3FN" not in few_rows and "algorithm" not in few_rows, (rows, few_rows)


class _Device:
    def __init__(self, platform, compute_capability=None):
        self.platform, self.compute_capability = platform, compute_capability


def test_fp8_quantizes_activations_only_where_the_devices_have_fp8_dots():
    h100, a100, cpu = _Device("gpu", "9.0"), _Device("gpu", "8.0"), _Device("cpu")
    assert qz.fp8_dots_available([h100, _Device("gpu", "8.9")]) and not qz.fp8_dots_available([h100, a100])
    assert qz.activation_mode("fp8", None, [h100]) == "fp8"
    assert qz.activation_mode("fp8", None, [a100]) is None and qz.activation_mode("fp8", None, [cpu]) is None
    assert qz.activation_mode("fp8", True, [cpu]) == "fp8-upcast"
    assert qz.activation_mode("fp8", False, [h100]) is None
    assert qz.activation_mode("int8", None, [h100]) is None and qz.activation_mode(None, None, [h100]) is None
    with pytest.raises(qz.QuantizeError, match="fp8_activations needs quantize: fp8"):
        qz.activation_mode("int8", True, [h100])


def _denoiser_layers(pipe):
    from flax import nnx

    module = nnx.merge(pipe._graphs[pipe.denoiser_name], pipe._states[pipe.denoiser_name])
    return [node for _, node in nnx.iter_graph(module) if isinstance(node, Linear)]


def _stored_kernel(layer):
    """A quantized Linear's kernel as stored: [in, out] `kernel`, or [out, in] `kernel_t` with activations."""
    return getattr(layer, qz.TRANSPOSED) if hasattr(layer, qz.TRANSPOSED) else layer.kernel


def _check_stored(full, quantized, dtype=np.int8, activations=None):
    """Every Linear of the quantized denoiser holds an int8 (or `dtype`) kernel and an fp32 scale per output
    channel, and its activation mode; with activations the kernel transposed, [out, in] as `kernel_t` and no
    `kernel`; the full-precision one none; the denoiser's bytes drop by what that saves."""
    layers = _denoiser_layers(quantized)
    full_shapes = {tuple(layer.kernel.shape) for layer in _denoiser_layers(full)}
    assert (
        layers
        and all(
            _stored_kernel(layer).dtype == dtype
            and getattr(layer, qz.ACTIVATIONS, None) == activations
            and hasattr(layer, "kernel") == (activations is None)
            and layer.kernel_shape in full_shapes
            and layer.kernel_scale.dtype == np.float32
            # A stacked block's Linear (models/components/block_stack.py): [blocks, in, out], scales [blocks, out].
            and layer.kernel_scale.shape == (*layer.kernel_shape[:-2], layer.kernel_shape[-1])
            for layer in layers
        )
    )
    if activations is not None:  # stored [out, in]: the transpose of the [in, out] shape
        assert all(
            _stored_kernel(layer).shape[-2:] == (layer.kernel_shape[-1], layer.kernel_shape[-2])
            for layer in layers
        )
    assert not any(hasattr(layer, "kernel_scale") for layer in _denoiser_layers(full))
    name = full.denoiser_name

    def nbytes(pipe):
        return sum(x.nbytes for x in jax.tree.leaves(pipe._states[name]))

    kernels = sum(_stored_kernel(layer).size for layer in layers)
    scales = sum(layer.kernel_scale.size for layer in layers)
    assert nbytes(full) - nbytes(quantized) == 3 * kernels - 4 * scales  # fp32 -> int8 kernels, + fp32 scales


# --------------------------------------------------------------------------------------------------
# Tiny random SDXL: int8 against fp32, without and with a LoRA adapter


@pytest.fixture(scope="module")
def sdxl(tiny_sdxl_path, tmp_path_factory):
    """(fp32, int8, fp8 with activations) pipelines of the tiny SDXL with the same LoRA adapter `a` (rank 4)
    loaded in each."""
    import torch
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(str(tiny_sdxl_path / "unet"), torch_dtype=torch.float32)
    options = dict(max_loras=2, max_lora_rank=8, lora_budget_mb=4, lora_targets=SDXL_TEST_TARGETS)
    adapter = tmp_path_factory.mktemp("q_lora") / "a.safetensors"
    variants = ({"quantize": None}, {"quantize": "int8"}, {"quantize": "fp8", "fp8_activations": True})
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
    full, quantized, _ = sdxl
    _check_stored(full, quantized)
    expected, got = _run_sdxl(full), _run_sdxl(quantized)
    worst, mean = _abs(got, expected)
    # Measured: max 1.6e-3, mean 2.7e-4 per pixel in [0, 1] (images' std 0.16).
    assert 1e-5 < worst <= 1e-2 and mean <= 1.5e-3, (worst, mean)


def test_sdxl_int8_takes_lora_adapters(sdxl):
    """The adapter adds to the int8 layer's dequantized output exactly as to the fp32 one: int8 + adapter is
    as close to fp32 + adapter as int8 is to fp32, while the adapter itself moves the picture far more."""
    full, quantized, _ = sdxl
    with_adapter = {"loras": [{"name": "a", "scale": 0.7}]}
    expected = _run_sdxl(full, **with_adapter)
    worst, mean = _abs(_run_sdxl(quantized, **with_adapter), expected)
    effect, _ = _abs(expected, _run_sdxl(full))  # measured: 3.2e-3 / 4.6e-4 against fp32; the adapter 0.16
    assert worst <= 1e-2 and mean <= 1.5e-3, (worst, mean)
    assert effect > 10 * worst, (effect, worst)


def test_sdxl_fp8_with_activations_stays_close_and_takes_lora_adapters(sdxl):
    """fp8 as a GPU with fp8 dots runs it (e4m3 kernels and activation rows; the dot upcast on this CPU)."""
    full, _, fp8 = sdxl
    _check_stored(full, fp8, qz.FP8, "fp8-upcast")
    worst, mean = _abs(_run_sdxl(fp8), _run_sdxl(full))
    # Measured: max 2.8e-2, mean 4.3e-3 (int8: 1.6e-3 / 2.7e-4).
    assert 1e-3 < worst <= 8e-2 and mean <= 1.3e-2, (worst, mean)
    with_adapter = {"loras": [{"name": "a", "scale": 0.7}]}
    expected = _run_sdxl(full, **with_adapter)
    worst_adapted, _ = _abs(_run_sdxl(fp8, **with_adapter), expected)  # measured 3.3e-2; the adapter: 0.16
    assert worst_adapted <= 8e-2 and _abs(expected, _run_sdxl(full))[0] > 2 * worst_adapted, worst_adapted


# --------------------------------------------------------------------------------------------------
# Tiny random Flux.1-dev and Wan


def _flux_call() -> dict:
    """The tiny Flux's call: 3 steps at 32x32 from fixed latents, guidance 3.5."""
    latents = np.random.default_rng(0).standard_normal((1, (FLUX_H // 4) * (FLUX_W // 4), 16))
    return dict(
        height=FLUX_H,
        width=FLUX_W,
        num_inference_steps=3,
        guidance_scale=3.5,
        max_sequence_length=TEXT,
        latents=latents.astype(np.float32),
        output_type="np",
    )


def test_flux_int8_and_fp8_store_their_kernels_and_stay_close(tiny_flux_dev_path):
    """int8; fp8 as this CPU runs it (weight-only); fp8 as a GPU with fp8 dots runs it (activations too)."""
    full, quantized, fp8, fp8_activations = (
        load_pipeline(tiny_flux_dev_path, quantize=q, fp8_activations=a)
        for q, a in ((None, None), ("int8", None), ("fp8", None), ("fp8", True))
    )
    _check_stored(full, quantized)
    _check_stored(full, fp8, qz.FP8)
    _check_stored(full, fp8_activations, qz.FP8, "fp8-upcast")
    kw = _flux_call()
    expected = full(PROMPT, **kw).images
    worst, mean = _abs(quantized(PROMPT, **kw).images, expected)  # measured 2.4e-3 / 4.2e-4
    assert 1e-5 < worst <= 1e-2 and mean <= 1.5e-3, (worst, mean)
    worst, mean = _abs(fp8(PROMPT, **kw).images, expected)  # measured 1.4e-2 / 2.4e-3
    assert 1e-3 < worst <= 4e-2 and mean <= 7e-3, (worst, mean)
    worst, mean = _abs(fp8_activations(PROMPT, **kw).images, expected)  # measured 1.7e-2 / 2.9e-3
    assert 1e-3 < worst <= 5e-2 and mean <= 9e-3, (worst, mean)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (XLA_FLAGS host device count)")
def test_flux_fp8_activations_on_tensor2_match_one_device(tiny_flux_dev_path):
    """On tensor2 each row's scale is the absmax over the whole row (a layer whose input width is split takes
    it across both devices), so the layout draws what one device draws, to rounding: a flipped e4m3 rounding
    downstream of a reordered sum, far below fp8's own error."""
    one, two = (
        load_pipeline(tiny_flux_dev_path, quantize="fp8", fp8_activations=True, **layout)
        for layout in ({}, {"mesh": {"tensor": 2}, "devices": jax.devices()[:2]})
    )
    kw = _flux_call()
    worst, mean = _abs(two(PROMPT, **kw).images, one(PROMPT, **kw).images)
    # Measured: max 3.6e-7, mean 5.5e-8 with XLA's default backend optimisation (no rounding flipped); 1.9e-3 /
    # 1.5e-4 at the suite's level 0 (tests/conftest.py), where the two layouts' sums round a few e4m3 values the
    # other way. A scale per device's half row would move the picture by about fp8's own error (1.7e-2 / 2.9e-3
    # against fp32; an estimate, that bug was not simulated): the mean bound sits 6x under that, 3x over the flips.
    assert worst <= 5e-3 and mean <= 5e-4, (worst, mean)


def test_wan_fp8_with_activations_stays_close(tiny_wan_path):
    full, fp8 = (
        load_pipeline(tiny_wan_path, quantize=q, fp8_activations=a) for q, a in ((None, None), ("fp8", True))
    )
    _check_stored(full, fp8, qz.FP8, "fp8-upcast")
    latents = (
        np.random.default_rng(0).standard_normal((1, 4, 3, 6, 10)).astype(np.float32)
    )  # diffusers' layout
    kw = dict(height=48, width=80, num_frames=9, num_inference_steps=3, latents=latents, output_type="np")
    # Measured: max 9.5e-2, mean 6.3e-3 (weight-only fp8: 2.7e-2 / 2.5e-3; int8: 4.2e-3 / 3.9e-4): e4m3 keeps 3
    # mantissa bits, so each weight and activation is off by up to 1/16 of itself, where int8's step is
    # 1/254 of its column's largest weight; random weights carry that through 3 steps and the 3D VAE.
    worst, mean = _abs(fp8(PROMPT, **kw).images, full(PROMPT, **kw).images)
    assert 1e-3 < worst <= 0.3 and mean <= 2e-2, (worst, mean)


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


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (XLA_FLAGS host device count)")
def test_fp8_activations_store_the_kernel_transposed_with_its_sharding_reversed(tiny_sdxl_path):
    """With fp8 activations the e4m3 kernel is stored [out, in] (`kernel_t`, the layout cuBLASLt's fp8 GEMM
    takes), split like the [in, out] kernel with its axes swapped: to_q's heads over tensor, its input width
    over data; its values the [in, out] kernel's, transposed. Loading only: nothing compiles."""
    layout = dict(mesh={"data": 2, "tensor": 2}, devices=jax.devices()[:4], weights={"shard_over": ["data"]})
    plain, transposed = (
        load_pipeline(tiny_sdxl_path, quantize="fp8", fp8_activations=a, **layout) for a in (False, True)
    )

    def to_q(pipe):
        blocks = pipe._states["unet"]["down_blocks"][1]["attentions"][0]["transformer_blocks"]
        return blocks[0]["attn1"]["to_q"]

    stored, kept = to_q(transposed), to_q(plain)
    assert "kernel" not in stored and "kernel" in kept
    assert kept["kernel"].get_value().sharding.spec == P("data", "tensor")
    assert stored[qz.TRANSPOSED].get_value().sharding.spec == P("tensor", "data")
    assert stored["kernel_scale"].get_value().sharding.spec == P("tensor")
    np.testing.assert_array_equal(
        np.asarray(stored[qz.TRANSPOSED].get_value()).astype(np.float32),
        np.asarray(kept["kernel"].get_value()).astype(np.float32).T,
    )


def test_refused_modes_name_the_reason(tiny_sdxl_path):
    with pytest.raises(PipelineError, match="quantize must be one of none, int8, fp8"):
        load_pipeline(tiny_sdxl_path, quantize="int4")
    with pytest.raises(PipelineError, match="fp8_activations needs quantize: fp8, not int8"):
        load_pipeline(tiny_sdxl_path, quantize="int8", fp8_activations=True)


# --------------------------------------------------------------------------------------------------
# The trained embedded SDXL: close to fp32, and it still draws the asked colours and shapes


def test_embedded_sdxl_int8_and_fp8_draw_what_they_are_asked():
    """int8, and fp8 as a GPU with fp8 dots runs it (activations too): the held-out bars, and the pictures
    close to fp32's (the bf16 figures, from a script: docs/weights.md)."""
    from meshserve.training.evaluate import evaluate

    # fp32 at serving's level too: the programs of tests/models/test_embedded.py's fp32 evaluation (one compile
    # for the suite, from the persistent cache), which run the 24 pictures 2.4x faster than the suite's level
    # (3.6 against 8.5 s once compiled, 2026-11-25: bench/README.md, "The test suite's time").
    _, expected = evaluate(load_pipeline(None, xla_options=SERVING_LEVEL), (0,))
    for quantize, activations, bound in (("int8", None, 2e-3), ("fp8", True, 1e-2)):
        # 24 pictures of 20 steps each: compiled at serving's level (tests/xla_level.py).
        pipe = load_pipeline(None, quantize=quantize, fp8_activations=activations, xla_options=SERVING_LEVEL)
        result, got = evaluate(pipe, (0,))
        # The bars of tests/models/test_embedded.py (fp32 and bf16 meet them on the same 24 held-out captions).
        assert result.colour >= 0.9 and result.background >= 0.9 and result.shape >= 0.7, (quantize, result)
        worst, mean = _abs(got / 255.0, expected / 255.0)
        # Measured: int8 max 2.4e-2 (6 of 255), mean 5.4e-4; fp8 with activations max 0.11 (28 of 255), mean
        # 3.8e-3 (seeds 0 and 1).
        assert worst <= 0.25 and 1e-4 < mean <= bound, (quantize, worst, mean)


def test_a_pools_quantize_reaches_load_pipeline():
    from pydantic import ValidationError

    from meshserve.workers.config import ModelSpec, PoolConfig
    from meshserve.workers.pool import runner_options

    assert (
        runner_options(PoolConfig(name="p", models=["m"], quantize="int8"), ModelSpec())["quantize"] == "int8"
    )
    assert "quantize" not in runner_options(PoolConfig(name="p", models=["m"]), ModelSpec())
    assert (
        runner_options(PoolConfig(name="p", models=["m"], quantize="fp8"), ModelSpec())["quantize"] == "fp8"
    )
    with pytest.raises(ValidationError, match="quantize"):
        PoolConfig(name="p", models=["m"], quantize="int4")
    # The VAE's dtype is a pool field too (docs/outputs.md), passed only when set.
    bf16 = PoolConfig(name="p", models=["m"], vae_dtype="bfloat16")
    assert runner_options(bf16, ModelSpec())["vae_dtype"] == "bfloat16"
    assert "vae_dtype" not in runner_options(PoolConfig(name="p", models=["m"]), ModelSpec())
    assert runner_options(bf16, ModelSpec(options={"vae_dtype": "float32"}))["vae_dtype"] == "float32"
    with pytest.raises(ValidationError, match="vae_dtype"):
        PoolConfig(name="p", models=["m"], vae_dtype="int8")

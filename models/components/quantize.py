"""Quantized weights for the denoiser's Linear layers (a pool's `quantize: int8 | fp8`; docs/weights.md).

    load_pipeline(folder, quantize="int8")   # or "fp8"

Every `layers.Linear` of the denoiser (UNet, Flux or Wan transformer) stores its kernel [in, out] as int8 with
one fp32 scale per output channel, symmetric: scale = absmax(column) / 127, q = round(w / scale). The matmul
runs in the compute dtype on the int8 values converted (exact: |q| <= 127 fits bf16's 8-bit mantissa) and
scales its fp32 result per output channel, (x @ q) * scale, which equals x @ (q * scale) up to rounding.

What is not quantized, and why: convolutions (the UNet's resnets; a third of SDXL's UNet), SDXL's GEGLU
projection (`LinearHalves`, [in, 2, out]), Wan's patch embedding, norms, biases and embeddings, the text
encoders (transformers' plain nnx.Linear; they run once per request, not once per step) and the VAE. The
figures of what that leaves in each model are in docs/weights.md.

Quantization happens on the host, between reading the checkpoint and placing each array on its devices (the
loader's `place` hook), so a device never holds the full-precision kernel. The int8 kernel keeps the weight's
sharding rule (its checkpoint key is unchanged); the scale, keyed `<layer>.weight_scale`, follows the rule's
output axis (`quantized_rules`), so a tensor-split or FSDP-split layer has its scales split the same way.

fp8 stores the same kernels as float8_e4m3fn with one fp32 scale per output channel, scale = absmax / 448
(e4m3's largest finite value), q = w / scale rounded to the nearest e4m3 value. Where the backend has fp8 dots
(a GPU of compute capability 8.9 or more: L4, H100, ...), the activations are quantized too, each row
(token) with its own scale, absmax / 448, and the dot takes both e4m3 operands with
`DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM` (issue 24: a plain dot_general on e4m3 inputs ran at bf16's
speed on an H100, 477 against 506 TFLOP/s, the preset at 933); the f32 result is scaled by the row's and the
column's scales; an input of fewer than FP8_MIN_ROWS rows (the modulation layers at batch 1) runs
weight-only. Such a layer stores its e4m3 kernel transposed, [out, in] as `kernel_t` (diffusers' own layout),
because cuBLASLt's fp8 GEMM takes both operands with the contracted dimension minor: stored [in, out], XLA:GPU
copied every stacked kernel into that layout once a call, a temporary as large as the kernels (FLUX.1-dev's
denoise program: 8.48 GiB on an H200, and 8 of its MLP blocks in bench/fp8_layout.py 936 MiB of temporaries
against 360 [out, in], 1.06x slower; 2026-11-27). Its sharding rule is the kernel's with the axes reversed
(`quantized_rules`). Elsewhere (the CPU, older GPUs) fp8 runs weight-only: the e4m3 kernel converted to the
compute dtype, as int8's is, and the activations untouched. `load_pipeline(..., fp8_activations=True)` asks
for the activation quantization on any backend (on the CPU the e4m3 dot runs on upcast values: the GPU path's
numbers, to the order of the sums, for measuring its error here).
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("none", "int8", "fp8")
SCALE = "kernel_scale"  # the Linear's scale attribute; its checkpoint-style key is `<layer>.weight_scale`
# The attribute holding a Linear's e4m3 kernel [out, in] where its activations are quantized too (the module
# docstring says why); its checkpoint-style key is `<layer>.weight_t`.
TRANSPOSED = "kernel_t"
# The Linear's static attribute (part of its graph, not its state) when its input rows are quantized too:
# "fp8" (the e4m3 dot with the fast-accumulation algorithm: GPUs with fp8 dots) or "fp8-upcast" (the same
# numbers with the dot on upcast values: any backend).
ACTIVATIONS = "quantize_activations"
ACTIVATION_MODES = ("fp8", "fp8-upcast")
FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
# Compute capability from which NVIDIA GPUs have fp8 tensor-core dots (Ada, Hopper and later).
FP8_DOTS_FROM = (8, 9)
# Fewer input rows than this and an fp8 Linear runs weight-only even where its activations are quantized. XLA:GPU
# rewrites a dot with a one-row operand (the modulation and embedding layers at batch 1) into a multiply and a
# reduce (its DotStrengthReduction pass), which takes no fp8 algorithm: the FLUX.1-dev step failed to compile so
# ("Unsupported dot precision algorithm: 2") on an H200 with jax 0.11.2 (2026-11-26). 16, not 2: cuBLASLt's
# fp8 GEMM wants dimensions in multiples of 16, and a dot of a few rows is bound by reading its kernel, which is
# e4m3 weight-only too.
FP8_MIN_ROWS = 16


class QuantizeError(ValueError):
    """An unknown quantization mode, or one this backend cannot run."""


def check_mode(mode: str | None) -> str | None:
    """The mode a pipeline runs ("int8" or "fp8") or None for full precision; QuantizeError for anything else."""
    if mode is None or mode == "none":
        return None
    if mode in MODES:
        return mode
    raise QuantizeError(f"quantize must be one of {', '.join(MODES)}, got {mode!r}")


def fp8_dots_available(devices=None) -> bool:
    """Whether every device (default: jax.devices()) is a GPU with fp8 dots (compute capability >= 8.9)."""
    devices = jax.devices() if devices is None else devices
    for device in devices:
        capability = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
        if not capability:
            return False
        major, minor = (int(part) for part in str(capability).split(".")[:2])
        if (major, minor) < FP8_DOTS_FROM:
            return False
    return bool(devices)


def activation_mode(mode: str | None, activations: bool | None, devices) -> str | None:
    """How a pool's quantized Linear layers treat their inputs (None: weight-only; ACTIVATION_MODES). fp8 on
    `devices` that all have fp8 dots quantizes them ("fp8"); elsewhere it runs weight-only unless
    `activations` is True ("fp8-upcast": the GPU path's numbers on any backend); False keeps weight-only."""
    if mode != "fp8":
        if activations:
            raise QuantizeError(f"fp8_activations needs quantize: fp8, not {mode or 'none'}")
        return None
    if activations is False:
        return None
    if fp8_dots_available(devices):
        return "fp8"
    return "fp8-upcast" if activations else None


# --------------------------------------------------------------------------------------------------
# The numbers


# Host quantization runs in blocks of rows on a thread pool: numpy's loops release the GIL, and a block fits the
# cache better than the whole kernel. A [3072, 12288] bf16 kernel to fp8: 0.15-0.17 s instead of 0.37-0.51 s on 2
# cores, bit-identical (2026-11-26); FLUX.1-dev took 210 s to load quantized against 49 s unquantized on a
# 16-core GPU host before, 119 s against 57 s after (two H200 runs that day).
ROW_BLOCK = 512


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="quantize")


def _per_channel(kernel: np.ndarray, top: float, convert: Callable, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(convert(kernel / scale) as `dtype`, fp32 scale [out]) with scale = each output channel's absmax / `top`
    (an all-zero column: scale 1), computed in float32 block by block."""
    blocks = [slice(i, i + ROW_BLOCK) for i in range(0, kernel.shape[0], ROW_BLOCK)]
    absmax = np.zeros(kernel.shape[1], np.float32)
    for block_max in _pool().map(lambda b: np.abs(np.asarray(kernel[b], np.float32)).max(axis=0), blocks):
        np.maximum(absmax, block_max, out=absmax)
    scale = np.where(absmax > 0, absmax / top, 1.0).astype(np.float32)
    out = np.empty(kernel.shape, dtype)

    def fill(b: slice) -> None:
        out[b] = convert(np.asarray(kernel[b], np.float32) / scale)

    list(_pool().map(fill, blocks))
    return out, scale


def quantize_int8(kernel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Linear kernel [in, out] -> (int8 [in, out], fp32 scale [out]): symmetric per output channel,
    scale = absmax / 127 (an all-zero column gets scale 1 and zeros)."""
    return _per_channel(kernel, 127.0, lambda scaled: np.clip(np.rint(scaled), -127, 127), np.int8)


def quantize_fp8(kernel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Linear kernel [in, out] -> (float8_e4m3fn [in, out], fp32 scale [out]): per output channel, scale =
    absmax / 448, each weight / scale rounded to the nearest e4m3 value (an all-zero column: scale 1)."""
    return _per_channel(kernel, FP8_MAX, lambda scaled: np.clip(scaled, -FP8_MAX, FP8_MAX), FP8)


def quantize_kernel(kernel: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """The kernel and its per-output-channel scale in `mode` ("int8" or "fp8")."""
    return {"int8": quantize_int8, "fp8": quantize_fp8}[mode](kernel)


def transposed(q: np.ndarray) -> np.ndarray:
    """q [in, out] -> a C-contiguous [out, in], copied in blocks of rows on the thread pool (numpy's strided
    copy is single-threaded, and FLUX.1-dev's e4m3 kernels are 12 GB)."""
    out = np.empty(q.shape[::-1], q.dtype)

    def fill(b: slice) -> None:
        out[:, b] = q[b].T

    list(_pool().map(fill, [slice(i, i + ROW_BLOCK) for i in range(0, q.shape[0], ROW_BLOCK)]))
    return out


def quantize_rows_fp8(x):
    """Traced: x [..., in] -> (e4m3 [..., in], fp32 scale [..., 1]), one scale per row, absmax / 448."""
    x = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / FP8_MAX, 1.0)
    return jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(FP8), scale


def quantized_matmul(x, q, scale, bias, dtype, *, activations: str | None = None, kernel_in_axis: int = 0):
    """x @ (q * scale) + bias for an int8 or e4m3 kernel q [in, out] with fp32 scale [out], x in `dtype`
    (None: x's). Weight-only: q converted to the compute dtype (exact: int8's |q| <= 127 and every e4m3 value
    fit bf16), the dot's fp32 result scaled once. `activations` (e4m3 kernels only; ACTIVATION_MODES): x's
    rows quantized to e4m3 too and the dot taken on both e4m3 operands, with the fp8 fast-accumulation
    algorithm ("fp8") or on the values upcast ("fp8-upcast": what a backend without fp8 dots can run).
    `kernel_in_axis` 1: q is stored [out, in] (diffusers' own layout, the one cuBLASLt's fp8 GEMM takes
    without a transpose), as a layer whose activations are quantized stores it (`TRANSPOSED`).

    The kernel passes an optimization barrier with x first: it then depends on this layer's input, so XLA
    cannot hoist its int8 -> float convert out of the denoise loop (loop-invariant code motion would hold a
    full-precision copy of every kernel for the whole generation, undoing the saving; models/parallel/
    placement.py's gather_weights_per_step ties FSDP gathers the same way)."""
    dtype = dtype or x.dtype
    x, q = jax.lax.optimization_barrier((x.astype(dtype), q))
    dims = (((x.ndim - 1,), (kernel_in_axis,)), ((), ()))
    if activations and (q.dtype != FP8 or activations not in ACTIVATION_MODES):
        raise QuantizeError(f"activation quantization {activations!r} on a {q.dtype} kernel")
    if activations and math.prod(x.shape[:-1]) >= FP8_MIN_ROWS:
        rows, row_scale = quantize_rows_fp8(x)
        fast = activations == "fp8"
        precision = jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM if fast else None
        y = jax.lax.dot_general(rows, q, dims, precision=precision, preferred_element_type=jnp.float32)
        y = y * row_scale
    else:
        y = jax.lax.dot_general(x, q.astype(dtype), dims, preferred_element_type=jnp.float32)
    y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dtype)


# --------------------------------------------------------------------------------------------------
# Loading


def quantized_rules(rules: Sequence[tuple[str, tuple]]) -> tuple[tuple[str, tuple], ...]:
    """A model's sharding rules plus, per Linear kernel rule, one for its scale, split like the kernel's
    output axis, and one for its transposed e4m3 kernel, the axes reversed (`to_q.weight: ("embed",
    "heads")` -> `to_q.weight_scale: ("heads",)`, `to_q.weight_t: ("heads", "embed")`)."""
    kernels = [(p, logical) for p, logical in rules if len(logical) == 2 and p.endswith(r"\.weight$")]
    scales = tuple(
        (re.sub(r"\\\.weight\$$", r"\\.weight_scale$", p), (logical[-1],)) for p, logical in kernels
    )
    transposes = tuple(
        (re.sub(r"\\\.weight\$$", r"\\.weight_t$", p), logical[::-1]) for p, logical in kernels
    )
    return tuple(rules) + scales + transposes


def load_quantized(
    loader: Callable,
    path,
    *,
    place: Callable | None,
    mode: str = "int8",
    activations: str | None = None,
    **kwargs,
):
    """`loader(path, place=..., **kwargs)` with every 2-D `kernel` it places quantized to `mode` ("int8" or
    "fp8") on the host, its scale placed beside it and attached to its layers.Linear as `kernel_scale`, and
    `activations` (fp8 only: ACTIVATION_MODES, or None for weight-only) set on each such layer, whose kernel
    is then stored transposed as TRANSPOSED, placed by its `<layer>.weight_t` rule (`quantized_rules`). A 2-D
    kernel that does not belong to a layers.Linear (whose __call__ knows the quantized path) is an error, not
    a silent wrong matmul."""
    if activations is not None and (mode != "fp8" or activations not in ACTIVATION_MODES):
        raise QuantizeError(f"activation quantization {activations!r} needs quantize: fp8, not {mode!r}")
    from flax import nnx

    from meshserve.models.components.layers import Linear

    def put(path: tuple, array: np.ndarray):
        return place(path, array) if place is not None else jax.device_put(array)  # as load_weights

    scales: dict[tuple, jax.Array] = {}

    def quantizing_place(path: tuple, array: np.ndarray):
        if str(path[-1]) != "kernel" or array.ndim != 2:
            return put(path, array)
        q, scale = quantize_kernel(array, mode)
        scales[tuple(path[:-1])] = put((*path[:-1], SCALE), scale)
        # Transposed, the kernel is placed by its own rule; the loader sets it as `kernel` (it checked the
        # shape before placing) and the loop below moves it to TRANSPOSED.
        return put((*path[:-1], TRANSPOSED), transposed(q)) if activations else put(path, q)

    module = loader(path, place=quantizing_place, **kwargs)
    layers = {tuple(p): node for p, node in nnx.iter_graph(module)}
    for owner, scale in scales.items():
        layer = layers.get(owner)
        if not isinstance(layer, Linear):
            raise QuantizeError(
                f"{path}: {'.'.join(map(str, owner))} has a 2-D kernel but is a {type(layer).__name__}, "
                "not a layers.Linear; it has no quantized path"
            )
        layer.kernel_scale = nnx.Param(scale)
        if activations is not None:
            setattr(layer, ACTIVATIONS, activations)
            setattr(layer, TRANSPOSED, nnx.Param(layer.kernel.get_value()))
            del layer.kernel
    return module


def weight_bytes(state) -> dict[str, int]:
    """Bytes of a module state by dtype name ({"int8": ..., "float8_e4m3fn": ..., "float32": ...}), whole
    arrays."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(state):
        name = jnp.dtype(leaf.dtype).name
        out[name] = out.get(name, 0) + int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
    return out

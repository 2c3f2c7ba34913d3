"""Weight-only int8 quantization of the denoiser's Linear layers (a pool's `quantize: int8`; docs/weights.md).

    load_pipeline(folder, quantize="int8")

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

fp8 (e4m3 weights and activations for the GPUs that have fp8 dots) is refused on every backend for now: this
build has no fp8 path, and a silent fallback to int8 or bf16 would misreport what a pool serves.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("none", "int8", "fp8")
SCALE = "kernel_scale"  # the Linear's scale attribute; its checkpoint-style key is `<layer>.weight_scale`


class QuantizeError(ValueError):
    """An unknown quantization mode, or one this backend cannot run."""


def check_mode(mode: str | None) -> str | None:
    """The mode a pipeline runs ("int8") or None for full precision; QuantizeError for anything else."""
    if mode is None or mode == "none":
        return None
    if mode == "int8":
        return mode
    if mode == "fp8":
        backend = jax.default_backend()
        if backend != "gpu":
            raise QuantizeError(
                f"quantize: fp8 needs a GPU with fp8 dots (compute capability 8.9+: H100, L4, ...); this process "
                f"runs on {backend}. Use quantize: int8 (weight-only) or none."
            )
        raise QuantizeError(
            "quantize: fp8 is not built yet (e4m3 weights and activations with fp8 dots); use int8 or none"
        )
    raise QuantizeError(f"quantize must be one of {', '.join(MODES)}, got {mode!r}")


# --------------------------------------------------------------------------------------------------
# The numbers


def quantize_int8(kernel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Linear kernel [in, out] -> (int8 [in, out], fp32 scale [out]): symmetric per output channel,
    scale = absmax / 127 (an all-zero column gets scale 1 and zeros)."""
    w = np.asarray(kernel, dtype=np.float32)
    absmax = np.max(np.abs(w), axis=0)
    scale = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


def int8_matmul(x, q, scale, bias, dtype):
    """(x @ q) * scale + bias, x in `dtype` (None: x's), q int8 [in, out], scale fp32 [out]: the dot runs on q
    converted to the compute dtype with an fp32 result, scaled once, then cast back (one rounding).

    The kernel passes an optimization barrier with x first: it then depends on this layer's input, so XLA
    cannot hoist its int8 -> float convert out of the denoise loop (loop-invariant code motion would hold a
    full-precision copy of every kernel for the whole generation, undoing the saving; models/parallel/
    placement.py's gather_weights_per_step ties FSDP gathers the same way)."""
    dtype = dtype or x.dtype
    x, q = jax.lax.optimization_barrier((x.astype(dtype), q))
    y = jax.lax.dot_general(
        x, q.astype(dtype), (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dtype)


# --------------------------------------------------------------------------------------------------
# Loading


def quantized_rules(rules: Sequence[tuple[str, tuple]]) -> tuple[tuple[str, tuple], ...]:
    """A model's sharding rules plus one rule per Linear kernel rule for its scale, split like the kernel's
    output axis (`to_q.weight: ("embed", "heads")` -> `to_q.weight_scale: ("heads",)`)."""
    extra = tuple(
        (re.sub(r"\\\.weight\$$", r"\\.weight_scale$", pattern), (logical[-1],))
        for pattern, logical in rules
        if len(logical) == 2 and pattern.endswith(r"\.weight$")
    )
    return tuple(rules) + extra


def load_quantized(loader: Callable, path, *, place: Callable | None, **kwargs):
    """`loader(path, place=..., **kwargs)` with every 2-D `kernel` it places quantized to int8 on the host,
    its scale placed beside it and attached to its layers.Linear as `kernel_scale`. A 2-D kernel that does not
    belong to a layers.Linear (whose __call__ knows the int8 path) is an error, not a silent wrong matmul."""
    from flax import nnx

    from meshserve.models.components.layers import Linear

    def put(path: tuple, array: np.ndarray):
        return place(path, array) if place is not None else jnp.asarray(array)

    scales: dict[tuple, jax.Array] = {}

    def quantizing_place(path: tuple, array: np.ndarray):
        if str(path[-1]) != "kernel" or array.ndim != 2:
            return put(path, array)
        q, scale = quantize_int8(array)
        scales[tuple(path[:-1])] = put((*path[:-1], SCALE), scale)
        return put(path, q)

    module = loader(path, place=quantizing_place, **kwargs)
    layers = {tuple(p): node for p, node in nnx.iter_graph(module)}
    for owner, scale in scales.items():
        layer = layers.get(owner)
        if not isinstance(layer, Linear):
            raise QuantizeError(
                f"{path}: {'.'.join(map(str, owner))} has a 2-D kernel but is a {type(layer).__name__}, "
                "not a layers.Linear; it has no int8 path"
            )
        layer.kernel_scale = nnx.Param(scale)
    return module


def weight_bytes(state) -> dict[str, int]:
    """Bytes of a module state by dtype name ({"int8": ..., "bfloat16": ..., "float32": ...}), whole arrays."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(state):
        name = jnp.dtype(leaf.dtype).name
        out[name] = out.get(name, 0) + int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
    return out

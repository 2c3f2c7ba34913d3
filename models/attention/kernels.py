"""Kernel selection by platform, and one call into whichever kernel was chosen.

    platform   kernel ("auto")
    cuda       cudnn when models.attention.cudnn accepts the call (bf16/fp16, head dim % 8 == 0 and <= 128,
               causal only with Sq == Sk), else xla_blockwise
    tpu        splash
    cpu        cpu_fused for float32 calls without a mask or causality, heads up to 128, where its library
               could be built (models.cpu.fused_attention: one fused kernel, an XLA FFI custom call); else
               xla_chunked where its score tile fits (models.attention.chunked: short sequences), else
               xla_blockwise
    other      xla_blockwise (ROCm GPUs, where cuDNN does not exist)

A forced "cudnn" or "splash" is likewise used only for the calls it can run (one settings object serves every
attention of a model: SDXL's VAE has one head of dim 512, beyond cuDNN's limit), the rest go to xla_blockwise,
as does a forced kernel on the wrong platform.

Inside context-parallel strategies (run_kernel's extra arguments): chunk positions matter only under causal
masking, which neither fused kernel takes (cuDNN's causal mask has no offsets, splash's is static), so causal
calls with positions (causal allgather, causal ring) run xla_blockwise, and so does every call of xla_chunked
that needs positions or a log-sum-exp, or whose local sizes it refuses; cpu_fused calls that need either go the
way of xla_chunked. The log-sum-exp that ring and hybrid merge chunks by: cuDNN returns it
(models.attention.cudnn, `return_lse`), splash does not through this code, so non-causal ring/hybrid keep cuDNN
and splash goes to xla_blockwise there. Ulysses and non-causal allgather keep either.

Outside context parallelism the fused kernels run inside `shard_map` on each device's block
(models.attention.dispatch): a Pallas/Mosaic kernel can't be partitioned by XLA ("Mosaic kernels cannot be
automatically partitioned"), and cuDNN's partitioning rules are then not needed either.
"""

from __future__ import annotations

import jax

from meshserve.models.attention.blockwise import xla_blockwise
from meshserve.models.attention.chunked import chunk_rows, xla_chunked
from meshserve.models.attention.cudnn import cudnn_attention, cudnn_unsupported_reason
from meshserve.models.attention.reference import reference_attention
from meshserve.models.attention.settings import AttentionSettings
from meshserve.models.attention.splash import splash_attention
from meshserve.models.cpu import fused_attention


def platform_of(settings: AttentionSettings) -> str:
    """The platform ("cpu", "tpu", "cuda" or "rocm") of the mesh's devices, or of jax.devices()."""
    device = settings.mesh.devices.flat[0] if settings.mesh is not None else jax.devices()[0]
    if device.platform == "gpu":
        version = getattr(device.client, "platform_version", "").lower()
        return "rocm" if "rocm" in version else "cuda"
    return device.platform


def select_kernel(
    kernel: str,
    *,
    platform: str,
    head_dim: int,
    dtype,
    causal: bool,
    sq: int,
    sk: int,
    heads: int,
    masked: bool = False,
) -> str:
    """The kernel that runs one call (the platform is an argument so tests can fake it; cpu_fused also
    depends on whether its library could be built here, `fused_attention.available()`)."""
    if kernel in ("reference", "xla_blockwise"):
        return kernel
    if kernel == "cpu_fused" or (kernel == "auto" and platform == "cpu"):
        if platform == "cpu" and fused_attention.accepts(
            dtype=dtype, causal=causal, masked=masked, head_dim=head_dim
        ):
            return "cpu_fused"
        return "xla_chunked" if chunk_rows(heads, sq, sk) is not None else "xla_blockwise"
    if kernel == "xla_chunked":
        return "xla_chunked" if chunk_rows(heads, sq, sk) is not None else "xla_blockwise"
    cudnn_ok = cudnn_unsupported_reason(head_dim=head_dim, dtype=dtype, causal=causal, sq=sq, sk=sk) is None
    if kernel == "cudnn" or (kernel == "auto" and platform == "cuda"):
        return "cudnn" if cudnn_ok and platform == "cuda" else "xla_blockwise"
    if kernel == "splash" or (kernel == "auto" and platform == "tpu"):
        return "splash" if platform == "tpu" else "xla_blockwise"
    return "xla_blockwise"


def run_kernel(
    name: str,
    q,
    k,
    v,
    *,
    causal: bool,
    kv_mask,
    scale,
    settings: AttentionSettings,
    q_offset=None,
    kv_offset=0,
    return_lse: bool = False,
    out_dtype=None,
):
    """Run kernel `name` on local (per-device) arrays. Causal chunk positions send cudnn and splash calls to
    xla_blockwise, and so does the log-sum-exp splash calls (see the module docstring)."""
    positional = causal and (q_offset is not None or not (isinstance(kv_offset, int) and kv_offset == 0))
    if (name == "cudnn" and positional) or (name == "splash" and (positional or return_lse)):
        name = "xla_blockwise"
    if name == "cpu_fused" and (
        positional
        or return_lse
        or isinstance(scale, jax.core.Tracer)
        or not fused_attention.accepts(
            dtype=q.dtype, causal=causal, masked=kv_mask is not None, head_dim=q.shape[-1]
        )
    ):
        name = "xla_chunked"
    if name == "xla_chunked" and (
        positional or return_lse or chunk_rows(q.shape[2], q.shape[1], k.shape[1]) is None
    ):
        name = "xla_blockwise"
    if name == "reference":
        return reference_attention(
            q,
            k,
            v,
            causal=causal,
            kv_mask=kv_mask,
            scale=scale,
            q_offset=q_offset,
            kv_offset=kv_offset,
            return_lse=return_lse,
            out_dtype=out_dtype,
        )
    if name == "cpu_fused":
        out = fused_attention.cpu_fused_attention(q, k, v, scale=scale)
        return out if out_dtype is None else out.astype(out_dtype)
    if name == "xla_chunked":
        out = xla_chunked(q, k, v, causal=causal, kv_mask=kv_mask, scale=scale)
        return out if out_dtype is None else out.astype(out_dtype)
    if name == "xla_blockwise":
        return xla_blockwise(
            q,
            k,
            v,
            causal=causal,
            kv_mask=kv_mask,
            scale=scale,
            block_q=settings.block_q,
            block_kv=settings.block_kv,
            q_offset=q_offset,
            kv_offset=kv_offset,
            return_lse=return_lse,
            out_dtype=out_dtype,
        )
    if name == "cudnn":
        extra = dict(return_lse=True, out_dtype=out_dtype) if return_lse else {}
        return cudnn_attention(q, k, v, causal=causal, kv_mask=kv_mask, scale=scale, **extra)
    if name == "splash":
        return splash_attention(
            q,
            k,
            v,
            causal=causal,
            kv_mask=kv_mask,
            scale=scale,
            block_q=settings.block_q,
            block_kv=settings.block_kv,
        )
    raise ValueError(f"unknown attention kernel {name!r}")

"""The attention entry point: picks a kernel, and a context-parallel strategy when the mesh shards tokens.

    attention(q, k, v, *, causal=False, kv_mask=None, scale=None, settings=AttentionSettings())
    q: [B, Sq, H, D]   k, v: [B, Sk, H, D]   kv_mask: [B, Sk] bool (True = attend)   -> [B, Sq, H, D]

Models call it on globally shaped arrays (under jit). When `settings.mesh` has a "context" axis larger than 1
the entry point does the shard_map itself (models.attention.context); otherwise the chosen kernel runs on the
global arrays and XLA's partitioner splits batch and heads along whatever sharding they carry.
Kernel choice: models.attention.kernels.
"""

from __future__ import annotations

from meshserve.models.attention.context import context_attention
from meshserve.models.attention.kernels import platform_of, run_kernel, select_kernel
from meshserve.models.attention.settings import AttentionSettings

_DEFAULT = AttentionSettings()


def attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    kv_mask=None,
    scale: float | None = None,
    settings: AttentionSettings = _DEFAULT,
):
    """q: [B, Sq, H, D], k/v: [B, Sk, H, D], kv_mask: [B, Sk] bool -> [B, Sq, H, D]."""
    if (
        q.ndim != 4
        or k.ndim != 4
        or k.shape != v.shape
        or (q.shape[0], q.shape[2:]) != (k.shape[0], k.shape[2:])
    ):
        raise ValueError(
            f"attention wants q [B, Sq, H, D], k = v [B, Sk, H, D]; got {q.shape} {k.shape} {v.shape}"
        )
    if kv_mask is not None and tuple(kv_mask.shape) != tuple(k.shape[:2]):
        raise ValueError(f"kv_mask must be [B, Sk] = {tuple(k.shape[:2])}, got {tuple(kv_mask.shape)}")
    kernel = select_kernel(
        settings.kernel,
        platform=platform_of(settings),
        head_dim=q.shape[-1],
        dtype=q.dtype,
        causal=causal,
        sq=q.shape[1],
        sk=k.shape[1],
    )
    mesh = settings.mesh
    if mesh is not None and dict(mesh.shape).get("context", 1) > 1:
        return context_attention(
            q, k, v, causal=causal, kv_mask=kv_mask, scale=scale, settings=settings, kernel=kernel
        )
    return run_kernel(kernel, q, k, v, causal=causal, kv_mask=kv_mask, scale=scale, settings=settings)

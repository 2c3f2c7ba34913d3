"""The attention entry point: picks a kernel, and a context-parallel strategy when the mesh shards tokens.

    attention(q, k, v, *, causal=False, kv_mask=None, scale=None, settings=AttentionSettings())
    q: [B, Sq, H, D]   k, v: [B, Sk, H, D]   kv_mask: [B, Sk] bool (True = attend)   -> [B, Sq, H, D]

Models call it on globally shaped arrays (under jit). When `settings.mesh` has a "context" axis larger than 1
the entry point does the shard_map itself (models.attention.context). Otherwise an XLA kernel (xla_blockwise,
reference) runs on the global arrays and XLA's partitioner splits batch and heads along whatever sharding they
carry, while a fused kernel (cudnn, splash) and xla_chunked run inside shard_map on each device's block
(`run_local_kernel`): Mosaic refuses to be partitioned ("Mosaic kernels cannot be automatically
partitioned"), so a splash call on globally sharded arrays fails to compile on any multi-chip TPU mesh; and
xla_chunked loops over the batch rows (`lax.map`), which XLA can only run on a batch sharded over devices by
gathering it.
Kernel choice: models.attention.kernels; strategy choice: models.attention.context.select_strategy.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from meshserve.models.attention.context import batch_axes_for, context_attention, head_axis_for
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
    platform = platform_of(settings)
    kernel = select_kernel(
        settings.kernel,
        platform=platform,
        head_dim=q.shape[-1],
        dtype=q.dtype,
        causal=causal,
        sq=q.shape[1],
        sk=k.shape[1],
        heads=q.shape[2],
        masked=kv_mask is not None,
    )
    mesh = settings.mesh
    if kernel in ("cpu_fused", "xla_chunked") and mesh is None and q.shape[0] > 1 and jax.device_count() > 1:
        # Without a mesh the batch may still be sharded (a pool's text encoders and VAE run on the pool's
        # devices with mesh-free settings), and xla_chunked's loop over batch rows would gather it, as would
        # XLA's partitioner for cpu_fused's custom call.
        kernel = "xla_blockwise"
    if mesh is not None and dict(mesh.shape).get("context", 1) > 1:
        return context_attention(
            q,
            k,
            v,
            causal=causal,
            kv_mask=kv_mask,
            scale=scale,
            settings=settings,
            kernel=kernel,
            platform=platform,
        )
    return run_local_kernel(kernel, q, k, v, causal=causal, kv_mask=kv_mask, scale=scale, settings=settings)


# Run on each device's block, inside shard_map.
LOCAL_KERNELS = ("cudnn", "splash", "xla_chunked", "cpu_fused")


def run_local_kernel(name: str, q, k, v, *, causal: bool, kv_mask, scale, settings: AttentionSettings):
    """run_kernel on globally shaped arrays without context parallelism. A fused kernel (cudnn, splash) or
    xla_chunked runs inside shard_map over settings.mesh on each device's block: batch over ("data", "cfg"),
    heads over "tensor" (where they divide: the rule of models.attention.context, so inputs placed by
    models.parallel.placement need no resharding); the XLA kernels are left to XLA's partitioner."""
    mesh = settings.mesh
    if name not in LOCAL_KERNELS or mesh is None or mesh.size == 1:
        return run_kernel(name, q, k, v, causal=causal, kv_mask=kv_mask, scale=scale, settings=settings)
    batch_axes = batch_axes_for(mesh, q.shape[0])
    qkv_spec = P(batch_axes, None, head_axis_for(mesh, q.shape[2]), None)

    def local(q, k, v, kv_mask=None):
        return run_kernel(name, q, k, v, causal=causal, kv_mask=kv_mask, scale=scale, settings=settings)

    args, specs = (q, k, v), (qkv_spec,) * 3
    if kv_mask is not None:
        args, specs = (*args, kv_mask), (*specs, P(batch_axes, None))
    # check_vma off as in models.attention.context: the kernels' internals mix replicated and varying values.
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=qkv_spec, check_vma=False)(*args)

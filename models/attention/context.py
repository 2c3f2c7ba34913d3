"""Context parallelism: attention over a sequence sharded on the mesh's "context" axis, inside shard_map.

Called by models.attention.attention with globally shaped arrays when settings.mesh has context > 1. Layout of
the shard_map (per device):

    q, out   P(batch_axes, "context", head_axis, None)   batch on ("data", "cfg"), heads on "tensor"
    k, v     the same, or P(batch_axes, None, head_axis, None) when K/V are replicated (see below)
    kv_mask  P(batch_axes, "context") or P(batch_axes, None)

An axis of size 1, or one that does not divide the dimension, is left out (that dimension is replicated:
correct, only less parallel). Sequences whose length does not divide the context size are padded: padded keys
are switched off through kv_mask and padded queries sliced off, so no layout is ever silently wrong.

Cross-attention K/V that differ in length from q and have at most settings.allgather_max_kv tokens (SDXL's 77
text tokens) are replicated: every strategy then reduces to local queries x the whole K/V, with no collective.

Strategy ("auto", `select_strategy`, a function of the platform): allgather for replicated or short K/V
(Sk <= allgather_max_kv), ulysses when the heads per device divide by the context size; otherwise ring, except
on an NVIDIA GPU whose local kernel is cuDNN (non-causal): allgather there, which keeps one cuDNN call of the
local queries against all keys where ring would run cuDNN once per chunk and merge (docs/attention.md says why). "hybrid" runs Ulysses inside groups of consecutive context devices
and a ring across the groups, with collectives over subsets of the same axis (models.attention.hybrid): every
strategy runs on the pool mesh itself, as a pipeline's program must (one mesh per program).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshserve.models.attention.allgather import allgather_attention
from meshserve.models.attention.hybrid import hybrid_attention, hybrid_degrees
from meshserve.models.attention.kernels import run_kernel
from meshserve.models.attention.ring import ring_attention
from meshserve.models.attention.settings import AttentionSettings
from meshserve.models.attention.ulysses import ulysses_attention, validate_ulysses

CONTEXT_AXIS = "context"
BATCH_AXES = ("data", "cfg")
HEAD_AXIS = "tensor"


def batch_axes_for(mesh, batch: int) -> tuple[str, ...] | None:
    """The mesh axes the batch is split over: ("data", "cfg") where present, > 1 and dividing it."""
    sizes = dict(mesh.shape)
    axes = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)
    for candidate in (axes, *((a,) for a in axes)):
        if candidate and batch % math.prod(sizes[a] for a in candidate) == 0:
            return candidate
    return None


def head_axis_for(mesh, heads: int) -> str | None:
    size = dict(mesh.shape).get(HEAD_AXIS, 1)
    return HEAD_AXIS if size > 1 and heads % size == 0 else None


def select_strategy(
    strategy: str,
    *,
    context: int,
    local_heads: int,
    sk: int,
    short_kv: int,
    platform: str,
    kernel: str = "xla_blockwise",
    causal: bool = False,
) -> str:
    """The strategy for one call (pure: the platform is an argument, so tests can fake a GPU). Replicated K/V
    need no strategy and never reach here.

        forced                                  -> as given
        Sk <= short_kv                          -> allgather (gathering short K/V is the cheapest)
        heads per device % context == 0         -> ulysses (any local kernel, whole sequences)
        cuda, local kernel cudnn, not causal    -> allgather (one cuDNN call: local queries x all keys)
        otherwise                               -> ring (memory 1/N; xla_blockwise's carried online softmax)
    """
    if strategy != "auto":
        return strategy
    if sk <= short_kv:
        return "allgather"
    if local_heads % context == 0:
        return "ulysses"
    if platform == "cuda" and kernel == "cudnn" and not causal:
        return "allgather"
    return "ring"


def _pad_seq(x, length: int, value=0):
    extra = length - x.shape[1]
    if extra == 0:
        return x
    return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2), constant_values=value)


def context_attention(
    q, k, v, *, causal: bool, kv_mask, scale, settings: AttentionSettings, kernel: str, platform: str = "cpu"
):
    """Global q: [B, Sq, H, D], k/v: [B, Sk, H, D], kv_mask: [B, Sk] or None -> [B, Sq, H, D]."""
    mesh = settings.mesh
    n = dict(mesh.shape)[CONTEXT_AXIS]
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    batch_axes = batch_axes_for(mesh, b)
    head_axis = head_axis_for(mesh, h)
    local_heads = h // dict(mesh.shape)[head_axis] if head_axis else h
    replicate_kv = sk != sq and sk <= settings.allgather_max_kv
    strategy = (
        "allgather"
        if replicate_kv
        else select_strategy(
            settings.context_strategy,
            context=n,
            local_heads=local_heads,
            sk=sk,
            short_kv=settings.allgather_max_kv,
            platform=platform,
            kernel=kernel,
            causal=causal,
        )
    )

    # Pad to whole chunks; the causal shift stays that of the real lengths (bottom-right, as the reference).
    q_shift = sk - sq
    sq_pad = -(-sq // n) * n
    sk_pad = sk if replicate_kv else -(-sk // n) * n
    q = _pad_seq(q, sq_pad)
    k, v = _pad_seq(k, sk_pad), _pad_seq(v, sk_pad)
    if kv_mask is not None or sk_pad != sk:
        kv_mask = _pad_seq(jnp.ones((b, sk), bool) if kv_mask is None else kv_mask, sk_pad, value=False)

    local = partial(run_kernel, kernel, causal=causal, scale=scale, settings=settings)
    # Ring needs the log-sum-exp (and, when causal, positions): reference does both, and cuDNN returns the
    # log-sum-exp (non-causal): their partial results are merged explicitly (ring.merge_partials). Any other
    # kernel runs as xla_blockwise (kernels.run_kernel), which the ring drives through its carried
    # online-softmax state.
    blockwise = None
    if kernel != "reference" and not (kernel == "cudnn" and not causal):
        blockwise = dict(causal=causal, scale=scale, block_q=settings.block_q, block_kv=settings.block_kv)
    if strategy == "ring":
        body = partial(
            ring_attention,
            axis_name=CONTEXT_AXIS,
            axis_size=n,
            q_shift=q_shift,
            kernel=local,
            blockwise=blockwise,
        )
    elif strategy == "ulysses":
        validate_ulysses(local_heads, n)
        body = partial(ulysses_attention, axis_name=CONTEXT_AXIS, axis_size=n, q_shift=q_shift, kernel=local)
    elif strategy == "allgather":
        body = partial(
            allgather_attention,
            axis_name=CONTEXT_AXIS,
            causal=causal,
            q_shift=q_shift,
            kernel=local,
            kv_sharded=not replicate_kv,
        )
    elif strategy == "hybrid":
        ulysses, ring = hybrid_degrees(n, local_heads, settings.ulysses_degree)
        body = partial(
            hybrid_attention,
            axis_name=CONTEXT_AXIS,
            ring_size=ring,
            ulysses_size=ulysses,
            q_shift=q_shift,
            kernel=local,
            blockwise=blockwise,
        )
    else:
        raise ValueError(f"unknown context strategy {strategy!r}")

    q_spec = P(batch_axes, CONTEXT_AXIS, head_axis, None)
    kv_spec = P(batch_axes, None if replicate_kv else CONTEXT_AXIS, head_axis, None)
    mask_spec = P(batch_axes, None if replicate_kv else CONTEXT_AXIS)
    # check_vma off: the kernels' scan carries start replicated (zeros) and become device-varying, and the
    # online softmax's lax.cond branches mix both; the out spec below is exact, nothing is claimed replicated.
    if kv_mask is None:
        fn = jax.shard_map(
            lambda q, k, v: body(q, k, v, None),
            mesh=mesh,
            in_specs=(q_spec, kv_spec, kv_spec),
            out_specs=q_spec,
            check_vma=False,
        )
        out = fn(q, k, v)
    else:
        fn = jax.shard_map(
            body, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, mask_spec), out_specs=q_spec, check_vma=False
        )
        out = fn(q, k, v, kv_mask)
    return out[:, :sq]

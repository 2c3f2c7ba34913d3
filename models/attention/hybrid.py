"""Hybrid context parallelism: Ulysses inside groups of U devices, ring across the R = N / U groups.

Runs inside the same shard_map over the pool mesh as the other strategies, on its one "context" axis of size
N: a program that runs one shard_map on a second mesh (the context axis reshaped to (R, U)) does not lower
inside a pipeline whose weights and activations live on the pool mesh ("mesh should be the same across the
entire program"). So the two levels are collectives over subsets of that axis. Context index c = r * U + u
(ring-major): group r is the U consecutive devices r * U .. r * U + U - 1, and ring member u is the R devices
u, U + u, 2U + u, ...

    1. all_to_all over the group (`axis_index_groups`): sequence chunk c -> the group's contiguous block of
       S/R tokens (chunks r*U .. r*U + U - 1) for H/U heads (head block u). The kv_mask block is all-gathered
       over the group.
    2. ring attention over the R devices holding head block u (`ppermute` pairs c -> c + t * U, mod N): every
       device's K/V block visits the other R - 1 groups' devices with the same heads, exactly as in
       models.attention.ring, block r at positions r * S/R.
    3. all_to_all back over the group.

U = N is Ulysses (no ring step), U = 1 is ring (no exchange). Heads per device must be divisible by U.
Ring's K/V traffic is divided by U (each ring step carries H/U heads), Ulysses' exchange involves U devices
instead of N. The ring loop below mirrors ring.ring_attention (direct sends, pieces, one lax.switch over the
shifts) but steps through a strided subset of the axis, which ring_attention's `axis_index`/pairs over the
whole axis cannot express.
"""

from __future__ import annotations

from jax import lax

from meshserve.models.attention.ring import ring_attention
from meshserve.models.attention.ulysses import validate_ulysses
from meshserve.models.parallel.mesh import LayoutError


def hybrid_degrees(context: int, local_heads: int, requested: int | None) -> tuple[int, int]:
    """(ulysses, ring) sizes. Default: the largest proper divisor of `context` that divides the heads, so that
    some ring remains (1 when none does: pure ring)."""
    if requested is None:
        requested = max(d for d in range(1, max(context, 2)) if context % d == 0 and local_heads % d == 0)
    if context % requested:
        raise LayoutError(f"ulysses_degree={requested} does not divide the context axis size {context}")
    validate_ulysses(local_heads, requested)
    return requested, context // requested


def ulysses_groups(ring_size: int, ulysses_size: int) -> list[list[int]]:
    """The context indices of each Ulysses group: U consecutive devices per group, R groups."""
    return [[r * ulysses_size + u for u in range(ulysses_size)] for r in range(ring_size)]


def hybrid_attention(
    q, k, v, kv_mask, *, axis_name: str, ring_size: int, ulysses_size: int, q_shift, kernel, blockwise=None
):
    """Local chunks q: [B, cq, H, D], k/v: [B, ck, H, D], kv_mask: [B, ck] or None -> [B, cq, H, D].

    Inside a shard_map whose sequence dimension is split over `axis_name` (size ring_size * ulysses_size).
    kernel / blockwise: as for ring.ring_attention.
    """
    validate_ulysses(q.shape[2], ulysses_size)
    if ulysses_size > 1:
        groups = ulysses_groups(ring_size, ulysses_size)

        def seq_to_heads(x):  # [B, c, H, D] -> [B, U * c, H / U, D]: the group's block, head block u
            return lax.all_to_all(x, axis_name, 2, 1, tiled=True, axis_index_groups=groups)

        def heads_to_seq(x):  # the inverse
            return lax.all_to_all(x, axis_name, 1, 2, tiled=True, axis_index_groups=groups)

        q, k, v = (seq_to_heads(x) for x in (q, k, v))
        if kv_mask is not None:
            kv_mask = lax.all_gather(kv_mask, axis_name, axis=1, tiled=True, axis_index_groups=groups)
    # One ring per head block u: the devices r * U + u, r = 0..R-1 (ring.ring_attention with stride U).
    out = ring_attention(
        q,
        k,
        v,
        kv_mask,
        axis_name=axis_name,
        axis_size=ring_size * ulysses_size,
        stride=ulysses_size,
        q_shift=q_shift,
        kernel=kernel,
        blockwise=blockwise,
    )
    return heads_to_seq(out) if ulysses_size > 1 else out

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

import jax.numpy as jnp
from jax import lax

from models.attention.blockwise import accumulate, finish, init_state
from models.attention.ring import merge_partials, ring_pieces
from models.attention.ulysses import validate_ulysses
from models.parallel.mesh import LayoutError


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


def ring_pairs(shift: int, ring_size: int, ulysses_size: int) -> list[tuple[int, int]]:
    """ppermute pairs of ring step `shift`: (r, u) sends to (r + shift mod R, u), on the flat context axis."""
    return [
        (r * ulysses_size + u, ((r + shift) % ring_size) * ulysses_size + u)
        for r in range(ring_size)
        for u in range(ulysses_size)
    ]


def _ring_over_groups(q, k, v, kv_mask, *, axis_name, ring_size, ulysses_size, q_shift, kernel, blockwise):
    """Ring attention among the devices with the same head block u (ring.ring_attention, strided).

    q: [B, cq, h, D] this group's query block (group r holds positions r * cq ..), k/v: [B, ck, h, D],
    kv_mask: [B, ck] or None -> [B, cq, h, D].
    """
    index = lax.axis_index(axis_name) // ulysses_size  # r
    cq, ck = q.shape[1], k.shape[1]
    q_offset = index * cq + q_shift
    pieces = ring_pieces(ck, blockwise["block_kv"]) if blockwise is not None else 1
    piece = ck // pieces

    def fold(state, k, v, kv_mask, kv_offset):
        if blockwise is not None:
            state = init_state(q, blockwise["block_q"]) if state is None else state
            return accumulate(
                q, k, v, state, kv_mask=kv_mask, q_offset=q_offset, kv_offset=kv_offset, **blockwise
            )
        out, lse = kernel(
            q,
            k,
            v,
            kv_mask=kv_mask,
            q_offset=q_offset,
            kv_offset=kv_offset,
            return_lse=True,
            out_dtype=jnp.float32,
        )
        return (out, lse) if state is None else merge_partials(*state, out, lse)

    local = (k, v) if kv_mask is None else (k, v, kv_mask)

    def send(shift):
        pairs = ring_pairs(shift, ring_size, ulysses_size)
        return lambda parts: [lax.ppermute(x, axis_name, pairs) for x in parts]

    sends = [send(shift) for shift in range(1, ring_size)]

    # Step (shift, j): piece j of the block of group r - shift, sent directly by its device with head block u.
    def step(i, state):
        shift, j = 1 + i // pieces, i % pieces
        parts = [lax.dynamic_slice_in_dim(x, j * piece, piece, axis=1) for x in local]
        got = lax.switch(shift - 1, sends, parts) if len(sends) > 1 else sends[0](parts)
        mask = got[2] if len(got) == 3 else None
        return fold(state, got[0], got[1], mask, ((index - shift) % ring_size) * ck + j * piece)

    state = fold(None, k, v, kv_mask, index * ck)
    if ring_size > 1:
        state = lax.fori_loop(0, (ring_size - 1) * pieces, step, state)
    if blockwise is not None:
        return finish(state, cq, q.dtype)[0]
    return state[0].astype(q.dtype)


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
    out = _ring_over_groups(
        q,
        k,
        v,
        kv_mask,
        axis_name=axis_name,
        ring_size=ring_size,
        ulysses_size=ulysses_size,
        q_shift=q_shift,
        kernel=kernel,
        blockwise=blockwise,
    )
    return heads_to_seq(out) if ulysses_size > 1 else out

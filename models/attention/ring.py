"""Ring attention (Liu et al. 2023, arXiv:2310.01889): every device's K/V chunk visits every other device.

Runs inside shard_map. Each of the N devices holds one sequence chunk of q and of k/v. In step t (1..N-1) it
attends its queries to the K/V chunk of device (i - t) mod N, which that device sends it directly with
`lax.ppermute` (pairs i -> i + t). The N partial results are merged with their log-sum-exp (exactly what the
online softmax does between blocks), in fp32, so the result equals attention over the whole sequence. With
the xla_blockwise kernel the merge happens inside it: one online-softmax state (m, denom, acc) is carried
from chunk to chunk, its acc laid out like the output so the final normalisation can write in place.

Direct sends rather than forwarding round a ring of neighbours (i -> i + 1 every step): a forwarding device
must keep each received chunk until it has passed it on, one whole extra K/V chunk per device; sending only
one's own chunk needs no such buffer. Each chunk also travels in pieces (`ring_pieces`, up to 8, each at least
one K/V block): only a piece is in flight. Bytes sent per device are the same as a neighbour ring, (N - 1) x
the local K/V (+ mask); the price is the topology: on a fabric where every device reaches every other in one
hop (NVLink/NVSwitch, the CPU here) nothing changes, on a physical ring or torus a shift by t crosses t links.

Memory per device (measured in docs/attention.md): one q, k, v, kv_mask chunk, the output (which is the fp32
accumulator when the output is fp32), a piece of K/V sent and one received, and the local kernel's tiles.

Causal: chunk positions go to the kernel, which skips fully masked blocks; the work per device is unbalanced
(device 0 has one visible chunk, device N-1 all of them). A zigzag chunk order would balance it; not done, as
the diffusion models here attend bidirectionally.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from meshserve.models.attention.blockwise import accumulate, finish, fit_blocks, init_state


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Combine two softmax-normalised partial outputs over disjoint key sets.

    out: [B, S, H, D] fp32, lse: [B, S, H] fp32 (-inf where a row saw no key; such a partial gets weight 0).
    """
    lse = jnp.logaddexp(lse_a, lse_b)
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    weight_a = jnp.exp(lse_a - lse_safe)[..., None]
    weight_b = jnp.exp(lse_b - lse_safe)[..., None]
    return out_a * weight_a + out_b * weight_b, lse


MAX_PIECES = 8


def ring_pieces(chunk: int, block_kv: int, max_pieces: int = MAX_PIECES) -> int:
    """How many pieces each K/V chunk travels in: the most (up to max_pieces) that divide the chunk evenly
    and keep each piece at least one K/V block long. Short chunks travel whole: one collective per step."""
    for pieces in range(max_pieces, 1, -1):
        if chunk % pieces == 0 and chunk // pieces >= block_kv:
            return pieces
    return 1


def ring_attention(
    q,
    k,
    v,
    kv_mask,
    *,
    axis_name: str,
    axis_size: int,
    q_shift,
    kernel,
    blockwise=None,
    return_lse: bool = False,
    stride: int = 1,
):
    """Local chunks q: [B, cq, H, D], k/v: [B, ck, H, D], kv_mask: [B, ck] bool or None -> [B, cq, H, D].

    stride: the ring joins every stride-th device of the axis (device c is ring member c // stride, in the
        ring of the devices with the same c % stride): hybrid attention runs one ring per Ulysses head block.

    q_shift: global causal shift (Sk - Sq of the unpadded sequences); chunk i holds positions i*cq.., i*ck...
    kernel: the local kernel (q, k, v, *, kv_mask, q_offset, kv_offset, return_lse, out_dtype).
    blockwise: when the local kernel is xla_blockwise, its keyword arguments (causal, scale, block_q,
        block_kv): the ring then carries one online-softmax state across chunks instead of merging partials,
        and sends each chunk in ring_pieces(ck, block_kv) pieces.
    """
    ring_size = axis_size // stride
    index = lax.axis_index(axis_name) // stride
    cq, ck = q.shape[1], k.shape[1]
    q_offset = index * cq + q_shift
    if blockwise is not None:  # the tile fitted to the local chunk, then pieces of at least one K/V block
        fitted = fit_blocks(cq, ck, q.shape[-1], blockwise["block_q"], blockwise["block_kv"])
        blockwise = dict(blockwise, block_q=fitted[0], block_kv=fitted[1])
    pieces = ring_pieces(ck, blockwise["block_kv"]) if blockwise is not None else 1
    piece = ck // pieces

    if blockwise is not None:

        def fold(state, k, v, kv_mask, kv_offset):
            if state is None:
                state = init_state(q, blockwise["block_q"])
            return accumulate(
                q, k, v, state, kv_mask=kv_mask, q_offset=q_offset, kv_offset=kv_offset, **blockwise
            )

    else:

        def fold(state, k, v, kv_mask, kv_offset):
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
        pairs = [(i, ((i // stride + shift) % ring_size) * stride + i % stride) for i in range(axis_size)]
        return lambda parts: [lax.ppermute(x, axis_name, pairs) for x in parts]

    # Step t = 1..N-1 attends to the chunk of device (i - t) mod N, which that device sends us directly:
    # every device sends only its own (argument) K/V, so none keeps a received chunk to pass on. Forwarding
    # round a ring of neighbours would hold one whole extra K/V chunk per device (measured with a forwarding
    # prototype at 16k tokens: 1.86 x the 1/N share at N=4, 1.43 like this). Bytes sent per device are the
    # same, (N - 1) x the local K/V. One loop over (step, piece), the step's permutation picked by
    # lax.switch: the program holds one copy of the local kernel whatever N, and the loop keeps XLA from
    # starting every transfer at once (unrolled, it did: 136 MiB of temporaries at 4k tokens, N=8; 18 so).
    sends = [send(shift) for shift in range(1, ring_size)]

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
        out, lse = finish(state, cq, q.dtype)
    else:
        out, lse = state
        out = out.astype(q.dtype)
    return (out, lse) if return_lse else out

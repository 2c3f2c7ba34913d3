"""Ring attention (Liu et al. 2023, arXiv:2310.01889): K/V blocks travel round the context axis.

Runs inside shard_map. Each of the N devices holds one sequence chunk of q and of k/v. In step t it attends
its queries to the K/V chunk that started on device (i - t) mod N, then passes that chunk on with
`lax.ppermute` (i -> i + 1). The N partial results are merged with their log-sum-exp (exactly what the online
softmax does between blocks), in fp32, so the result equals attention over the whole sequence. With the
xla_blockwise kernel the merge happens inside it: one online-softmax state (m, denom, acc) is carried from chunk
to chunk, which saves two full-size fp32 temporaries per device (a partial output and the merged one).

Memory per device: one q, k, v, kv_mask chunk plus the chunk in flight, an fp32 output accumulator and the
local kernel's tiles; communication per call: (N - 1) x the local K/V (+ mask) bytes, whatever the head count.
Causal: chunk positions go to the kernel, which skips fully masked blocks; the work per device is unbalanced
(device 0 has one visible chunk, device N-1 all of them). A zigzag chunk order would balance it; not done, as
the diffusion models here attend bidirectionally.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from models.attention.blockwise import accumulate, finish, init_state


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Combine two softmax-normalised partial outputs over disjoint key sets.

    out: [B, S, H, D] fp32, lse: [B, S, H] fp32 (-inf where a row saw no key; such a partial gets weight 0).
    """
    lse = jnp.logaddexp(lse_a, lse_b)
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    weight_a = jnp.exp(lse_a - lse_safe)[..., None]
    weight_b = jnp.exp(lse_b - lse_safe)[..., None]
    return out_a * weight_a + out_b * weight_b, lse


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
):
    """Local chunks q: [B, cq, H, D], k/v: [B, ck, H, D], kv_mask: [B, ck] bool or None -> [B, cq, H, D].

    q_shift: global causal shift (Sk - Sq of the unpadded sequences); chunk i holds positions i*cq.., i*ck...
    kernel: the local kernel (q, k, v, *, kv_mask, q_offset, kv_offset, return_lse, out_dtype).
    blockwise: when the local kernel is xla_blockwise, its keyword arguments (causal, scale, block_q,
        block_kv): the ring then carries one online-softmax state across chunks instead of merging partials.
    """
    index = lax.axis_index(axis_name)
    cq, ck = q.shape[1], k.shape[1]
    q_offset = index * cq + q_shift
    send_next = [(i, (i + 1) % axis_size) for i in range(axis_size)]

    def rotate(k, v, kv_mask):
        k, v = lax.ppermute(k, axis_name, send_next), lax.ppermute(v, axis_name, send_next)
        return k, v, None if kv_mask is None else lax.ppermute(kv_mask, axis_name, send_next)

    def source(step):  # the device the K/V chunk held at `step` started on
        return (index - step) % axis_size

    # A loop rather than N unrolled steps: the program (and its compile time) stays the same size for any N.
    if blockwise is not None:

        def fold(step, state, k, v, kv_mask):
            return accumulate(
                q, k, v, state, kv_mask=kv_mask, q_offset=q_offset, kv_offset=source(step) * ck, **blockwise
            )

        def step(t, carry):
            state, k, v, kv_mask = carry
            k, v, kv_mask = rotate(k, v, kv_mask)
            return fold(t, state, k, v, kv_mask), k, v, kv_mask

        state = fold(0, init_state(q, blockwise["block_q"]), k, v, kv_mask)
        state, *_ = lax.fori_loop(1, axis_size, step, (state, k, v, kv_mask))
        out, lse = finish(state, cq, q.dtype)
        return (out, lse) if return_lse else out

    def attend(step, k, v, kv_mask):
        return kernel(
            q,
            k,
            v,
            kv_mask=kv_mask,
            q_offset=q_offset,
            kv_offset=source(step) * ck,
            return_lse=True,
            out_dtype=jnp.float32,
        )

    def merge_step(t, carry):
        out, lse, k, v, kv_mask = carry
        k, v, kv_mask = rotate(k, v, kv_mask)
        out, lse = merge_partials(out, lse, *attend(t, k, v, kv_mask))
        return out, lse, k, v, kv_mask

    out, lse = attend(0, k, v, kv_mask)
    out, lse, *_ = lax.fori_loop(1, axis_size, merge_step, (out, lse, k, v, kv_mask))
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out

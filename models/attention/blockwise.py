"""xla_blockwise: flash-style attention in plain XLA, memory linear in sequence length, on any device.

The queries are cut into blocks of `block_q` rows (outer `lax.scan`) and, for each, the keys/values into
blocks of `block_kv` (inner `lax.scan`) with the online softmax of FlashAttention (Dao et al. 2022, alg. 1): a
running row max `m`, running sum `denom` and output accumulator `acc`, all fp32, rescaled by
exp(m_old - m_new) whenever the max grows. The largest intermediate is one score tile [B, H, block_q,
block_kv]; the [Sq, Sk] score matrix never exists in the compiled program (tests/parallel/test_attention.py
reads the HLO to prove it).

Lengths that are not multiples of the block are padded; padded keys are masked out and padded query rows
sliced off. Masking and causal positions follow models.attention.reference exactly (fully masked rows give 0).
With causal masking, key blocks entirely in a query block's future are skipped with `lax.cond`.

Ring attention continues one online softmax across the K/V chunks (or pieces of chunks) it receives:
`init_state`, then `accumulate` once per piece, then `finish`. That keeps one fp32 accumulator for the local
queries instead of a partial output per chunk plus a log-sum-exp merge (measured in docs/attention.md).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# Ring attention fits its tile to the local chunk (fit_blocks): at most 1/TILE_SHARE of the chunk's query
# elements per score tile, blocks not below MIN_BLOCK. With the fixed 512 x 512 tile (~19 MiB at 8 heads: two
# live fp32 tiles) per-device memory did not divide by the context degree: ring at N=8 held 1.32 x the 1/N
# share at 64k tokens and 3.46 x at 4k. A single device keeps the configured blocks: fitted tiles cost time
# there for little memory (4096 tokens, 10 heads, batch 2 on this CPU: 547 ms at 512 x 512, 794 at 256 x 128).
TILE_SHARE = 8
MIN_BLOCK = 128


def fit_blocks(sq: int, sk: int, head_dim: int, block_q: int, block_kv: int) -> tuple[int, int]:
    """The blocks for sq local queries and sk keys: the configured ones capped by the lengths, then halved
    (the K/V block first, neither below MIN_BLOCK) until a score tile [bq, bk] per head holds at most
    sq * head_dim / TILE_SHARE elements, so the tiles shrink with the chunk as q, k and v do."""
    bq, bk = min(block_q, sq), min(block_kv, sk)
    budget = sq * head_dim // TILE_SHARE
    while bq * bk > budget and max(bq, bk) > MIN_BLOCK:
        if bk > MIN_BLOCK and (bk >= bq or bq <= MIN_BLOCK):
            bk = max(MIN_BLOCK, bk // 2)
        else:
            bq = max(MIN_BLOCK, bq // 2)
    return bq, bk


def even_block(length: int, block: int) -> int:
    """The block a sequence of `length` is cut into: as many blocks as `block` needs, made as even as possible
    (rounded up to 8 rows), so the last one is not mostly padding. At 1152 tokens (Flux at 512x512: 1024 image +
    128 text) blocks of 512 pad to 1536, 1.78x the score work of blocks of 384, which pad to nothing."""
    count = -(-length // block)
    if count <= 1:
        return length
    return min(block, (-(-length // count) + 7) // 8 * 8)


def _pad_axis(x, axis: int, size: int, value=0):
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _kv_blocks(k, v, kv_mask, block_kv: int):
    """Pad K/V to whole blocks; padded keys are switched off by the same mask as the caller's kv_mask."""
    b, sk = k.shape[:2]
    bk = even_block(sk, block_kv)
    nk = -(-sk // bk)
    if kv_mask is not None or nk * bk != sk:
        kv_mask = jnp.ones((b, sk), bool) if kv_mask is None else kv_mask
        kv_mask = _pad_axis(kv_mask, 1, nk * bk, value=False)
    return _pad_axis(k, 1, nk * bk), _pad_axis(v, 1, nk * bk), kv_mask, bk, nk


def _attend_block(q_blk, k, v, kv_mask, state, *, q_pos0, kv_offset, causal, scale, bk, nk):
    """Run the online softmax of one query block over every key block.

    q_blk: [B, bq, H, D]; k/v: [B, nk * bk, H, D]; kv_mask: [B, nk * bk] or None.
    q_pos0: position of q_blk[:, 0]; kv_offset: position of k[:, 0].
    state: m, denom [B, H, bq] and acc [B, H, bq, D], fp32, updated and returned.
    """
    bq = q_blk.shape[1]

    def kv_step(carry, jk):
        m, denom, acc = carry
        k_blk = lax.dynamic_slice_in_dim(k, jk * bk, bk, axis=1)  # [B, bk, H, D]
        v_blk = lax.dynamic_slice_in_dim(v, jk * bk, bk, axis=1)
        s = jnp.einsum("bqhd,bkhd->bhqk", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
        allowed = None
        if causal:
            q_pos = q_pos0 + jnp.arange(bq)
            kv_pos = kv_offset + jk * bk + jnp.arange(bk)
            allowed = (q_pos[:, None] >= kv_pos[None, :])[None, None]  # [1, 1, bq, bk]
        if kv_mask is not None:
            m_blk = lax.dynamic_slice_in_dim(kv_mask, jk * bk, bk, axis=1)[:, None, None, :]  # [B, 1, 1, bk]
            allowed = m_blk if allowed is None else allowed & m_blk
        if allowed is not None:
            s = jnp.where(allowed, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        # While a row has seen only masked keys its max is -inf; subtracting 0 keeps exp() at 0, not NaN.
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        correction = jnp.exp(m - m_safe)
        denom = denom * correction + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bhqk,bkhd->bhqd", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
        return m_new, denom, acc * correction[..., None] + pv

    def body(carry, jk):
        if not causal:
            return kv_step(carry, jk), None
        # Skip key blocks that start after the last query of this block can see (about half of them).
        visible = q_pos0 + bq - 1 >= kv_offset + jk * bk
        return lax.cond(visible, kv_step, lambda c, _: c, carry, jk), None

    state, _ = lax.scan(body, state, jnp.arange(nk))
    return state


def _normalise(m, denom, acc):
    """(out [B, H, bq, D] fp32, lse [B, H, bq]); rows that saw no key give out 0 and lse -inf."""
    seen = denom > 0
    out = acc / jnp.where(seen, denom, 1.0)[..., None]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)
    return out, lse


def xla_blockwise(
    q,
    k,
    v,
    *,
    causal: bool = False,
    kv_mask=None,
    scale: float | None = None,
    block_q: int = 512,
    block_kv: int = 512,
    q_offset=None,
    kv_offset=0,
    return_lse: bool = False,
    out_dtype=None,
):
    """q: [B, Sq, H, D], k/v: [B, Sk, H, D], kv_mask: [B, Sk] bool -> out [B, Sq, H, D].

    return_lse: also return the log-sum-exp of each row, [B, Sq, H] fp32 (-inf for rows that saw no key).

    q_offset / kv_offset: positions of q[:, 0] and k[:, 0] for the causal test (may be traced, e.g. derived
    from `lax.axis_index` inside a shard_map); q_offset None means Sk - Sq as in the reference.
    out_dtype: dtype of `out` (default q's).
    """
    b, sq, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    q_offset = k.shape[1] - sq if q_offset is None else q_offset
    out_dtype = q.dtype if out_dtype is None else out_dtype
    k, v, kv_mask, bk, nk = _kv_blocks(k, v, kv_mask, block_kv)
    bq = even_block(sq, block_q)
    nq = -(-sq // bq)
    q = _pad_axis(q, 1, nq * bq)

    def q_step(carry, iq):
        out_buf, lse_buf = carry
        q_blk = lax.dynamic_slice_in_dim(q, iq * bq, bq, axis=1)  # [B, bq, H, D]
        fresh = (
            jnp.full((b, h, bq), -jnp.inf, jnp.float32),
            jnp.zeros((b, h, bq), jnp.float32),
            jnp.zeros((b, h, bq, d), jnp.float32),
        )
        state = _attend_block(
            q_blk,
            k,
            v,
            kv_mask,
            fresh,
            q_pos0=q_offset + iq * bq,
            kv_offset=kv_offset,
            causal=causal,
            scale=scale,
            bk=bk,
            nk=nk,
        )
        out_blk, lse_blk = _normalise(*state)
        out_blk = jnp.transpose(out_blk, (0, 2, 1, 3)).astype(out_dtype)  # [B, bq, H, D]
        out_buf = lax.dynamic_update_slice_in_dim(out_buf, out_blk, iq * bq, axis=1)
        if lse_buf is not None:
            lse_buf = lax.dynamic_update_slice_in_dim(lse_buf, jnp.transpose(lse_blk, (0, 2, 1)), iq * bq, 1)
        return (out_buf, lse_buf), None

    # Written block by block into preallocated buffers: stacking scan outputs as [nq, B, bq, H, D] would need
    # a transposed copy of the whole output at the end.
    out_buf = jnp.zeros((b, nq * bq, h, d), out_dtype)
    lse_buf = jnp.zeros((b, nq * bq, h), jnp.float32) if return_lse else None
    (out, lse), _ = lax.scan(q_step, (out_buf, lse_buf), jnp.arange(nq))
    out = out[:, :sq]
    return (out, lse[:, :sq]) if return_lse else out


# --- the same online softmax carried across several K/V chunks (ring attention) -----------------------------


def init_state(q, block_q: int = 512):
    """Empty softmax state for all of q [B, Sq, H, D]: m, l [B, H, Sq_pad] and acc [B, Sq_pad, H, D], fp32.

    acc has the output's layout, not the [B, H, S, D] of the per-block state: `finish` is then elementwise,
    so with an fp32 output XLA can write the result into acc's own buffer instead of holding a second
    full-size array for a transpose (measured, ring at 64k tokens: 93 -> 37 MiB of temporaries per device
    at N=2, 52 -> 28 at N=4).
    """
    b, sq, h, d = q.shape
    bq = even_block(sq, block_q)
    sq_pad = -(-sq // bq) * bq
    return (
        jnp.full((b, h, sq_pad), -jnp.inf, jnp.float32),
        jnp.zeros((b, h, sq_pad), jnp.float32),
        jnp.zeros((b, sq_pad, h, d), jnp.float32),
    )


def accumulate(
    q,
    k,
    v,
    state,
    *,
    causal=False,
    kv_mask=None,
    scale=None,
    block_q=512,
    block_kv=512,
    q_offset=0,
    kv_offset=0,
):
    """Fold keys k/v [B, Sk, H, D] (positions kv_offset..) into the state of queries q (q_offset..)."""
    sq, d = q.shape[1], q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    k, v, kv_mask, bk, nk = _kv_blocks(k, v, kv_mask, block_kv)
    bq = even_block(sq, block_q)
    q = _pad_axis(q, 1, state[0].shape[-1])

    def q_step(state, iq):
        m, denom, acc = state
        q_blk = lax.dynamic_slice_in_dim(q, iq * bq, bq, axis=1)
        block = (
            lax.dynamic_slice_in_dim(m, iq * bq, bq, axis=2),
            lax.dynamic_slice_in_dim(denom, iq * bq, bq, axis=2),
            jnp.transpose(lax.dynamic_slice_in_dim(acc, iq * bq, bq, axis=1), (0, 2, 1, 3)),  # [B, H, bq, D]
        )
        m_blk, denom_blk, acc_blk = _attend_block(
            q_blk,
            k,
            v,
            kv_mask,
            block,
            q_pos0=q_offset + iq * bq,
            kv_offset=kv_offset,
            causal=causal,
            scale=scale,
            bk=bk,
            nk=nk,
        )
        return (
            lax.dynamic_update_slice_in_dim(m, m_blk, iq * bq, axis=2),
            lax.dynamic_update_slice_in_dim(denom, denom_blk, iq * bq, axis=2),
            lax.dynamic_update_slice_in_dim(acc, jnp.transpose(acc_blk, (0, 2, 1, 3)), iq * bq, axis=1),
        ), None

    state, _ = lax.scan(q_step, state, jnp.arange(q.shape[1] // bq))
    return state


def finish(state, sq: int, out_dtype):
    """-> out [B, Sq, H, D] in out_dtype, lse [B, Sq, H] fp32 (rows that saw no key: out 0, lse -inf)."""
    m, denom, acc = state
    seen = denom > 0
    safe = jnp.where(seen, denom, 1.0)
    out = (acc / jnp.transpose(safe, (0, 2, 1))[..., None])[:, :sq].astype(out_dtype)
    lse = jnp.where(seen, m + jnp.log(safe), -jnp.inf)
    return out, jnp.transpose(lse, (0, 2, 1))[:, :sq]

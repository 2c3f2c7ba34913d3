"""splash: Pallas splash attention (jax.experimental.pallas.ops.tpu.splash_attention), TPU only.

Written for TPUs and never run on one in this project's CI (CPU only). The Pallas module is imported lazily so
importing models.attention never pulls it in on CPU/GPU. tests/parallel/test_attention.py checks the argument
mapping by running the same kernel in Pallas interpret mode on the CPU (`interpret=True`), against the
reference.

Mapping: splash works per example on [H, S, D] and does not scale the logits, so q is pre-scaled and the batch
is vmapped. Causal is a static `CausalMask` with offset Sk - Sq (the reference's bottom-right convention).
kv_mask becomes segment ids: every query has id 1, a key has id 1 when it may be attended and 0 otherwise.
Lengths are padded up to the block sizes (splash needs whole tiles of 128); padded keys get segment id 0,
padded queries are sliced off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Splash tiles are whole multiples of the TPU's 128-wide lanes (its kernel raises otherwise).
_LANES = 128


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def splash_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    kv_mask=None,
    scale: float | None = None,
    block_q: int = 512,
    block_kv: int = 512,
    interpret: bool = False,
):
    """q: [B, Sq, H, D], k/v: [B, Sk, H, D], kv_mask: [B, Sk] bool -> [B, Sq, H, D]."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    b, sq, h, d = q.shape
    sk = k.shape[1]
    scale = d**-0.5 if scale is None else scale
    if block_q % _LANES or block_kv % _LANES:
        raise ValueError(f"splash block sizes must be multiples of {_LANES}, got {block_q} x {block_kv}")
    bq, bk = min(block_q, _round_up(sq, _LANES)), min(block_kv, _round_up(sk, _LANES))
    sq_pad, sk_pad = _round_up(sq, bq), _round_up(sk, bk)

    base = (
        mask_lib.CausalMask((sq_pad, sk_pad), offset=sk - sq)
        if causal
        else mask_lib.FullMask((sq_pad, sk_pad))
    )
    kernel = kernel_lib.make_splash_mha(
        mask_lib.MultiHeadMask([base] * h),
        block_sizes=kernel_lib.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk),
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )

    def heads_major(x, length):  # [B, S, H, D] -> [B, H, S_pad, D]
        x = jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))
        return jnp.transpose(x, (0, 2, 1, 3))

    qh = heads_major((q * scale).astype(q.dtype), sq_pad)
    kh, vh = heads_major(k, sk_pad), heads_major(v, sk_pad)
    segment_ids = None
    if kv_mask is not None or sk_pad != sk:
        valid = jnp.ones((b, sk), bool) if kv_mask is None else kv_mask
        kv_ids = jnp.pad(valid, ((0, 0), (0, sk_pad - sk))).astype(jnp.int32)  # padding: False -> id 0
        segment_ids = kernel_lib.SegmentIds(q=jnp.ones((b, sq_pad), jnp.int32), kv=kv_ids)
        out = jax.vmap(kernel)(qh, kh, vh, segment_ids)
    else:
        out = jax.vmap(kernel)(qh, kh, vh)
    out = jnp.transpose(out, (0, 2, 1, 3))[:, :sq]  # [B, Sq, H, D]
    if kv_mask is not None:
        # Splash leaves a row with no visible key undefined; the reference's answer is 0.
        out = jnp.where(jnp.any(kv_mask, axis=1)[:, None, None, None], out, jnp.zeros((), out.dtype))
    return out

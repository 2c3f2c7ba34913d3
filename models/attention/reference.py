"""Plain softmax attention: materialises the full score matrix. The yardstick every kernel is tested against.

Conventions shared by every kernel (models.attention.blockwise follows them exactly):
- causal: query i may see key j when `i + q_offset >= j + kv_offset`. The default q_offset (None) is Sk - Sq,
  i.e. the causal diagonal ends at the bottom-right corner, so a query block attends to everything before it.
  Context-parallel strategies pass global positions of their local chunks through q_offset / kv_offset.
- a query that may see no key at all (fully masked row) outputs 0 and has log-sum-exp -inf (torch's SDPA gives
  NaN there; zero keeps padding rows harmless and lets ring merges ignore empty partial results).
"""

from __future__ import annotations

import jax.numpy as jnp


def reference_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    kv_mask=None,
    scale: float | None = None,
    q_offset=None,
    kv_offset=0,
    return_lse: bool = False,
    out_dtype=None,
):
    """q: [B, Sq, H, D], k/v: [B, Sk, H, D], kv_mask: [B, Sk] bool -> [B, Sq, H, D] (, lse [B, Sq, H])."""
    sq, sk = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_offset = sk - sq if q_offset is None else q_offset
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    allowed = jnp.ones((1, 1, sq, sk), bool)
    if causal:
        allowed = (jnp.arange(sq)[:, None] + q_offset >= jnp.arange(sk)[None, :] + kv_offset)[None, None]
    if kv_mask is not None:
        allowed = allowed & kv_mask[:, None, None, :]
    scores = jnp.where(allowed, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # fully masked row: exp(-inf - 0) = 0, no NaN
    weights = jnp.exp(scores - row_max)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / jnp.where(total > 0, total, 1.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v.astype(jnp.float32))
    out = out.astype(q.dtype if out_dtype is None else out_dtype)
    if not return_lse:
        return out
    lse = jnp.where(total > 0, row_max + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)[..., 0]
    return out, jnp.transpose(lse, (0, 2, 1))  # [B, H, Sq] -> [B, Sq, H]

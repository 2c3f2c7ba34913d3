"""Plain softmax attention: materialises the full score matrix. The yardstick every kernel is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reference_attention(q, k, v, *, causal: bool = False, kv_mask=None, scale: float | None = None):
    """q: [B, Sq, H, D], k/v: [B, Sk, H, D], kv_mask: [B, Sk] bool -> [B, Sq, H, D]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        allowed = jnp.arange(sq)[:, None] + (sk - sq) >= jnp.arange(sk)[None, :]
        scores = jnp.where(allowed[None, None], scores, -jnp.inf)
    if kv_mask is not None:
        scores = jnp.where(kv_mask[:, None, None, :], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)

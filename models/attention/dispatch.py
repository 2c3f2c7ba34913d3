"""Dispatch from AttentionSettings to a kernel (and, later, a context-parallel strategy)."""

from __future__ import annotations

from models.attention.reference import reference_attention
from models.attention.settings import AttentionSettings

_DEFAULT = AttentionSettings()


def attention(q, k, v, *, causal: bool = False, kv_mask=None, scale: float | None = None,
              settings: AttentionSettings = _DEFAULT):
    """q: [B, Sq, H, D], k/v: [B, Sk, H, D] -> [B, Sq, H, D]. See models.attention for the contract."""
    return reference_attention(q, k, v, causal=causal, kv_mask=kv_mask, scale=scale)

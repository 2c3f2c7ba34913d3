"""The one attention entry point every model calls.

    out = attention(q, k, v, causal=False, kv_mask=None, settings=settings)
    q: [B, Sq, H, D]   k, v: [B, Sk, H, D]   kv_mask: [B, Sk] bool (True = attend)   out: [B, Sq, H, D]

`settings` (AttentionSettings, a frozen dataclass: static under jit) picks the kernel and, when a mesh
with a `context` axis larger than 1 is given, the context-parallel strategy. Model files never branch
on either.
"""

from models.attention.settings import AttentionSettings
from models.attention.dispatch import attention

__all__ = ["AttentionSettings", "attention"]

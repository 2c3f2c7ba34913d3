"""The one attention entry point every model calls (docs/attention.md).

    out = attention(q, k, v, causal=False, kv_mask=None, scale=None, settings=settings)
    q: [B, Sq, H, D]   k, v: [B, Sk, H, D]   kv_mask: [B, Sk] bool (True = attend)   out: [B, Sq, H, D]

`settings` (AttentionSettings, a frozen dataclass: static under jit) picks the kernel (kernels.py: reference,
xla_blockwise, cudnn, splash) and, when its mesh has a `context` axis larger than 1, the context-parallel
strategy (context.py: ring, ulysses, allgather, hybrid). Model files never branch on either.
"""

from meshserve.models.attention.dispatch import attention
from meshserve.models.attention.settings import AttentionSettings

__all__ = ["AttentionSettings", "attention"]

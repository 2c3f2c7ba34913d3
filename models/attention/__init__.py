"""The one attention entry point every model calls (docs/attention.md).

    out = attention(q, k, v, causal=False, kv_mask=None, scale=None, settings=settings)
    q: [B, Sq, H, D]   k, v: [B, Sk, H, D]   kv_mask: [B, Sk] bool (True = attend)   out: [B, Sq, H, D]

`settings` (AttentionSettings, a frozen dataclass: static under jit) picks the kernel (kernels.py: reference,
xla_blockwise, cudnn, splash) and, when its mesh has a `context` axis larger than 1, the context-parallel
strategy (context.py: ring, ulysses, allgather, hybrid). Model files never branch on either.

The two names load on first use (PEP 562), so `models.attention.options` (the JAX-free option names a pool
config is checked with) imports without JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "attention": "meshserve.models.attention.dispatch",
    "AttentionSettings": "meshserve.models.attention.settings",
}
__all__ = ["AttentionSettings", "attention"]

if TYPE_CHECKING:
    from meshserve.models.attention.dispatch import attention
    from meshserve.models.attention.settings import AttentionSettings


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Runtime attention settings: which kernel, which context-parallel strategy, on which mesh."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jax.sharding import Mesh

Kernel = Literal["auto", "reference", "xla_blockwise", "cudnn", "splash"]
ContextStrategy = Literal["auto", "ring", "ulysses", "allgather", "hybrid"]


@dataclass(frozen=True)
class AttentionSettings:
    kernel: Kernel = "auto"
    context_strategy: ContextStrategy = "auto"
    mesh: Mesh | None = None
    block_q: int = 512
    block_kv: int = 512

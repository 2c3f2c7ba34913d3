"""The names a pool config may give attention's kernel and context strategy, without JAX: the worker validates its
pools.yaml with these before JAX loads, and `AttentionSettings` checks the same sets."""

from __future__ import annotations

from typing import Literal, get_args

Kernel = Literal["auto", "reference", "xla_blockwise", "xla_chunked", "cpu_fused", "cudnn", "splash"]
ContextStrategy = Literal["auto", "ring", "ulysses", "allgather", "hybrid"]

KERNELS: tuple[str, ...] = get_args(Kernel)
CONTEXT_STRATEGIES: tuple[str, ...] = get_args(ContextStrategy)

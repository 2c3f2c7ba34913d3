"""Runtime attention settings: which kernel, which context-parallel strategy, on which mesh.

The dataclass is frozen and hashable so it can be a static argument of `jax.jit` and a field of an NNX module
without becoming a traced value. Models receive it at construction and pass it to every `attention` call; they
never read its fields themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from jax.sharding import Mesh

# The option names live in a JAX-free module (pool configs are validated with them before JAX loads).
from meshserve.models.attention.options import CONTEXT_STRATEGIES, KERNELS, ContextStrategy, Kernel

__all__ = ["CONTEXT_STRATEGIES", "KERNELS", "AttentionSettings", "ContextStrategy", "Kernel"]


@dataclass(frozen=True)
class AttentionSettings:
    """How attention runs; what it computes never depends on these fields (up to float rounding).

    kernel: "auto" picks cudnn on GPU (bf16/fp16, head dim a multiple of 8 up to 128), splash on TPU,
        on the CPU cpu_fused (float32 calls without a mask or causality, where its library builds) or else
        xla_chunked where its score tile fits, and xla_blockwise elsewhere
        (models.attention.kernels.select_kernel); the others force one kernel.
    context_strategy: used only when `mesh` has a "context" axis larger than 1 (models.attention.context).
    mesh: the pool mesh, axes ("data", "cfg", "context", "tensor") (models.parallel.mesh.make_mesh).
    block_q, block_kv: tile sizes of xla_blockwise (and splash); the score tile is [B, H, block_q, block_kv].
    ulysses_degree: for "hybrid", how many devices of the context axis form one Ulysses group (the rest form
        the ring). None: the largest proper divisor of the context size that divides the local head count.
    allgather_max_kv: K/V at most this long are short enough to copy whole to every device: "auto" then uses
        allgather, and cross-attention K/V of this length (Sk != Sq, e.g. 77 text tokens) stay replicated
        instead of being sharded along the sequence.
    """

    kernel: Kernel = "auto"
    context_strategy: ContextStrategy = "auto"
    mesh: Mesh | None = None
    block_q: int = 512
    block_kv: int = 512
    ulysses_degree: int | None = None
    allgather_max_kv: int = 1024

    def __post_init__(self):
        # Fail at construction, not deep inside a trace, on a typo in a pool config.
        if self.kernel not in KERNELS:
            raise ValueError(f"unknown attention kernel {self.kernel!r}; expected one of {KERNELS}")
        if self.context_strategy not in CONTEXT_STRATEGIES:
            raise ValueError(
                f"unknown context strategy {self.context_strategy!r}; expected one of {CONTEXT_STRATEGIES}"
            )
        if self.block_q < 1 or self.block_kv < 1:
            raise ValueError(f"block sizes must be positive, got {self.block_q} x {self.block_kv}")
        if self.ulysses_degree is not None and self.ulysses_degree < 1:
            raise ValueError(f"ulysses_degree must be >= 1, got {self.ulysses_degree}")
        if self.ulysses_degree is not None and self.context_strategy != "hybrid":
            # Only "hybrid" splits the context axis into Ulysses groups; any other strategy would ignore it.
            raise ValueError(
                f"ulysses_degree applies to context_strategy 'hybrid' only, not {self.context_strategy!r}"
            )

"""Hybrid context parallelism: Ulysses inside groups of U devices, ring across the R = N / U groups.

The pool mesh has one "context" axis of size N. To run two collectives over two different device groups, the
entry point lays the same devices out as a mesh whose context axis is split in two, ("context_ring",
"context_ulysses") of sizes (R, U), ring-major: context index c = r * U + u. A sequence sharded over
("context_ring", "context_ulysses") therefore puts chunk c on exactly the device that held it on the pool
mesh, so entering this shard_map moves no data.

Inside: all_to_all over the U devices of a group (sequence chunk -> group's contiguous S/R block for H/U
heads), then ring attention over the R groups, then all_to_all back. U = N is Ulysses, U = 1 is ring. Heads
per device must be divisible by U; ring's K/V traffic is divided by U (each ring step carries H/U heads).
"""

from __future__ import annotations

from jax import lax
from jax.sharding import Mesh

from models.attention.ring import ring_attention
from models.attention.ulysses import heads_to_seq, seq_to_heads, validate_ulysses
from models.parallel.mesh import LayoutError

RING_AXIS = "context_ring"
ULYSSES_AXIS = "context_ulysses"


def hybrid_degrees(context: int, local_heads: int, requested: int | None) -> tuple[int, int]:
    """(ulysses, ring) sizes. Default: the largest proper divisor of `context` that divides the heads, so that
    some ring remains (1 when none does: pure ring)."""
    if requested is None:
        requested = max(d for d in range(1, max(context, 2)) if context % d == 0 and local_heads % d == 0)
    if context % requested:
        raise LayoutError(f"ulysses_degree={requested} does not divide the context axis size {context}")
    validate_ulysses(local_heads, requested)
    return requested, context // requested


def hybrid_mesh(mesh: Mesh, ulysses: int) -> Mesh:
    """The pool mesh with "context" split into (RING_AXIS, ULYSSES_AXIS): same devices, same order."""
    names = list(mesh.axis_names)
    at = names.index("context")
    ring = mesh.devices.shape[at] // ulysses
    shape = mesh.devices.shape[:at] + (ring, ulysses) + mesh.devices.shape[at + 1 :]
    names[at : at + 1] = [RING_AXIS, ULYSSES_AXIS]
    return Mesh(mesh.devices.reshape(shape), tuple(names))


def hybrid_attention(q, k, v, kv_mask, *, ring_size: int, ulysses_size: int, q_shift, kernel, blockwise=None):
    """Local chunks q: [B, cq, H, D], k/v: [B, ck, H, D], kv_mask: [B, ck] or None -> [B, cq, H, D]."""
    validate_ulysses(q.shape[2], ulysses_size)
    q, k, v = (seq_to_heads(x, ULYSSES_AXIS) for x in (q, k, v))  # [B, S/R, H/U, D]: this group's block
    if kv_mask is not None:
        kv_mask = lax.all_gather(kv_mask, ULYSSES_AXIS, axis=1, tiled=True)  # [B, Sk/R]
    out = ring_attention(
        q,
        k,
        v,
        kv_mask,
        axis_name=RING_AXIS,
        axis_size=ring_size,
        q_shift=q_shift,
        kernel=kernel,
        blockwise=blockwise,
    )
    return heads_to_seq(out, ULYSSES_AXIS)

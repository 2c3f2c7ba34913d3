"""Ulysses attention (Jacobs et al. 2023, arXiv:2309.14509): trade the sequence split for a head split.

Runs inside shard_map. Each of the N devices holds a sequence chunk of all (local) heads. One `all_to_all` per
tensor turns that into the whole sequence for H/N heads, a plain local attention runs (any kernel), and one
more all_to_all turns the output back. Needs the local head count divisible by N (validate_ulysses).

Communication per call: q, k, v and out each cross once, (N - 1)/N of their local bytes; unlike ring it
shrinks per device as N grows but needs heads >= N.
"""

from __future__ import annotations

from jax import lax

from models.parallel.mesh import LayoutError


def validate_ulysses(local_heads: int, degree: int) -> None:
    if local_heads % degree:
        raise LayoutError(
            f"Ulysses over {degree} devices needs the heads per device ({local_heads}, after the tensor "
            f"split) divisible by {degree}; use context_strategy='ring' or 'hybrid' with a smaller "
            "ulysses_degree"
        )


def seq_to_heads(x, axis_name: str):
    """[B, S/N, H, D] sequence chunk -> [B, S, H/N, D] head group (device j gets heads j*H/N...)."""
    return lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x, axis_name: str):
    """Inverse of seq_to_heads: [B, S, H/N, D] -> [B, S/N, H, D]."""
    return lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


def ulysses_attention(q, k, v, kv_mask, *, axis_name: str, axis_size: int, q_shift, kernel):
    """Local chunks q: [B, cq, H, D], k/v: [B, ck, H, D], kv_mask: [B, ck] bool or None -> [B, cq, H, D]."""
    validate_ulysses(q.shape[2], axis_size)
    q, k, v = (seq_to_heads(x, axis_name) for x in (q, k, v))
    if kv_mask is not None:
        # [B, Sk]: every head group needs the whole mask.
        kv_mask = lax.all_gather(kv_mask, axis_name, axis=1, tiled=True)
    # The whole (padded) sequence is local now, so positions are global ones and only the causal shift
    # remains. None (the kernel's own Sk - Sq) where padding left it unchanged keeps cudnn/splash eligible.
    shift_unchanged = isinstance(q_shift, int) and q_shift == k.shape[1] - q.shape[1]
    out = kernel(q, k, v, kv_mask=kv_mask, q_offset=None if shift_unchanged else q_shift)
    return heads_to_seq(out, axis_name)

"""Ulysses attention (Jacobs et al. 2023, arXiv:2309.14509): trade the sequence split for a head split.

Runs inside shard_map. Each of the N devices holds a sequence chunk of all (local) heads. One `all_to_all` per
tensor turns that into the whole sequence for H/N heads, a plain local attention runs (any kernel), and one
more all_to_all turns the output back. Needs the local head count divisible by N (validate_ulysses).

Communication per call: q, k, v and out each cross once, (N - 1)/N of their local bytes; unlike ring it
shrinks per device as N grows but needs heads >= N.

The exchange runs per head group (`head_groups`: up to 8 groups of at least one head per device), in a loop:
only one group's head-split copies of q, k, v and out exist at a time, instead of all of them (measured at
64k tokens, 8 heads: 256 -> 96 MiB of temporaries per device at N=2, 128 -> 96 at N=4; docs/attention.md).
The bytes sent are the same, in G times more, G times smaller collectives. With one head per device there
is only one group, and the head-split copies of the whole sequence set the floor: for H heads over N devices,
K and V alone are 2N/H of the local chunk size.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from meshserve.models.parallel.mesh import LayoutError


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


MAX_HEAD_GROUPS = 8


def head_groups(local_heads: int, degree: int, max_groups: int = MAX_HEAD_GROUPS) -> int:
    """How many head groups the exchange runs in: the most (up to max_groups) that divide the heads per
    device into groups whose head count still splits over the degree (one head per device at the least)."""
    per_device = local_heads // degree
    return max(g for g in range(1, min(per_device, max_groups) + 1) if per_device % g == 0)


def ulysses_attention(q, k, v, kv_mask, *, axis_name: str, axis_size: int, q_shift, kernel):
    """Local chunks q: [B, cq, H, D], k/v: [B, ck, H, D], kv_mask: [B, ck] bool or None -> [B, cq, H, D].

    The heads go through in G = head_groups(H, N) groups, one after the other (a loop): each group's q, k,
    v cross, are attended and its output crosses back into its heads of `out`. Only one group's
    head-split copies exist at a time: G times less than exchanging all heads at once (measured in
    docs/attention.md), for the same bytes sent, in G times more (smaller) collectives.
    """
    b, cq, h, d = q.shape
    validate_ulysses(h, axis_size)
    if kv_mask is not None:
        # [B, Sk]: every head group needs the whole mask.
        kv_mask = lax.all_gather(kv_mask, axis_name, axis=1, tiled=True)
    groups = head_groups(h, axis_size)
    width = h // groups  # heads per group, over all devices; width / N of them per device

    def attend(q, k, v):
        """One group: [B, c, width, D] chunks -> its output [B, cq, width, D]."""
        q, k, v = (seq_to_heads(x, axis_name) for x in (q, k, v))
        # The whole (padded) sequence is local now, so positions are global ones and only the causal shift
        # remains. None (the kernel's own Sk - Sq) where padding left it unchanged keeps cudnn/splash
        # eligible.
        shift_unchanged = isinstance(q_shift, int) and q_shift == k.shape[1] - q.shape[1]
        out = kernel(q, k, v, kv_mask=kv_mask, q_offset=None if shift_unchanged else q_shift)
        return heads_to_seq(out, axis_name)

    if groups == 1:
        return attend(q, k, v)

    def group(g, out):
        part = [lax.dynamic_slice_in_dim(x, g * width, width, axis=2) for x in (q, k, v)]
        return lax.dynamic_update_slice_in_dim(out, attend(*part), g * width, axis=2)

    return lax.fori_loop(0, groups, group, jnp.zeros((b, cq, h, d), q.dtype))

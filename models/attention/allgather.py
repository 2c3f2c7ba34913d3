"""All-gather attention: every device gathers the whole K/V and attends its own query chunk to it.

Runs inside shard_map. The simplest context strategy and the cheapest when K/V are short: one all_gather of
(N - 1)/N x the global K/V per device, no per-step latency. Its memory is not divided by N (each device holds
the whole K/V), so it is for short sequences, and for cross-attention, where K/V (e.g. 77 text tokens) are not
sharded at all: then `kv_sharded` is False, nothing is gathered and the call is purely local.
"""

from __future__ import annotations

from jax import lax


def allgather_attention(q, k, v, kv_mask, *, axis_name: str, causal: bool, q_shift, kernel, kv_sharded: bool):
    """Local q [B, cq, H, D]; k/v [B, ck, H, D] (kv_sharded) or [B, Sk, H, D] (whole) -> [B, cq, H, D]."""
    if kv_sharded:
        k, v = (lax.all_gather(x, axis_name, axis=1, tiled=True) for x in (k, v))
        if kv_mask is not None:
            kv_mask = lax.all_gather(kv_mask, axis_name, axis=1, tiled=True)
    # Only causal masking needs this chunk's global position; without it cudnn/splash stay usable.
    q_offset = lax.axis_index(axis_name) * q.shape[1] + q_shift if causal else None
    return kernel(q, k, v, kv_mask=kv_mask, q_offset=q_offset)

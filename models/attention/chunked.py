"""xla_chunked: attention one batch row at a time, each as a few query chunks against all the keys; the CPU's
kernel where its score tile is small.

For one batch row (a `lax.map` over the batch) and each chunk of at most BLOCK_Q queries: the scores against
every key, their softmax, the product with V, the chunks as straight-line code. Against xla_blockwise (nested
`lax.scan`s over query and key blocks, with the online softmax's running max and rescaling) XLA:CPU has less
to do per score and no loop between the chunks of one row. The batch goes one row at a time because with
every row's chunks in one straight line the two threads ran them slower, not faster (Flux's core on [2, 1152,
4 x 64]: 35-43 ms against blockwise's 28; one row at a time 22). Measured on a 2-core Xeon, 2026-11-26,
bench/README.md ("The attention core on the CPU"): the Flux-shaped transformer's forward (true-CFG batch of
2, 6 blocks, 1,152 tokens) 298 / 320 -> 268 / 286 ms in two alternating pairs of processes, the SDXL-shaped
UNet's 151 / 150 -> 149 / 143 ms, the Wan-shaped step unchanged.

The score tile [H, chunk, Sk] is live for all keys at once, so a call runs here only where that tile fits
MAX_TILE_BYTES with chunks of at least MIN_CHUNK rows and at most MAX_CHUNKS of them (`chunk_rows`); other
calls, and those that need a log-sum-exp or causal chunk positions (context-parallel strategies), go to
xla_blockwise (models.attention.kernels). Masking follows models.attention.reference exactly: a query that
may see no key gives 0.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

BLOCK_Q = 128  # query rows per chunk, at most
MIN_CHUNK = 8
MAX_CHUNKS = 32  # straight-line code grows with the chunks: compile time
# One row's fp32 scores [H, chunk, Sk]: Flux's 2.25 MiB at 512x512 is the largest measured; not tuned beyond.
MAX_TILE_BYTES = 8 << 20


def chunk_rows(heads: int, sq: int, sk: int) -> int | None:
    """Query rows per chunk for one batch row, or None where the call does not suit this kernel."""
    rows = min(BLOCK_Q, sq, MAX_TILE_BYTES // (4 * heads * sk)) // MIN_CHUNK * MIN_CHUNK
    rows = sq if sq < MIN_CHUNK and 4 * heads * sq * sk <= MAX_TILE_BYTES else rows
    if rows < min(MIN_CHUNK, sq) or -(-sq // rows) > MAX_CHUNKS:
        return None
    return rows


def xla_chunked(q, k, v, *, causal: bool = False, kv_mask=None, scale: float | None = None):
    """q: [B, Sq, H, D], k/v: [B, Sk, H, D], kv_mask: [B, Sk] bool (True = attend) -> [B, Sq, H, D] in q's
    dtype. Causal as the reference's default: query i sees key j when i + Sk - Sq >= j. Raises ValueError
    for sizes `chunk_rows` refuses."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    rows = chunk_rows(h, sq, sk)
    if rows is None:
        raise ValueError(f"xla_chunked: {h} heads x {sq} queries x {sk} keys do not fit its score tile")
    scale = d**-0.5 if scale is None else scale
    masked = causal or kv_mask is not None
    allowed_causal = None
    if causal:
        allowed_causal = (jnp.arange(sq)[:, None] + (sk - sq) >= jnp.arange(sk)[None, :])[None]  # [1, Sq, Sk]

    def one_row(args):
        """q [Sq, H, D], k/v [Sk, H, D], mask [Sk] or None -> [Sq, H, D]."""
        q, k, v, mask = args
        qh = jnp.transpose(q, (1, 0, 2))  # [H, Sq, D]
        kh = jnp.transpose(k, (1, 2, 0))  # [H, D, Sk]
        vh = jnp.transpose(v, (1, 0, 2))  # [H, Sk, D]
        outs = []
        for start in range(0, sq, rows):
            stop = min(start + rows, sq)
            s = jnp.einsum("hqd,hdk->hqk", qh[:, start:stop], kh, preferred_element_type=jnp.float32) * scale
            if masked:
                allowed = allowed_causal[:, start:stop] if causal else True
                if mask is not None:
                    allowed = allowed & mask[None, None, :]
                s = jnp.where(allowed, s, -jnp.inf)
            row_max = jnp.max(s, axis=-1, keepdims=True)
            if masked:  # a row with no key to see: exp(-inf - 0) = 0, not NaN
                row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
            weights = jnp.exp(s - row_max)
            total = jnp.sum(weights, axis=-1, keepdims=True)
            out = jnp.einsum("hqk,hkd->hqd", weights.astype(v.dtype), vh, preferred_element_type=jnp.float32)
            # Normalised after the product: a divide over [chunk, D] instead of over the [chunk, Sk] weights.
            outs.append(out / (jnp.where(total > 0, total, 1.0) if masked else total))
        out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
        return jnp.transpose(out, (1, 0, 2)).astype(q.dtype)

    if b == 1:
        return one_row((q[0], k[0], v[0], None if kv_mask is None else kv_mask[0]))[None]
    return lax.map(one_row, (q, k, v, kv_mask))

"""Feature maps too small to split over `context` are replicated over it at every 2-D convolution.

Context parallelism splits tokens only inside attention (models/attention/context.py); XLA's SPMD partitioner
carries that split into the convolutions around it as a split of the map's rows. With about one row per
device, the partitioned convolution computes wrong values on a mesh with a second axis (jax 0.10.2, 8 CPU
devices: a 3x3 conv of a 2x2 map split over (cfg 2, context 2) was 21.7 off; a stride-2 conv of a 4x4 map
18.5 off; the tiny SDXL pipeline at 8x8 pixels, cfg 2 x context 2, 0.28 max abs pixel against one device, as
were the 3-level SDXL UNet's 2x2 bottom level at 64x64 pixels and 8x8 latents). Maps with fewer than
`MIN_ROWS` rows per context device therefore go into and out of each conv whole on every context device (still
split over the batch axes): such maps cost little to convolve, and every layout stays exact. At SDXL's real
sizes the maps are far larger (1024x1024: 32 rows at the deepest level, 4 per device at context 8): untouched.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshserve.models.attention.context import CONTEXT_AXIS, batch_axes_for

# Rows per context device below which a map is not split. 2 rows per device were wrong after a stride-2 conv
# (4 rows over context 2); 4 was right in every case measured (maps of 2-16 rows, context 2-8, strides 1-2).
MIN_ROWS = 4


def replicate_small_map(x: jax.Array, mesh: Mesh | None) -> jax.Array:
    """x [B, H, W, C]: constrained to the batch split alone when H < MIN_ROWS x context; else unchanged."""
    if mesh is None or x.ndim != 4:
        return x
    context = dict(mesh.shape).get(CONTEXT_AXIS, 1)
    if context <= 1 or x.shape[1] >= MIN_ROWS * context:
        return x
    spec = P(batch_axes_for(mesh, x.shape[0]), None, None, None)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

"""Wan 2.2's two experts as one denoiser: `transformer` for the high-noise steps, `transformer_2` below a boundary.

diffusers' WanPipeline with `transformer_2` and `boundary_ratio` (Wan2.2-T2V-A14B) runs `transformer` for the
steps whose timestep t >= boundary_ratio x num_train_timesteps and `transformer_2` for the rest, each step's CFG
scale guidance_scale or guidance_scale_2 the same way. Here both are the children of one module, so the engine
loads, splits, shards, quantizes and scans them as it does one denoiser, and the compiled loop picks the expert
per step with `lax.switch` on the traced timestep (one program; each step runs one expert).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from meshserve.models.checkpoints.loading import CheckpointError
from meshserve.models.engine.step_cache import take_turns
from meshserve.models.wan.transformer_wan import load_wan_transformer


class WanExperts(nnx.Module):
    """`transformer(x, t, ...)` for t >= boundary (a timestep), `transformer_2(x, t, ...)` below it."""

    def __init__(self, transformer, transformer_2, boundary: float):
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.boundary = float(boundary)
        self.config = transformer.config

    def __call__(self, x, t, *args):
        # A step cache keeps a state per expert (take_turns): the high-noise expert's features are no reference
        # for the low-noise one's first step, which therefore computes.
        low = (t[0] < self.boundary).astype(jnp.int32)
        return take_turns(low, [self.transformer, self.transformer_2], x, t, *args)


def load_wan_experts(folder: Path, *, boundary: float, place=None, **kwargs) -> WanExperts:
    """`folder` (the pipeline's transformer/) and its sibling transformer_2/, loaded as `load_wan_transformer`
    loads one; the two must take and give the same channels and patches. `place` sees each weight's path in
    the composite (under "transformer" or "transformer_2"), as the engine later finds it (quantize's scales)."""
    folder = Path(folder)

    def under(name):
        return None if place is None else lambda path, array: place((name, *path), array)

    high = load_wan_transformer(folder, place=under("transformer"), **kwargs)
    low = load_wan_transformer(folder.parent / "transformer_2", place=under("transformer_2"), **kwargs)
    a, b = high.config, low.config
    if (a.in_channels, a.output_channels, a.patch_size) != (b.in_channels, b.output_channels, b.patch_size):
        raise CheckpointError(
            f"{folder.parent}: transformer and transformer_2 differ in channels or patch size "
            f"({a.in_channels}/{a.output_channels}/{a.patch_size} against {b.in_channels}/{b.output_channels}/{b.patch_size})"
        )
    return WanExperts(high, low, boundary)

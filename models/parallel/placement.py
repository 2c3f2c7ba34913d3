"""Where a pipeline's weights and activations live on its pool mesh.

Parameters carry logical axis names through one rules table per model (a few regexes over parameter paths,
e.g. `attn1.to_q.kernel -> (None, "heads")`, kept beside the model); `LOGICAL_TO_MESH` maps those names to
mesh axes. Weights are device_put straight into their NamedSharding from the host copy, so a tensor-split
weight never exists whole on any device. Activations: the batch is split over ("data", "cfg"), which, with
the CFG batch interleaved per sample ([u0, c0, u1, c1, ...]), puts every sample's unconditional and
conditional halves on the two sides of the `cfg` axis. Tokens are split on `context` inside attention
(models.attention.context); XLA's partitioner carries the rest.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshserve.models.attention import AttentionSettings
from meshserve.models.attention.context import batch_axes_for
from meshserve.models.loading import torch_key
from meshserve.models.parallel.mesh import LayoutError, MeshSizes, make_mesh, select_devices, validate_layout

# Logical parameter axes -> mesh axes. Heads and MLP hidden units are tensor parallel; everything else is
# replicated (weights of a diffusion model are small next to its activations at serving resolutions).
LOGICAL_TO_MESH: dict[str, str | tuple[str, ...] | None] = {"heads": "tensor", "mlp": "tensor"}

Rules = Sequence[tuple[str, tuple[str | None, ...]]]


@dataclass(frozen=True)
class Placement:
    """A pool mesh and the rules that place one pipeline's arrays on it (hashable: a static jit argument)."""

    mesh: Mesh
    sizes: MeshSizes

    # --- parameters

    def param_spec(self, rules: Rules, key: str, ndim: int) -> P:
        for pattern, logical in rules:
            if re.search(pattern, key):
                if len(logical) != ndim:
                    raise ValueError(f"sharding rule {pattern!r} has {len(logical)} axes, {key} has {ndim}")
                return P(*(LOGICAL_TO_MESH.get(name) if name else None for name in logical))
        return P()

    def placer(self, rules: Rules):
        """A `place(path, array)` for models.loading.load_weights: host array -> its sharded device array."""

        sizes = dict(self.mesh.shape)

        def place(path: tuple, array: np.ndarray) -> jax.Array:
            key = torch_key(path)
            spec = self.param_spec(rules, key, array.ndim)
            for dim, axis in enumerate(spec):
                if axis is not None and array.shape[dim] % sizes[axis]:
                    raise LayoutError(
                        f"{key}: axis {dim} (size {array.shape[dim]}, attention heads or MLP units) does not "
                        f"split over {axis}={sizes[axis]}"
                    )
            return jax.device_put(array, NamedSharding(self.mesh, spec))

        return place

    # --- activations

    def batch_spec(self, batch: int, ndim: int) -> NamedSharding:
        """Batch split over (data, cfg) when it divides (else one of them, else replicated): the same rule
        the context-parallel attention uses for its in_specs, so no resharding happens at its boundary."""
        return NamedSharding(self.mesh, P(batch_axes_for(self.mesh, batch), *([None] * (ndim - 1))))

    def constrain_batch(self, x: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, self.batch_spec(x.shape[0], x.ndim))

    def put_batch(self, x) -> jax.Array:
        x = jax.numpy.asarray(x)
        return jax.device_put(x, self.batch_spec(x.shape[0], x.ndim))

    def validate_heads(self, heads: set[int], strategy: str) -> None:
        """Every attention layer's head count against tensor (and the Ulysses degree), before compiling."""
        ulysses = self.sizes.context if strategy == "ulysses" and self.sizes.context > 1 else None
        for h in sorted(heads):
            validate_layout(self.sizes, num_devices=self.sizes.num_devices, heads=h, ulysses_degree=ulysses)


def pipeline_placement(
    mesh: dict | MeshSizes,
    devices=None,
    *,
    attention: AttentionSettings | None = None,
    weights: dict | None = None,
) -> dict:
    """Keyword arguments for a pipeline constructor: its Placement and mesh-aware AttentionSettings.

    `mesh`: sizes for data/cfg/context/tensor (missing axes are 1); `devices`: a slice spec ("0-3"), a list
    of jax devices, or None for all of jax.devices() (then the sizes must use them all).
    """
    sizes = mesh if isinstance(mesh, MeshSizes) else MeshSizes.from_dict(mesh)
    if devices is None:
        device_list = jax.devices()
    elif isinstance(devices, str | int) or (
        isinstance(devices, list | tuple) and devices and isinstance(devices[0], int)
    ):
        device_list = select_devices(devices)
    else:
        device_list = list(devices)
    validate_layout(sizes, num_devices=len(device_list))
    grid = make_mesh(sizes, device_list)
    base = attention or AttentionSettings()
    settings = dataclasses.replace(base, mesh=grid)
    return {"placement": Placement(grid, sizes), "attention": settings}

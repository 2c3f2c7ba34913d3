"""Where a pipeline's weights and activations live on its pool mesh.

Parameters carry logical axis names through one rules table per model (a few regexes over parameter paths,
e.g. `attn1.to_q.weight -> ("embed", "heads")`, kept beside the model); each Placement maps those names to
mesh axes (`Placement.logical_to_mesh`): "heads" and "mlp" to `tensor`, "embed" to the pool's
`weights: {shard_over: [...]}` axes (FSDP / ZeRO-3: the weight is stored split over batch-like axes and XLA
gathers it where it is used; replicated when shard_over is empty). Weights are device_put straight into
their NamedSharding from the host copy, so a split weight never exists whole on any device. Activations: the batch is split over ("data", "cfg"), which, with
the CFG batch interleaved per sample ([u0, c0, u1, c1, ...]), puts every sample's unconditional and
conditional halves on the two sides of the `cfg` axis. Tokens are split on `context` inside attention
(models.attention.context); XLA's partitioner carries the rest.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshserve.models.attention import AttentionSettings
from meshserve.models.attention.context import batch_axes_for
from meshserve.models.checkpoints.loading import torch_key
from meshserve.models.components.block_stack import STACKED, gather_blocks_with
from meshserve.models.parallel.mesh import (
    LayoutError,
    MeshSizes,
    make_mesh,
    select_devices,
    validate_layout,
    validate_weight_sharding,
)

# Logical parameter axes that are tensor parallel: attention heads and MLP hidden units. Heads must split
# exactly (LayoutError otherwise: a layout whose tensor axis leaves a model's heads whole is a mistake to say, not
# to hide). MLP hidden units that do not divide stay whole on every device: each unit is computed on its own,
# so that is correct, only less parallel; it is the small text encoders of test checkpoints that have them
# (transformers' tiny T5 configs: d_ff 37), never a real model's.
TENSOR_PARALLEL = ("heads", "mlp")
# The logical axis of a weight's FSDP-sharded dimension (the model width: channels, hidden size). Mapped to the
# pool's shard_over axes; a dimension that does not divide their product falls back to the largest subset of
# them that divides it, else to replication: storage only, never a correctness or shape question.
FSDP = "embed"

Rules = Sequence[tuple[str, tuple[str | None, ...]]]


@dataclass(frozen=True)
class Placement:
    """A pool mesh and the rules that place one pipeline's arrays on it (hashable: a static jit argument).

    shard_over: mesh axes (of data, cfg, context; validated by mesh.validate_weight_sharding) over which the
    weights' "embed" dimension is stored split. Empty: only tensor parallelism splits weights.
    """

    mesh: Mesh
    sizes: MeshSizes
    shard_over: tuple[str, ...] = ()

    # --- parameters

    @property
    def logical_to_mesh(self) -> dict[str, tuple[str, ...]]:
        """Logical parameter axis -> the mesh axes it is split over (an empty tuple: not split)."""
        return {**{name: ("tensor",) for name in TENSOR_PARALLEL}, FSDP: self.shard_over}

    def param_spec(self, rules: Rules, key: str, shape: tuple[int, ...]) -> P:
        """The PartitionSpec of parameter `key` (a checkpoint name) of this shape: by the first rule whose
        pattern matches and whose rank is the parameter's (a layer may be a Linear or a 1x1 conv by config);
        replicated when no pattern matches. A pattern that matches only with other ranks is a rules bug.
        A stacked block's parameter (models/components/block_stack.py: `<list>.stacked.<path>`, one more
        axis in front) is placed as the block's own, that leading axis unsplit."""
        if f".{STACKED}." in key:
            block_key = re.sub(rf"\.{STACKED}\.", ".0.", key, count=1)
            return P(None, *self.param_spec(rules, block_key, shape[1:]))
        matched = [logical for pattern, logical in rules if re.search(pattern, key)]
        for logical in matched:
            if len(logical) == len(shape):
                return P(
                    *(self._mesh_axes(key, name, size) for name, size in zip(logical, shape, strict=True))
                )
        if matched:
            raise ValueError(
                f"sharding rules for {key} have {[len(m) for m in matched]} axes, it has {len(shape)}"
            )
        return P()

    def _mesh_axes(self, key: str, logical: str | None, size: int) -> str | tuple[str, ...] | None:
        axes = (
            tuple(a for a in self.logical_to_mesh.get(logical, ()) if self.mesh.shape[a] > 1)
            if logical
            else ()
        )
        if logical == "mlp":
            axes = tuple(a for a in axes if size % self.mesh.shape[a] == 0)
        elif logical in TENSOR_PARALLEL:
            for axis in axes:
                if size % self.mesh.shape[axis]:
                    raise LayoutError(
                        f"{key}: a dimension of size {size} (attention heads or MLP units) does not split over "
                        f"{axis}={self.mesh.shape[axis]}"
                    )
        else:
            axes = _largest_dividing_subset(axes, dict(self.mesh.shape), size)
        if not axes:
            return None
        return axes[0] if len(axes) == 1 else axes

    def placer(self, rules: Rules):
        """A `place(path, array)` for models.loading.load_weights: host array -> its sharded device array."""

        def place(path: tuple, array: np.ndarray) -> jax.Array:
            spec = self.param_spec(rules, torch_key(path), array.shape)
            return jax.device_put(array, NamedSharding(self.mesh, spec))

        return place

    def gather_weights(self, state, rules: Rules):
        """Inside a jitted program: `state` (an nnx.State placed by `placer(rules)`) constrained to its
        tensor-only sharding, so XLA all-gathers each FSDP-split weight (over shard_over) instead of
        partitioning the layer along the weight's split dimension (the convs' output channels: it then has
        to re-shard every such activation, which at serving sizes is larger than the weight). Also for
        correctness: XLA's partitioner computes a 3x3 conv wrongly on a 2-D mesh when its input is split on
        H (the UNet's, after context-parallel attention) and its kernel is split (docs/weights.md, Found;
        tests/parallel/test_weight_sharding.py keeps a repro). Identity without shard_over."""
        if not self.shard_over:
            return state
        # A stacked block's weights stay split here, gathered one block at a time where it runs (gather_blocks):
        # gathered here, a stack would be every block's weights on every device at once.
        return self._gathered(state, rules, torch_key, _gathers)

    def gather_blocks(self, module, rules: Rules):
        """Inside a jitted program, after the merge: `module` with each BlockStack (models/components/
        block_stack.py) gathering its blocks' FSDP-split weights one block at a time, inside its scan, as
        `gather_weights` gathers the unstacked weights (gathered whole, FLUX.1-dev's stacks on context4 with
        FSDP took 15 GB of temporaries per device; bench/flux_memory.py). Identity without shard_over."""
        if not self.shard_over:
            return module

        def gather(name: str, block_state):  # a block's own paths, named as the unstacked block's
            return self._gathered(block_state, rules, lambda path: f"{name}.0.{torch_key(path)}")

        return gather_blocks_with(module, gather)

    def _gathered(self, state, rules: Rules, key_of, gathers=lambda path, var: isinstance(var, nnx.Variable)):
        """`state` with each variable `gathers` picks constrained to its tensor-only sharding (by the rule of
        its checkpoint name `key_of(path)`)."""
        whole = dataclasses.replace(self, shard_over=())

        def gather(path: tuple, value: jax.Array) -> jax.Array:
            spec = whole.param_spec(rules, key_of(path), value.shape)
            return jax.lax.with_sharding_constraint(value, NamedSharding(self.mesh, spec))

        flat = [
            (path, var.replace(gather(path, var.get_value())) if gathers(path, var) else var)
            for path, var in state.flat_state()
        ]
        return nnx.State.from_flat_path(flat)

    def gather_weights_per_step(self, state, x, rules: Rules):
        """`gather_weights` inside a loop body, tied to the loop-variant activation x: returns (gathered state,
        x). Without the tie the gathered weights are loop-invariant and XLA hoists every gather out of the
        denoise while loop, so the whole model is live on each device for the whole generation (measured on
        SDXL-base at 2 ways: 794 all-gathers, all before the loop; docs/weights.md). The optimization barrier
        makes the weights depend on this step's x, so they are gathered each step and freed after their last
        use in it; where in the step each gather runs is the XLA scheduler's choice (docs/weights.md: on
        XLA:CPU only its memory-minimizing scheduler puts them at their layers). The barrier is an identity:
        the values are unchanged. Identity without shard_over."""
        if not self.shard_over:
            return state, x
        state, x = jax.lax.optimization_barrier((state, x))
        return self.gather_weights(state, rules), x

    # --- activations

    def batch_spec(self, batch: int, ndim: int) -> NamedSharding:
        """Batch split over (data, cfg) when it divides (else one of them, else replicated): the same rule
        the context-parallel attention uses for its in_specs, so no resharding happens at its boundary."""
        return NamedSharding(self.mesh, P(batch_axes_for(self.mesh, batch), *([None] * (ndim - 1))))

    def constrain_batch(self, x: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, self.batch_spec(x.shape[0], x.ndim))

    def validate_heads(self, heads: set[int], strategy: str) -> None:
        """Every attention layer's head count against tensor (and the Ulysses degree), before compiling."""
        ulysses = self.sizes.context if strategy == "ulysses" and self.sizes.context > 1 else None
        for h in sorted(heads):
            validate_layout(self.sizes, heads=h, ulysses_degree=ulysses)


def pipeline_placement(
    mesh: dict | MeshSizes,
    devices=None,
    *,
    attention: AttentionSettings | None = None,
    weights: dict | None = None,
) -> dict:
    """Keyword arguments for a pipeline constructor: its Placement and mesh-aware AttentionSettings.

    `mesh`: sizes for data/cfg/context/tensor (missing axes are 1); `devices`: a slice spec ("0-3"), a list
    of jax devices, or None for all of jax.devices() (then the sizes must use them all); `weights`:
    {"shard_over": ["data", "context"]} stores every large weight split over those axes as well as tensor
    (mesh.validate_weight_sharding says what is allowed).
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
    grid = make_mesh(sizes, device_list)  # validates the sizes against the devices
    shard_over = validate_weight_sharding(weights, sizes)
    base = attention or AttentionSettings()
    settings = dataclasses.replace(base, mesh=grid)
    return {"placement": Placement(grid, sizes, shard_over), "attention": settings}


def gathered(placement: Placement | None, state, rules: Rules):
    """`placement.gather_weights(state, rules)`, or `state` itself without a placement (one device)."""
    return placement.gather_weights(state, rules) if placement is not None else state


def gathered_blocks(placement: Placement | None, module, rules: Rules):
    """`placement.gather_blocks(module, rules)`, or `module` itself without a placement (one device)."""
    return placement.gather_blocks(module, rules) if placement is not None else module


def _gathers(path: tuple, var) -> bool:
    return isinstance(var, nnx.Variable) and STACKED not in path


def gathered_per_step(placement: Placement | None, state, x, rules: Rules):
    """`placement.gather_weights_per_step(state, x, rules)`, or (state, x) without a placement."""
    return placement.gather_weights_per_step(state, x, rules) if placement is not None else (state, x)


def _largest_dividing_subset(axes: tuple[str, ...], sizes: dict[str, int], dim: int) -> tuple[str, ...]:
    """The sub-tuple of `axes` (order kept) with the largest device product that divides `dim`; () if none.

    E.g. a 4-channel conv output over (data=2, context=4): (data,) -> 2-way, rather than failing or
    replicating. Ties keep the earlier axes (itertools.combinations order).
    """
    best: tuple[str, ...] = ()
    for r in range(len(axes), 0, -1):
        for subset in itertools.combinations(axes, r):
            n = math.prod(sizes[a] for a in subset)
            if dim % n == 0 and n > math.prod(sizes[a] for a in best):
                best = subset
    return best

"""A pool's layout as its config writes it - the device slice and the mesh sizes - read and checked without JAX.

The worker's `pools.yaml` is validated before JAX loads (a worker with only model-free runners never loads it,
tests/workers/test_imports.py), and `models.parallel.mesh` builds the real `Mesh` from the same spec: both use
this module, so a slice or a mesh that one side accepts the other never rejects, with the same message.
"""

from __future__ import annotations

from collections.abc import Mapping

# The mesh axes, in the order of the mesh's shape (tensor varies fastest over the slice).
AXES: tuple[str, ...] = ("data", "cfg", "context", "tensor")
# cfg holds the conditional and unconditional halves of a guided batch: nothing else fits on it.
CFG_SIZES: tuple[int, ...] = (1, 2)


class LayoutError(ValueError):
    """A device slice or mesh layout that cannot serve the model or request it was asked to."""


def parse_device_slice(spec: str | int | list | tuple) -> list[int]:
    """Device indices from a pool's `devices`: "0-3", "4,5,6,7", "0-1,4-5", 3, or a list of ints.

    Indices are positions in jax.devices(). Empty, reversed ranges and repeats are errors: a typo must not
    quietly hand two pools the same device (or drop one: "0,3-1" is not [0]).
    """
    if isinstance(spec, bool):
        raise LayoutError(f"device slice {spec!r} is not a slice")
    if isinstance(spec, int):
        indices = [spec]
    elif isinstance(spec, list | tuple):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in spec):
            raise LayoutError(f"device slice {spec!r} must list integers")
        indices = list(spec)
    elif isinstance(spec, str):
        indices = []
        for part in spec.replace(" ", "").split(","):
            lo, dash, hi = part.partition("-")
            if not lo.isdigit() or (dash and not hi.isdigit()):
                raise LayoutError(f"device slice {spec!r}: {part!r} is not N or N-M")
            first, last = int(lo), int(hi) if dash else int(lo)
            if last < first:
                raise LayoutError(f"device slice {spec!r}: range {part!r} runs backwards")
            indices.extend(range(first, last + 1))
    else:
        raise LayoutError(f"device slice {spec!r} must be a string like '0-3' or '4,5,6,7', or a list")
    if not indices:
        raise LayoutError(f"device slice {spec!r} is empty")
    if any(i < 0 for i in indices):
        raise LayoutError(f"device slice {spec!r} has a negative index")
    if len(set(indices)) != len(indices):
        raise LayoutError(f"device slice {spec!r} names a device twice")
    return indices


def check_mesh_sizes(sizes: Mapping[str, object]) -> None:
    """Raise LayoutError unless `sizes` (axis -> size, missing axes are 1) names only mesh axes, each a positive
    integer, with cfg in CFG_SIZES."""
    unknown = sorted(set(sizes) - set(AXES))
    if unknown:
        raise LayoutError(f"unknown mesh axes {unknown}; the axes are {list(AXES)}")
    for axis, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise LayoutError(f"mesh size {axis}={size!r} must be a positive integer")
    cfg = sizes.get("cfg", 1)
    if cfg not in CFG_SIZES:
        raise LayoutError(f"cfg must be 1 or 2 (the conditional and unconditional halves), got {cfg}")


def validate_weight_sharding(weights: Mapping | None, sizes: Mapping[str, int] | object) -> tuple[str, ...]:
    """The mesh axes a pool's `weights: {shard_over: [...]}` stores the weights split over (FSDP / ZeRO-3).

    Allowed: data, cfg, context, each of size > 1 in this mesh (`sizes`: a mapping axis -> size, missing axes
    1, or an object with one attribute per axis, as both MeshSizes classes are), each once. Returned in mesh order, so equal settings hash (and compile) alike.
    The weights are stored split and XLA gathers each where it is used, so every device still computes with
    whole weights (the single-device result). cfg is allowed: like data it carries batch rows (the two CFG
    halves), so its devices use the same weights at the same time, as ZeRO-3 needs. tensor is not: it already
    splits heads and MLP units, and one mesh axis can split only one dimension of a weight.
    Here, not in mesh.py, so a pool config is checked with it before JAX loads (workers/config.py).
    """
    if weights is None:
        return ()
    if not isinstance(weights, Mapping):
        raise LayoutError(f"weights must be a mapping like {{shard_over: [data, context]}}, got {weights!r}")
    unknown = sorted(set(weights) - {"shard_over"})
    if unknown:
        raise LayoutError(f"unknown weights settings {unknown}; the only one is 'shard_over'")
    shard_over = weights.get("shard_over") or ()
    if isinstance(shard_over, str) or not isinstance(shard_over, list | tuple):
        raise LayoutError(f"weights.shard_over must be a list of mesh axes, got {shard_over!r}")
    sizes = dict(sizes) if isinstance(sizes, Mapping) else {axis: getattr(sizes, axis) for axis in AXES}
    for axis in shard_over:
        if axis not in AXES:
            raise LayoutError(f"weights.shard_over: unknown mesh axis {axis!r}; the axes are {list(AXES)}")
        if axis == "tensor":
            raise LayoutError(
                "weights.shard_over cannot name 'tensor': tensor already splits attention heads and MLP units, "
                "and one mesh axis can split only one dimension of a weight; use data, cfg or context"
            )
        if sizes.get(axis, 1) == 1:
            raise LayoutError(
                f"weights.shard_over names {axis!r}, but the mesh has {axis}=1, so nothing would be split; "
                f"give the mesh {axis} > 1 or leave {axis!r} out"
            )
    if len(set(shard_over)) != len(shard_over):
        raise LayoutError(f"weights.shard_over names an axis twice: {list(shard_over)}")
    return tuple(a for a in AXES if a in shard_over)

"""The pool mesh: a device slice arranged as Mesh(devices, ("data", "cfg", "context", "tensor")).

- data: independent requests of one batch (every pool is also a consumer of the model's stream, which is the
  data parallelism across pools; this axis is the one inside a pool).
- cfg: the conditional and unconditional halves of a classifier-free-guidance batch (size 1 or 2).
- context: the token sequence, for context-parallel attention (models.attention.context).
- tensor: attention heads and MLP hidden units.

Everything here is checked before anything compiles, with messages that name the offending sizes, so a wrong
pool config fails at start-up rather than as a shape error deep inside a trace.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import jax
import numpy as np
from jax.sharding import Mesh

# The axis list, the error type and the slice parser live in a JAX-free module: pools.yaml is checked with them
# before JAX loads. Re-exported here, where the mesh is built.
from meshserve.models.parallel.layout_spec import (
    AXES,
    LayoutError,
    parse_device_slice,
    validate_weight_sharding,  # noqa: F401 - re-exported
)


@dataclass(frozen=True)
class MeshSizes:
    data: int = 1
    cfg: int = 1
    context: int = 1
    tensor: int = 1

    def __post_init__(self):
        for axis, size in asdict(self).items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise LayoutError(f"mesh size {axis}={size!r} must be a positive integer")

    @classmethod
    def from_dict(cls, sizes: dict | None) -> MeshSizes:
        """From a pool config's `mesh: {cfg: 2, context: 2}`; missing axes are 1, unknown ones an error."""
        sizes = dict(sizes or {})
        unknown = sorted(set(sizes) - set(AXES))
        if unknown:
            raise LayoutError(f"unknown mesh axes {unknown}; the axes are {list(AXES)}")
        return cls(**sizes)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.data, self.cfg, self.context, self.tensor)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)


def validate_layout(
    sizes: MeshSizes,
    *,
    num_devices: int | None = None,
    heads: int | None = None,
    ulysses_degree: int | None = None,
) -> None:
    """Raise LayoutError, naming the sizes, when `sizes` can't run.

    num_devices: the devices of the slice (None: not checked); the sizes must use exactly these.
    heads: attention heads of the model (every attention layer's count, if they differ call once per count).
    ulysses_degree: devices of the context axis that exchange heads by all_to_all (context size for "ulysses",
        the sub-group for "hybrid").
    """
    if num_devices is not None and sizes.num_devices != num_devices:
        raise LayoutError(
            f"mesh data={sizes.data} x cfg={sizes.cfg} x context={sizes.context} x tensor={sizes.tensor} "
            f"= {sizes.num_devices} devices, but the slice has {num_devices}"
        )
    if sizes.cfg not in (1, 2):
        raise LayoutError(f"cfg must be 1 or 2 (the conditional and unconditional halves), got {sizes.cfg}")
    if heads is not None and heads % sizes.tensor:
        raise LayoutError(f"{heads} attention heads do not split over tensor={sizes.tensor}")
    if ulysses_degree is not None:
        if sizes.context % ulysses_degree:
            raise LayoutError(f"Ulysses degree {ulysses_degree} does not divide context={sizes.context}")
        if heads is not None and (heads // sizes.tensor) % ulysses_degree:
            raise LayoutError(
                f"Ulysses needs the heads per tensor shard ({heads} / tensor={sizes.tensor} = "
                f"{heads // sizes.tensor}) divisible by its degree {ulysses_degree}; use ring or hybrid"
            )


def select_devices(spec, devices=None) -> list:
    """The devices a slice spec names, out of `devices` (default jax.devices())."""
    devices = list(jax.devices() if devices is None else devices)
    indices = parse_device_slice(spec)
    missing = [i for i in indices if i >= len(devices)]
    if missing:
        raise LayoutError(f"device slice {spec!r} names {missing}, but only {len(devices)} devices exist")
    return [devices[i] for i in indices]


def make_mesh(sizes: MeshSizes, devices=None) -> Mesh:
    """Mesh(devices, AXES) of shape sizes.shape; devices default to all of jax.devices().

    Devices are laid out in the order given (tensor fastest, then context, cfg, data), so the axes that talk
    most (tensor, context) connect neighbouring devices of the slice.
    """
    devices = list(jax.devices() if devices is None else devices)
    validate_layout(sizes, num_devices=len(devices))
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes.shape), AXES)

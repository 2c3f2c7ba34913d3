"""Pool meshes and layout validation (models.parallel.mesh); context-parallel attention: models.attention.

The mesh names load on first use (PEP 562), so `models.parallel.layout_spec` (the JAX-free slice and mesh-size
rules) imports without JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = [
    "AXES",
    "LayoutError",
    "MeshSizes",
    "make_mesh",
    "parse_device_slice",
    "select_devices",
    "validate_layout",
    "validate_weight_sharding",
]

if TYPE_CHECKING:
    from meshserve.models.parallel.mesh import (
        AXES,
        LayoutError,
        MeshSizes,
        make_mesh,
        parse_device_slice,
        select_devices,
        validate_layout,
        validate_weight_sharding,
    )


def __getattr__(name: str):
    if name in __all__:
        value = getattr(importlib.import_module("meshserve.models.parallel.mesh"), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

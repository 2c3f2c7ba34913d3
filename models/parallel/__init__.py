"""Pool meshes and layout validation (models.parallel.mesh); context-parallel attention: models.attention."""

from meshserve.models.parallel.mesh import (
    AXES,
    LayoutError,
    MeshSizes,
    fold_cfg_into_data,
    make_mesh,
    parse_device_slice,
    select_devices,
    validate_layout,
)

__all__ = [
    "AXES",
    "LayoutError",
    "MeshSizes",
    "fold_cfg_into_data",
    "make_mesh",
    "parse_device_slice",
    "select_devices",
    "validate_layout",
]

"""Pool meshes: sizes, validation messages, device-slice parsing, two pools side by side on 8 CPU devices."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from meshserve.models.parallel.mesh import (
    AXES,
    LayoutError,
    MeshSizes,
    make_mesh,
    parse_device_slice,
    select_devices,
    validate_layout,
)


def test_make_mesh_axes_shape_and_device_order():
    mesh = make_mesh(MeshSizes(data=2, cfg=2, context=1, tensor=2))
    assert mesh.axis_names == AXES == ("data", "cfg", "context", "tensor")
    assert dict(mesh.shape) == {"data": 2, "cfg": 2, "context": 1, "tensor": 2}
    # Tensor is the fastest axis: neighbouring devices of the slice share a tensor group.
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert ids.ravel().tolist() == [d.id for d in jax.devices()]
    assert ids[0, 0, 0].tolist() == [jax.devices()[0].id, jax.devices()[1].id]


def test_two_pools_on_disjoint_slices():
    first = make_mesh(MeshSizes(cfg=2, context=2), select_devices("0-3"))
    second = make_mesh(MeshSizes(data=2, tensor=2), select_devices("4,5,6,7"))
    first_ids = {d.id for d in first.devices.flat}
    second_ids = {d.id for d in second.devices.flat}
    assert len(first_ids) == len(second_ids) == 4 and not first_ids & second_ids


def test_mesh_sizes_from_config():
    assert MeshSizes.from_dict({"cfg": 2, "context": 2}) == MeshSizes(1, 2, 2, 1)
    assert MeshSizes.from_dict(None).num_devices == 1
    with pytest.raises(LayoutError, match=r"unknown mesh axes \['sequence'\]"):
        MeshSizes.from_dict({"sequence": 2})
    with pytest.raises(LayoutError, match="positive integer"):
        MeshSizes(context=0)
    with pytest.raises(LayoutError, match="positive integer"):
        MeshSizes(tensor=1.5)


@pytest.mark.parametrize(
    "sizes,kwargs,message",
    [
        (MeshSizes(cfg=2, context=2), dict(num_devices=8), r"= 4 devices, but the slice has 8"),
        (MeshSizes(cfg=4, data=2), dict(num_devices=8), r"cfg must be 1 or 2"),
        (
            MeshSizes(tensor=4, data=2),
            dict(num_devices=8, heads=10),
            r"10 attention heads do not split over tensor=4",
        ),
        (
            MeshSizes(context=8),
            dict(num_devices=8, heads=4, ulysses_degree=8),
            r"heads per tensor shard .* = 4\)",
        ),
        (
            MeshSizes(context=4, tensor=2),
            dict(num_devices=8, heads=4, ulysses_degree=4),
            r"= 2\) divisible by its degree 4",
        ),
        (MeshSizes(context=8), dict(num_devices=8, ulysses_degree=3), r"Ulysses degree 3 does not divide"),
    ],
)
def test_validate_layout_names_the_problem(sizes, kwargs, message):
    with pytest.raises(LayoutError, match=message):
        validate_layout(sizes, **kwargs)


def test_validate_layout_accepts_good_layouts():
    validate_layout(MeshSizes(cfg=2, context=2, tensor=2), num_devices=8, heads=8, ulysses_degree=2)
    validate_layout(MeshSizes(data=2, context=4), num_devices=8, heads=4, ulysses_degree=4)
    validate_layout(MeshSizes(cfg=2, context=4), heads=6)  # the device count is checked only when given


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("0-3", [0, 1, 2, 3]),
        ("4,5,6,7", [4, 5, 6, 7]),
        ("0-1, 4-5", [0, 1, 4, 5]),
        ("6", [6]),
        (2, [2]),
        ([3, 1], [3, 1]),
    ],
)
def test_parse_device_slice(spec, expected):
    assert parse_device_slice(spec) == expected


@pytest.mark.parametrize(
    "spec,message",
    [
        ("3-1", "runs backwards"),
        ("0-3,2", "twice"),
        ("a-b", "not N or N-M"),
        ("", "not N or N-M"),
        ("1-", "not N or N-M"),
        ([], "empty"),
        ([0, True], "integers"),
        (-1, "negative"),
        (1.0, "must be a string"),
    ],
)
def test_parse_device_slice_rejects(spec, message):
    with pytest.raises(LayoutError, match=message):
        parse_device_slice(spec)


def test_select_devices_out_of_range():
    assert [d.id for d in select_devices("6-7")] == [jax.devices()[6].id, jax.devices()[7].id]
    with pytest.raises(LayoutError, match=r"names \[8, 9\], but only 8 devices exist"):
        select_devices("6-9")

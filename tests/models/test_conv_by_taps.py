"""A stride-1 conv to few output channels as one matmul + shifted sum (models/cpu/conv_by_taps.py), against
torch's Conv2d / Conv3d on the same weights, and the rule that picks it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from meshserve.models.components.layers import conv2d
from meshserve.models.cpu.conv_by_taps import conv_by_taps, prefers_taps

# fp32 sums of up to 9 x 320 products, in another order than torch's: 1.1e-6 measured, the library conv alike.
TOLERANCE = 5e-6


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def test_the_rule_takes_few_outputs_and_leaves_wide_convs_to_the_library():
    assert jax.default_backend() == "cpu"
    assert prefers_taps((3, 3, 32, 3))  # a VAE's conv_out: 27 partial products per pixel <= 32 inputs
    assert prefers_taps((3, 3, 320, 4))  # SDXL's UNet conv_out
    assert prefers_taps((3, 3, 3, 96, 3))  # Wan's causal conv_out: 81 <= 96
    assert not prefers_taps((3, 3, 32, 8))  # 72 > 32: measured 3.6x slower this way
    assert not prefers_taps((3, 3, 64, 64))
    assert not prefers_taps((1, 1, 64, 3))  # one tap: already a matmul


@pytest.mark.parametrize(
    "cin, cout, kernel, padding, hw",
    [
        (32, 3, 3, 1, (9, 11)),  # the VAE decoder's conv_out
        (320, 4, 3, 1, (6, 5)),  # the UNet's conv_out
        (40, 4, 3, ((0, 2), (1, 0)), (7, 6)),  # uneven padding: each tap's window and the output size
        (50, 2, 5, 2, (8, 9)),  # a 5x5 window
    ],
)
def test_conv2d_with_few_outputs_matches_torch(cin, cout, kernel, padding, hw):
    conv = conv2d(cin, cout, kernel, padding=padding, rngs=nnx.Rngs(0))
    assert prefers_taps(conv.kernel.shape), "this case must exercise the matmul + shifted-sum path"
    x = np.random.default_rng(0).standard_normal((2, *hw, cin)).astype(np.float32)
    pads = ((padding, padding),) * 2 if isinstance(padding, int) else padding
    ref = torch.nn.functional.conv2d(
        torch.nn.functional.pad(
            torch.from_numpy(x.transpose(0, 3, 1, 2)), (*pads[1], *pads[0])
        ),  # F.pad: last axis first
        torch.from_numpy(np.asarray(conv.kernel[...]).transpose(3, 2, 0, 1)),
        torch.from_numpy(np.asarray(conv.bias[...])),
    ).numpy()
    out = conv(jnp.asarray(x))
    assert rel_err(np.asarray(out).transpose(0, 3, 1, 2), ref) <= TOLERANCE
    # The library's conv on the same module, for the bf16 comparison below to mean something.
    assert rel_err(out, nnx.Conv.__call__(conv, jnp.asarray(x))) <= TOLERANCE


def test_bf16_rounds_like_the_library_conv():
    """Products summed in fp32, one rounding at the end: as close to the fp32 conv as XLA's own bf16 conv."""
    conv = conv2d(32, 3, 3, padding=1, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 9, 11, 32)).astype(jnp.bfloat16)
    exact = jax.lax.conv_general_dilated(
        x.astype(jnp.float32),
        conv.kernel[...].astype(jnp.float32),
        (1, 1),
        ((1, 1), (1, 1)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    ) + conv.bias[...].astype(jnp.float32)
    out, library = conv(x), nnx.Conv.__call__(conv, x)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, exact) <= max(rel_err(library, exact), 4e-3)


def test_conv3d_matches_torch():
    """Wan's causal conv_out shape (3x3x3 to RGB, no temporal padding: the cache supplies those frames)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 5, 6, 7, 96)).astype(np.float32)
    w = (rng.standard_normal((3, 3, 3, 96, 3)) * 0.05).astype(np.float32)
    assert prefers_taps(w.shape)
    ref = torch.nn.functional.conv3d(
        torch.from_numpy(x.transpose(0, 4, 1, 2, 3)),
        torch.from_numpy(w.transpose(4, 3, 0, 1, 2)),
        padding=(0, 1, 1),
    ).numpy()
    out = conv_by_taps(jnp.asarray(x), jnp.asarray(w), ((0, 0), (1, 1), (1, 1)))
    assert rel_err(np.asarray(out).transpose(0, 4, 1, 2, 3), ref) <= TOLERANCE


def test_a_map_split_over_devices_gives_the_one_device_result():
    """Under context parallelism the UNet's conv_out sees rows split over devices: the shifted sum then needs
    the neighbours' border rows, which XLA's partitioner must bring in."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    conv = conv2d(64, 4, 3, padding=1, rngs=nnx.Rngs(0))
    assert prefers_taps(conv.kernel.shape)
    x = jax.random.normal(jax.random.key(2), (2, 16, 12, 64))
    one_device = conv(x)
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "context"))
    split = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data", "context")))
    graph, state = nnx.split(conv)
    out = jax.jit(lambda state, x: nnx.merge(graph, state)(x))(state, split)
    assert rel_err(out, one_device) <= TOLERANCE

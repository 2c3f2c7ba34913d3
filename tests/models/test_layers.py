"""Shared layers against their diffusers counterparts (PyTorch, NCHW) on the same weights."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from meshserve.models.components.layers import Upsample2D


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("hw", [(8, 8), (5, 7)])
@pytest.mark.parametrize("subpixel", [False, True])
def test_upsample2d_matches_diffusers(hw, subpixel):
    """Nearest 2x + 3x3 conv, plain and as four 2x2 phase convs on the low-res map (sub-pixel): the fold
    of the taps differs per output row/column parity and at the borders, hence an odd, non-square map."""
    from diffusers.models.upsampling import Upsample2D as TorchUpsample2D

    torch.manual_seed(0)
    ref = TorchUpsample2D(6, use_conv=True, out_channels=5).eval()
    ours = Upsample2D(6, 5, subpixel=subpixel, rngs=nnx.Rngs(0))
    ours.conv.kernel[...] = jnp.asarray(ref.conv.weight.detach().numpy().transpose(2, 3, 1, 0))  # OIHW->HWIO
    ours.conv.bias[...] = jnp.asarray(ref.conv.bias.detach().numpy())
    x = np.random.default_rng(0).standard_normal((2, 6, *hw)).astype(np.float32)
    with torch.no_grad():
        expected = ref(torch.from_numpy(x)).numpy()
    out = ours(jnp.asarray(x.transpose(0, 2, 3, 1)))
    assert out.shape == (2, 2 * hw[0], 2 * hw[1], 5)
    assert rel_err(np.asarray(out).transpose(0, 3, 1, 2), expected) <= 1e-6


def test_subpixel_upsample_keeps_an_explicit_output_size():
    """A size other than 2x (odd latent sizes in the UNet) takes the plain path: torch's index rounding."""
    ours = Upsample2D(4, subpixel=True, rngs=nnx.Rngs(0))
    plain = Upsample2D(4, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 5, 5, 4)).astype(np.float32))
    np.testing.assert_array_equal(ours(x, output_size=(9, 9)), plain(x, output_size=(9, 9)))


@pytest.mark.parametrize(
    "kernel,stride,padding,dilation",
    [
        (3, 1, 1, 1),
        (3, 2, 1, 1),
        (1, 1, 0, 1),
        (3, 1, "SAME", 1),
        (3, 2, "VALID", 1),
        (3, 1, 2, 2),
        (2, 2, 0, 1),
    ],
)
def test_conv_patches_times_the_flattened_kernel_is_the_conv(kernel, stride, padding, dilation):
    """Conv.patches (LoCon's A, models/lora/apply.py): the kh x kw windows in the kernel's HWI order, so a matmul
    with the kernel flattened to [kh kw in, out] equals the layer's own conv, for its strides, padding and
    dilation."""
    from meshserve.models.components.layers import Conv

    pad = ((padding, padding),) * 2 if isinstance(padding, int) else padding
    conv = Conv(
        3, 5, (kernel, kernel), strides=stride, padding=pad, kernel_dilation=dilation, rngs=nnx.Rngs(0)
    )
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 9, 7, 3)), jnp.float32)
    expected = conv(x) - conv.bias[...]
    patches = conv.patches(x, kernel, kernel)
    got = patches @ conv.kernel[...].reshape(-1, 5)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)

"""A stride-1 convolution to few output channels, run as one matmul and a shifted sum.

XLA:CPU's convolution kernels (Eigen's, see models/cpu/xla_cpu_flags.py) vectorise over output channels, so a
conv to 3 or 4 channels (a VAE's `conv_out` to RGB, a UNet's `conv_out` to latents) runs far below the
machine's rate. Here the same multiply-adds are done as

    partial = x @ W               W: the kernel laid out [Cin, taps * Cout]; one matmul over the whole map
    out[p]  = sum over taps t of partial_padded[p + t, t]      one fused element-wise pass

summed in another order than the conv's (<= 1e-6 relative, measured against XLA's conv and torch's). Measured on a 2-core AMD
EPYC without AVX-512 on 2026-11-23, quiet (fp32, batch 1, XLA flags of models/cpu/xla_cpu_flags.py; direct conv
-> this, medians of 21 calls, three alternating repeats):

    256x256, 32 -> 3 (the bench VAE's conv_out)           4.7-4.8 -> 2.2-2.8 ms
    256x256, 128 -> 3 (SDXL's VAE conv_out, at 256 px)    16.1-16.2 -> 7.0-7.4 ms
    128x128, 320 -> 4 (SDXL's UNet conv_out at 1024 px)   13.6-17.6 -> 3.4-3.7 ms
    64x64, 512 -> 16                                      5.4-5.6 -> 4.0-4.5 ms
    256x256, 32 -> 8                                      3.8-4.3 -> 18.3-29.7 ms (a loss)
    128x128, 64 -> 16 and 128 -> 16                       equal within the spread

It pays when the partial products (taps x Cout values per pixel) are no more than the input's Cin values per
pixel, and that is the rule `prefers_taps` applies. It was measured on the CPU only, so it is used on the CPU
backend only; GPU and TPU keep their libraries' convolutions.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp


def prefers_taps(kernel_shape: Sequence[int]) -> bool:
    """Whether a stride-1 conv with this kernel ([*spatial, Cin, Cout]) runs faster as `conv_by_taps` here."""
    *spatial, cin, cout = kernel_shape
    taps = math.prod(spatial)
    return jax.default_backend() == "cpu" and taps > 1 and taps * cout <= cin


def conv_by_taps(x, kernel, padding: Sequence[tuple[int, int]]):
    """Stride-1, undilated convolution: x [B, *spatial, Cin], kernel [*window, Cin, Cout] (channels last, as
    lax.conv_general_dilated with NHWC / HWIO numbers), `padding` one (low, high) pair per spatial axis.
    Products are summed in float32 and the result is cast to the inputs' common dtype."""
    *window, cin, cout = kernel.shape
    dtype = jnp.result_type(x, kernel)
    # [Cin, tap 0 Couts, tap 1 Couts, ...], taps in row-major order of the window.
    weights = jnp.moveaxis(kernel.reshape(-1, cin, cout), 1, 0).reshape(cin, -1).astype(dtype)
    partial = jnp.einsum("...c,ck->...k", x.astype(dtype), weights, preferred_element_type=jnp.float32)
    partial = partial.reshape(*partial.shape[:-1], math.prod(window), cout)
    partial = jnp.pad(partial, ((0, 0), *padding, (0, 0), (0, 0)))
    out_shape = [p - k + 1 for p, k in zip(partial.shape[1:-2], window, strict=True)]
    out = None
    for tap, offsets in enumerate(itertools.product(*(range(k) for k in window))):
        window_slice = tuple(slice(o, o + n) for o, n in zip(offsets, out_shape, strict=True))
        term = partial[(slice(None), *window_slice, tap)]
        out = term if out is None else out + term
    return out.astype(dtype)

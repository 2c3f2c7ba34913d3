"""Layers shared by the UNet and the VAE: norms, activations, resnet blocks, resampling, timestep embeddings.

Every class mirrors the diffusers module of the same name (attribute names included, so checkpoint keys map
by the generic rules of `meshserve.models.checkpoints.loading`), with activations in NHWC: `[B, H, W, C]`.

Precision: group and layer norms compute their statistics in fp32 whatever the parameter dtype (two-pass
variance, as torch does) and hand back the input's dtype; a bf16 mean/variance over a 128x128x320 map loses
most of its mantissa. Convolutions and matmuls run in the module's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from meshserve.models.components.quantize import ACTIVATIONS, TRANSPOSED, quantized_matmul
from meshserve.models.cpu.conv_by_taps import conv_by_taps, prefers_taps
from meshserve.models.lora.apply import adapted, adapted_conv
from meshserve.models.parallel.small_maps import replicate_small_map

# --------------------------------------------------------------------------------------------------
# Activations and norms


def _mish(x):
    return x * jnp.tanh(jax.nn.softplus(x))


# diffusers' ACT2CLS (models/activations.py); torch's GELU default is the exact (erf) one.
_ACTIVATIONS: dict[str, Callable] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "mish": _mish,
    "relu": jax.nn.relu,
}


def get_activation(name: str) -> Callable:
    try:
        return _ACTIVATIONS[name.lower()]
    except KeyError:
        raise ValueError(
            f"unsupported activation {name!r}; known: {', '.join(sorted(_ACTIVATIONS))}"
        ) from None


class GroupNorm(nnx.Module):
    """torch.nn.GroupNorm over the channel (last) axis: fp32 statistics, output in the input's dtype.

    Statistics are summed per channel over the pixels first and only then per group: reducing [B, HW, C]
    over HW runs along memory, where reducing [B, HW, G, C/G] over (HW, C/G) at once (flax's GroupNorm) was
    3x slower on XLA:CPU (GroupNorm + SiLU on [1, 256, 256, 32]: 2.4 -> 0.8 ms; 30 of them are ~50 ms of a
    256x256 VAE decode). The variance is two-pass, as torch's is exact; the normalisation is one
    multiply-add per element with per-channel coefficients.
    """

    def __init__(self, num_channels: int, num_groups: int, eps: float, *, dtype=jnp.float32, rngs: nnx.Rngs):
        if num_channels % num_groups:
            raise ValueError(f"{num_channels} channels do not split into {num_groups} groups")
        self.num_groups, self.eps = num_groups, eps
        self.scale = nnx.Param(jnp.ones((num_channels,), dtype))
        self.bias = nnx.Param(jnp.zeros((num_channels,), dtype))

    def __call__(self, x):
        b, c = x.shape[0], x.shape[-1]
        groups = self.num_groups
        xf = x.astype(jnp.float32).reshape(b, -1, c)
        count = xf.shape[1] * (c // groups)

        def group_mean(per_channel_sum):  # [B, C] -> [B, 1, C]: each channel's group mean
            means = per_channel_sum.reshape(b, groups, c // groups).sum(-1, keepdims=True) / count
            return jnp.broadcast_to(means, (b, groups, c // groups)).reshape(b, 1, c)

        mean = group_mean(jnp.sum(xf, axis=1))
        var = group_mean(jnp.sum(jnp.square(xf - mean), axis=1))
        scale = self.scale[...].astype(jnp.float32) * lax.rsqrt(var + self.eps)
        shift = self.bias[...].astype(jnp.float32) - mean * scale
        return (xf * scale + shift).reshape(x.shape).astype(x.dtype)


class LayerNorm(nnx.LayerNorm):
    """torch.nn.LayerNorm over the last axis: fp32 statistics, output in the input's dtype."""

    def __init__(
        self,
        num_features: int,
        eps: float,
        *,
        elementwise_affine: bool = True,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        super().__init__(
            num_features,
            epsilon=eps,
            dtype=jnp.float32,
            param_dtype=dtype,
            use_fast_variance=False,
            use_bias=elementwise_affine,
            use_scale=elementwise_affine,
            rngs=rngs,
        )

    def __call__(self, x):
        return super().__call__(x).astype(x.dtype)


class Conv(nnx.Conv):
    """nnx.Conv (same parameters and keys) that runs a stride-1 conv to few output channels as
    `conv_by_taps` where that is faster (models/cpu/conv_by_taps.py: a VAE's or UNet's conv_out, 2-4x on the CPU).

    `spatial_mesh`: the pool's mesh when it has a context axis (set by the pipeline: `place_small_maps`); a map
    too small to split over it stays whole across it (models/parallel/small_maps.py says why)."""

    spatial_mesh = None

    def __call__(self, inputs):
        inputs = replicate_small_map(inputs, self.spatial_mesh)
        y = self._conv(inputs)
        if y.ndim == 4:  # a 2-D conv: LoCon adapters (models/lora/apply.py) when the pool's table holds it
            y = adapted_conv(self, inputs, y)
        return replicate_small_map(y, self.spatial_mesh)

    def _conv(self, inputs):
        kernel = self.kernel[...]
        padding = _pairs(self.padding, kernel.ndim - 2)
        if (
            padding is not None
            and inputs.ndim == kernel.ndim
            and all(s == 1 for s in _spatial(self.strides, kernel.ndim - 2))
            and all(d == 1 for d in _spatial(self.kernel_dilation, kernel.ndim - 2))
            and all(d == 1 for d in _spatial(self.input_dilation, kernel.ndim - 2))
            and self.feature_group_count == 1
            and self.mask is None
            and prefers_taps(kernel.shape)
        ):
            bias = self.bias[...] if self.bias is not None else None
            inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
            y = conv_by_taps(inputs, kernel, padding)
            return y + bias if bias is not None else y
        return super().__call__(inputs)

    def patches(self, inputs, kh: int, kw: int):
        """2-D `inputs` [B, H, W, in] -> [B, H', W', kh kw in]: at every output position of this layer (its
        strides, padding and dilation), the kh x kw window's inputs in the kernel's HWI order, so that a
        matmul with a kernel flattened to [kh kw in, out] is the conv (a LoCon adapter's A:
        models/lora/apply.py). Strided slices of the padded input."""
        strides, dilation = _spatial(self.strides, 2), _spatial(self.kernel_dilation, 2)
        size = inputs.shape[1:3]
        pads = _pairs(self.padding, 2) or lax.padtype_to_pads(
            size, [(k - 1) * d + 1 for k, d in zip((kh, kw), dilation, strict=True)], strides, self.padding
        )
        x = jnp.pad(inputs, ((0, 0), *pads, (0, 0)))
        out = [
            (n + lo + hi - (k - 1) * d - 1) // s + 1
            for n, (lo, hi), k, d, s in zip(size, pads, (kh, kw), dilation, strides, strict=True)
        ]
        taps = [
            x[
                :,
                i * dilation[0] : i * dilation[0] + (out[0] - 1) * strides[0] + 1 : strides[0],
                j * dilation[1] : j * dilation[1] + (out[1] - 1) * strides[1] + 1 : strides[1],
            ]
            for i in range(kh)
            for j in range(kw)
        ]
        return jnp.concatenate(taps, axis=-1)


def place_small_maps(module: nnx.Module, mesh) -> None:
    """Gives every `Conv` of `module` the pool's mesh (`Conv.spatial_mesh`) when it has a context axis."""
    if mesh is None or dict(mesh.shape).get("context", 1) <= 1:
        return
    for _, sub in nnx.iter_graph(module):
        if isinstance(sub, Conv):
            sub.spatial_mesh = mesh


def _pairs(padding, n: int) -> tuple[tuple[int, int], ...] | None:
    """nnx.Conv's padding as n explicit (low, high) pairs, or None for a string ("SAME", "CAUSAL", ...)."""
    if isinstance(padding, str):
        return None
    if isinstance(padding, int):
        return ((padding, padding),) * n
    pairs = tuple((p, p) if isinstance(p, int) else tuple(p) for p in padding)
    return pairs if len(pairs) == n and all(len(p) == 2 for p in pairs) else None


def _spatial(value, n: int) -> tuple[int, ...]:
    """nnx.Conv's strides / dilations (None, an int or a sequence) as one int per spatial axis."""
    if value is None:
        return (1,) * n
    return (value,) * n if isinstance(value, int) else tuple(value)


def conv2d(
    in_channels: int,
    out_channels: int,
    kernel_size: int,
    *,
    stride: int = 1,
    padding: int | Sequence[tuple[int, int]] = 0,
    use_bias: bool = True,
    dtype=jnp.float32,
    rngs: nnx.Rngs,
) -> Conv:
    """torch.nn.Conv2d on NHWC input: `padding` an int pads both sides of H and W, like torch."""
    if isinstance(padding, int):
        padding = ((padding, padding), (padding, padding))
    return Conv(
        in_channels,
        out_channels,
        (kernel_size, kernel_size),
        strides=stride,
        padding=padding,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=dtype,
        rngs=rngs,
    )


class Linear(nnx.Linear):
    """nnx.Linear (same parameters and keys) that adds its LoRA adapters while a program with adapters is
    traced (models/lora/apply.py); otherwise exactly nnx.Linear. Loaded with `quantize="int8"` or "fp8" it
    holds an int8 or e4m3 kernel and a per-output-channel `kernel_scale` (models/components/quantize.py), and
    with fp8 activations a static `quantize_activations` and the e4m3 kernel as `kernel_t` [out, in] instead
    of `kernel`; its matmul dequantizes; the adapters add to that output the same way. `kernel_shape` is the
    kernel's [in, out] shape (a stacked block's with the blocks' axis in front) however it is stored."""

    @property
    def kernel_shape(self) -> tuple[int, ...]:
        if hasattr(self, TRANSPOSED):
            *blocks, out, n_in = getattr(self, TRANSPOSED).shape
            return (*blocks, n_in, out)
        return tuple(self.kernel.shape)

    def __call__(self, inputs):
        if hasattr(self, "kernel_scale"):
            bias = self.bias[...] if self.bias is not None else None
            stored_out_in = hasattr(self, TRANSPOSED)
            y = quantized_matmul(
                inputs,
                getattr(self, TRANSPOSED if stored_out_in else "kernel")[...],
                self.kernel_scale[...],
                bias,
                self.dtype,
                activations=getattr(self, ACTIVATIONS, None),
                kernel_in_axis=1 if stored_out_in else 0,
            )
        else:
            y = super().__call__(inputs)
        return adapted(self, inputs, y)


def linear(
    in_features: int, out_features: int, *, use_bias: bool = True, dtype=jnp.float32, rngs: nnx.Rngs
) -> nnx.Linear:
    return Linear(in_features, out_features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


# --------------------------------------------------------------------------------------------------
# Resampling


def upsample_nearest(x, size: tuple[int, int] | None = None):
    """F.interpolate(mode="nearest") on [B, H, W, C]: 2x by default, else to `size` (static).

    For an explicit size torch picks source index floor(dst * in / out) with a float32 scale; we do the same
    on the host so odd latent sizes (e.g. 125 -> 63 -> 125) round exactly as diffusers does.
    """
    h, w = x.shape[1], x.shape[2]
    if size is None or tuple(size) == (2 * h, 2 * w):
        return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)

    def index(n_in: int, n_out: int) -> np.ndarray:
        scale = np.float32(n_in) / np.float32(n_out)
        src = np.floor(np.arange(n_out, dtype=np.float32) * scale).astype(np.int64)
        return np.minimum(src, n_in - 1)

    return x[:, index(h, size[0])][:, :, index(w, size[1])]


class Downsample2D(nnx.Module):
    """diffusers' Downsample2D with use_conv=True: a stride-2 3x3 conv.

    padding=0 is the VAE encoder's asymmetric case: pad one row/column at the bottom/right only.
    """

    def __init__(
        self,
        channels: int,
        out_channels: int | None = None,
        *,
        padding: int = 1,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        pad = ((0, 1), (0, 1)) if padding == 0 else padding
        self.conv = conv2d(
            channels, out_channels or channels, 3, stride=2, padding=pad, dtype=dtype, rngs=rngs
        )

    def __call__(self, x):  # [B, H, W, C] -> [B, ceil(H/2), ceil(W/2), C']
        return self.conv(x)


def _fold_taps(kernel, axis: int, phase: int):
    """The two taps one output phase of "nearest 2x, then a 3-tap conv" sees on the low-res input.

    Along one axis, output 2i reads up(x)[2i-1, 2i, 2i+1] = x[i-1, i, i] and output 2i+1 reads
    x[i, i, i+1]: phase 0 is taps (k0, k1 + k2) over x[i-1, i], phase 1 is (k0 + k1, k2) over x[i, i+1].
    """
    k0, k1, k2 = (jnp.take(kernel, i, axis=axis) for i in range(3))
    return jnp.stack((k0, k1 + k2) if phase == 0 else (k0 + k1, k2), axis=axis)


def upsample_nearest2x_conv3x3(x, kernel, bias=None, dtype=None):
    """conv3x3(padding 1)(nearest 2x(x)) computed on the low-res map, as four 2x2 convs (sub-pixel).

    x [B, H, W, Cin], kernel [3, 3, Cin, Cout] (HWIO) -> [B, 2H, 2W, Cout]. The same sums as the conv on
    the upsampled map up to the order of two additions in the folded weights (<= 6e-6 absolute on the
    bench VAE's images), for 16 instead of 36 multiply-adds per low-res pixel and channel pair, and
    without the 4x upsampled copy of the input. The weights are folded in fp32, then cast to `dtype`.
    """
    b, h, w, _ = x.shape
    dtype = dtype or jnp.result_type(x, kernel)
    k = kernel.astype(jnp.float32)
    xp = jnp.pad(x.astype(dtype), ((0, 0), (1, 1), (1, 1), (0, 0)))
    phases = []
    for row in (0, 1):
        k_row = _fold_taps(k, 0, row)
        for col in (0, 1):
            k_phase = _fold_taps(k_row, 1, col).astype(dtype)  # [2, 2, Cin, Cout]
            window = xp[:, row : row + h + 1, col : col + w + 1]
            phases.append(
                lax.conv_general_dilated(
                    window, k_phase, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
                )
            )
    # [B, H, W, (row, col), C] -> [B, H, row, W, col, C] -> [B, 2H, 2W, C]
    y = (
        jnp.stack(phases, 3)
        .reshape(b, h, w, 2, 2, -1)
        .transpose(0, 1, 3, 2, 4, 5)
        .reshape(b, 2 * h, 2 * w, -1)
    )
    return y + bias.astype(dtype) if bias is not None else y


class Upsample2D(nnx.Module):
    """diffusers' Upsample2D with use_conv=True: nearest 2x (or to `output_size`), then a 3x3 conv.

    `subpixel=True` runs the exact 2x case as `upsample_nearest2x_conv3x3` (same weights, same keys). The
    VAE decoder uses it. On the bench VAE (bench/sdxl_vs_diffusers.py, width 64, 2 cores), medians of 40
    and 30 alternating calls in one process: 128x128 81.0 -> 74.2 ms (CPU 80.6 -> 73.9 ms); 256x256 CPU
    340 -> 326 ms, wall 202 -> 204 ms (unchanged within the spread; both cores were busy there already).
    Only for fp32 convs: folded weights rounded to bf16 moved the tiny test VAE's bf16 decode from 2.22e-2
    to 2.67e-2 relative error against diffusers' fp32 (diffusers' own bf16: 1.68e-2). The UNet keeps the
    plain form: its maps can be split over the context axis, where this form's interleave was not measured.
    """

    def __init__(
        self,
        channels: int,
        out_channels: int | None = None,
        *,
        subpixel: bool = False,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.subpixel = subpixel
        self.conv = conv2d(channels, out_channels or channels, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, x, output_size: tuple[int, int] | None = None):  # [B, H, W, C] -> [B, 2H, 2W, C']
        h, w = x.shape[1], x.shape[2]
        exact_2x = output_size is None or tuple(output_size) == (2 * h, 2 * w)
        if self.subpixel and exact_2x and self.conv.kernel.dtype == jnp.float32:
            bias = self.conv.bias[...] if self.conv.bias is not None else None
            mesh = self.conv.spatial_mesh
            y = upsample_nearest2x_conv3x3(
                replicate_small_map(x, mesh), self.conv.kernel[...], bias, self.conv.dtype
            )
            return replicate_small_map(y, mesh)
        return self.conv(upsample_nearest(x, output_size))


# --------------------------------------------------------------------------------------------------
# Resnet block


class ResnetBlock2D(nnx.Module):
    """diffusers' ResnetBlock2D (pre-norm; time_embedding_norm "default" adds, "scale_shift" modulates)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int | None,
        temb_channels: int | None,
        *,
        eps: float,
        groups: int,
        groups_out: int | None = None,
        act_fn: str = "silu",
        output_scale_factor: float = 1.0,
        time_embedding_norm: str = "default",
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if time_embedding_norm not in ("default", "scale_shift"):
            raise ValueError(f"ResnetBlock2D: unsupported time_embedding_norm {time_embedding_norm!r}")
        out_channels = out_channels or in_channels
        self.act_fn = act_fn
        self.output_scale_factor = output_scale_factor
        self.time_embedding_norm = time_embedding_norm
        self.norm1 = GroupNorm(in_channels, groups, eps, dtype=dtype, rngs=rngs)
        self.conv1 = conv2d(in_channels, out_channels, 3, padding=1, dtype=dtype, rngs=rngs)
        # Optional submodules are assigned once (module or None): flax 0.12 fixes an attribute's kind on
        # first assignment.
        proj_out = 2 * out_channels if time_embedding_norm == "scale_shift" else out_channels
        self.time_emb_proj = (
            linear(temb_channels, proj_out, dtype=dtype, rngs=rngs) if temb_channels is not None else None
        )
        self.norm2 = GroupNorm(out_channels, groups_out or groups, eps, dtype=dtype, rngs=rngs)
        self.conv2 = conv2d(out_channels, out_channels, 3, padding=1, dtype=dtype, rngs=rngs)
        self.conv_shortcut = (
            conv2d(in_channels, out_channels, 1, dtype=dtype, rngs=rngs)
            if in_channels != out_channels
            else None
        )

    def __call__(self, x, temb=None):
        """x: [B, H, W, Cin], temb: [B, T] or None -> [B, H, W, Cout]."""
        h = self.time_conditioned(x, temb)
        if self.time_embedding_norm == "default":
            h = self.norm2(h)
        h = self.conv2(get_activation(self.act_fn)(h))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        out = x + h
        return out / self.output_scale_factor if self.output_scale_factor != 1.0 else out

    def time_conditioned(self, x, temb=None):
        """The hidden state where the timestep first enters the block (conv1's output plus the projected
        timestep embedding; with "scale_shift", conv1's output normed and modulated by it), before the second
        half. A UNet's TeaCache signal (models/engine/step_cache.py) is this state of its first resnet."""
        act = get_activation(self.act_fn)
        h = self.conv1(act(self.norm1(x)))
        t = None
        if self.time_emb_proj is not None and temb is not None:
            t = self.time_emb_proj(act(temb))[:, None, None, :]  # [B, 1, 1, C]
        if self.time_embedding_norm == "scale_shift":
            if t is None:
                raise ValueError("ResnetBlock2D with time_embedding_norm='scale_shift' needs temb")
            scale, shift = jnp.split(t, 2, axis=-1)
            return self.norm2(h) * (1 + scale) + shift
        return h + t if t is not None else h


# --------------------------------------------------------------------------------------------------
# Timestep embeddings


def timestep_embedding(
    timesteps,
    dim: int,
    *,
    flip_sin_to_cos: bool,
    downscale_freq_shift: float,
    scale: float = 1.0,
    max_period: int = 10000,
):
    """diffusers' get_timestep_embedding: timesteps [N] (int or float) -> [N, dim] float32 sinusoids."""
    half = dim // 2
    exponent = -math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / (half - downscale_freq_shift)
    emb = timesteps.astype(jnp.float32)[:, None] * jnp.exp(exponent)[None, :]
    emb = scale * emb
    sin, cos = jnp.sin(emb), jnp.cos(emb)
    emb = jnp.concatenate([cos, sin] if flip_sin_to_cos else [sin, cos], axis=-1)
    if dim % 2 == 1:
        emb = jnp.pad(emb, ((0, 0), (0, 1)))
    return emb


def guidance_scale_embedding(w, dim: int):
    """diffusers' get_guidance_scale_embedding (LCM-distilled UNets' `timestep_cond`): w [N] -> [N, dim] float32
    sinusoids of w x 1000, sin first. Computed in diffusers' order (its float32 frequency table, then the
    product): at w x 1000 ~ 7000 one ulp of a frequency moves a sine by ~4e-4."""
    half = dim // 2
    freq = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(jnp.log(jnp.float32(10000.0)) / (half - 1)))
    emb = (jnp.asarray(w, jnp.float32) * 1000.0)[:, None] * freq[None, :]
    emb = jnp.concatenate([jnp.sin(emb), jnp.cos(emb)], axis=-1)
    if dim % 2 == 1:
        emb = jnp.pad(emb, ((0, 0), (0, 1)))
    return emb


class TimestepEmbedding(nnx.Module):
    """diffusers' TimestepEmbedding: (+ cond_proj(condition)) -> linear_1 -> act -> linear_2 (-> post_act).
    `cond_proj_dim`: an extra condition projected onto the input (LCM-distilled UNets' guidance embedding)."""

    def __init__(
        self,
        in_channels: int,
        time_embed_dim: int,
        *,
        act_fn: str = "silu",
        out_dim: int | None = None,
        post_act_fn: str | None = None,
        cond_proj_dim: int | None = None,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.act_fn, self.post_act_fn = act_fn, post_act_fn
        self.cond_proj = (
            None
            if cond_proj_dim is None
            else linear(cond_proj_dim, in_channels, use_bias=False, dtype=dtype, rngs=rngs)
        )
        self.linear_1 = linear(in_channels, time_embed_dim, dtype=dtype, rngs=rngs)
        self.linear_2 = linear(time_embed_dim, out_dim or time_embed_dim, dtype=dtype, rngs=rngs)

    def __call__(self, x, condition=None):  # [B, in_channels] (, [B, cond_proj_dim]) -> [B, time_embed_dim]
        if condition is not None:
            if self.cond_proj is None:
                raise ValueError("this TimestepEmbedding has no cond_proj (cond_proj_dim=None)")
            x = x + self.cond_proj(condition.astype(x.dtype))
        x = self.linear_2(get_activation(self.act_fn)(self.linear_1(x)))
        return get_activation(self.post_act_fn)(x) if self.post_act_fn else x

"""Layers shared by the UNet and the VAE: norms, activations, resnet blocks, resampling, timestep embeddings.

Every class mirrors the diffusers module of the same name (attribute names included, so checkpoint keys map
by the generic rules of `meshserve.models.loading`), with activations in NHWC: `[B, H, W, C]`.

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
) -> nnx.Conv:
    """torch.nn.Conv2d on NHWC input: `padding` an int pads both sides of H and W, like torch."""
    if isinstance(padding, int):
        padding = ((padding, padding), (padding, padding))
    return nnx.Conv(
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


def linear(
    in_features: int, out_features: int, *, use_bias: bool = True, dtype=jnp.float32, rngs: nnx.Rngs
) -> nnx.Linear:
    return nnx.Linear(in_features, out_features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


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


class Upsample2D(nnx.Module):
    """diffusers' Upsample2D with use_conv=True: nearest 2x (or to `output_size`), then a 3x3 conv."""

    def __init__(self, channels: int, out_channels: int | None = None, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.conv = conv2d(channels, out_channels or channels, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, x, output_size: tuple[int, int] | None = None):  # [B, H, W, C] -> [B, 2H, 2W, C']
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
        act = get_activation(self.act_fn)
        h = self.conv1(act(self.norm1(x)))
        t = None
        if self.time_emb_proj is not None and temb is not None:
            t = self.time_emb_proj(act(temb))[:, None, None, :]  # [B, 1, 1, C]
        if self.time_embedding_norm == "scale_shift":
            if t is None:
                raise ValueError("ResnetBlock2D with time_embedding_norm='scale_shift' needs temb")
            scale, shift = jnp.split(t, 2, axis=-1)
            h = self.norm2(h) * (1 + scale) + shift
        else:
            h = self.norm2(h + t if t is not None else h)
        h = self.conv2(act(h))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        out = x + h
        return out / self.output_scale_factor if self.output_scale_factor != 1.0 else out


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


class TimestepEmbedding(nnx.Module):
    """diffusers' TimestepEmbedding: linear_1 -> act -> linear_2 (-> post_act)."""

    def __init__(
        self,
        in_channels: int,
        time_embed_dim: int,
        *,
        act_fn: str = "silu",
        out_dim: int | None = None,
        post_act_fn: str | None = None,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.act_fn, self.post_act_fn = act_fn, post_act_fn
        self.linear_1 = linear(in_channels, time_embed_dim, dtype=dtype, rngs=rngs)
        self.linear_2 = linear(time_embed_dim, out_dim or time_embed_dim, dtype=dtype, rngs=rngs)

    def __call__(self, x):  # [B, in_channels] -> [B, time_embed_dim]
        x = self.linear_2(get_activation(self.act_fn)(self.linear_1(x)))
        return get_activation(self.post_act_fn)(x) if self.post_act_fn else x

"""AutoencoderKLWan (the Wan 2.1 and Wan 2.2 causal 3D video VAEs) in Flax NNX, equal to diffusers' on the same
weights.

Public I/O is channel-last video, [B, T, H, W, C], unlike diffusers' [B, C, T, H, W]:

    vae.encode(video [B, 1 + 4k, H, W, 3])  -> DiagonalGaussian(mean, logvar), each [B, 1 + k, H/8, W/8, z_dim]
    vae.decode(latents [B, T, h, w, z_dim])  -> video [B, 1 + 4 (T - 1), 8 h, 8 w, 3], clamped to [-1, 1]

Neither applies `latents_mean` / `latents_std`: as in diffusers' Wan pipeline, the caller does, reading them
from `vae.config` (diffusers decodes `z / (1 / std) + mean`, per channel, in fp32).

Time is causal and processed chunk by chunk, as diffusers does it: the decoder takes one latent frame per call,
the encoder the first frame, then 4 frames per call. Every causal conv with a temporal kernel of 3 keeps the
last CACHE_T = 2 frames of its input (the feature cache) and prepends them to the next chunk; the first chunk
sees zeros there, which equals the causal zero padding. Three behaviours make the first chunk different,
all reproduced:
- the time upsample ("upsample3d", diffusers' "Rep" sentinel): chunk 0 is not time-upsampled (1 latent frame
  gives 1 video frame, later ones 4), and its time conv first runs on chunk 1 with zeros, not chunk 0's
  frame, in its cache; diffusers without a feature cache skips the time upsample altogether, so a cache-free
  port is wrong;
- the time downsample ("downsample3d"): chunk 0 only stores its last frame; later chunks run the stride-2
  time conv over [that frame, chunk];
- so chunk 0 is traced on its own and chunks 1... run as a `lax.scan` over latent frames (encoder: 4-frame
  chunks) whose carry is the feature cache, a list of arrays of fixed shapes ([B, 2, H, W, C] per conv, 1
  frame for the time downsample), zeros where the first chunk left a conv unused. The program does not grow
  with the frame count and its working memory stays that of one chunk (docs/wan.md has the measurement).

Module names follow diffusers' `autoencoders/autoencoder_kl_wan.py` (WanCausalConv3d, WanRMS_norm,
WanResample, WanResidualBlock, WanAttentionBlock, WanMidBlock, WanUpBlock, WanEncoder3d, WanDecoder3d), so
checkpoint keys map by models/checkpoints/loading.py's rules (Conv3d [O, I, t, h, w] -> [t, h, w, I, O]) plus two
renames in `diffusers_to_ours`: each `resample` is diffusers' nn.Sequential (zero pad or upsample, conv) whose
conv is `resample.1`, ours the conv itself; WanRMS_norm's `gamma` [C, 1, 1(, 1)] is stored as [C].
The Wan 2.2 VAE (TI2V-5B's: z_dim 48, 16x spatial compression) is the same network with two options, both built:
- `patch_size` p: the video enters the encoder as p x p patches folded into channels (3 -> 12 for p = 2) and
  leaves the decoder unfolded (diffusers' `patchify` / `unpatchify`, whose channel order is kept);
- `is_residual`: each encoder level is one WanResidualDownBlock (its resnets and downsampler, plus a shortcut
  that averages space-time neighbourhoods into the output channels, AvgDown3D), each decoder level a
  WanResidualUpBlock (resnets, an upsampler keeping the channels, plus a shortcut that duplicates channels into
  space-time neighbourhoods, DupUp3D, dropping the frames the first chunk does not make). The shortcuts have
  no weights.
Attention outside the mid blocks (attn_scales, which diffusers' encoder cannot run either) is rejected.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from meshserve.models.attention import AttentionSettings, attention
from meshserve.models.checkpoints.loading import (
    abstract_module,
    load_weights,
    read_component_weights,
    read_json,
)
from meshserve.models.components.autoencoder_kl import DiagonalGaussian
from meshserve.models.components.layers import conv2d, upsample_nearest2x_conv3x3
from meshserve.models.cpu.conv3d_by_frames import conv3d_by_frames, prefers_frames
from meshserve.models.cpu.conv_by_taps import conv_by_taps, prefers_taps

CACHE_T = 2  # frames a causal conv carries from one chunk to the next (its temporal kernel minus one)
_ENCODE_CHUNK = 4  # video frames per encoder call after the first (the time downsampling factor)

# Parameter path regex -> logical axes (models.parallel.placement): only FSDP, output channels of every conv
# ("embed") split over the pool's weights.shard_over axes where they divide, norms and biases replicated.
_CONVS = r"(conv_in|conv_out|conv1|conv2|conv_shortcut|quant_conv|resample|time_conv|to_qkv|proj)\.weight$"
SHARDING_RULES: tuple = (
    (_CONVS, (None, None, None, None, "embed")),  # Conv3d kernels [t, h, w, I, O]
    (_CONVS, (None, None, None, "embed")),  # Conv2d kernels [h, w, I, O]
)

# diffusers' defaults (AutoencoderKLWan.__init__): the Wan 2.1 latent statistics.
_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip


@dataclass(frozen=True)
class AutoencoderKLWanConfig:
    """diffusers' AutoencoderKLWan config (vae/config.json); field defaults equal diffusers' (the real
    Wan 2.1 VAE: base_dim 96, z_dim 16, dim_mult (1, 2, 4, 4), num_res_blocks 2, temperal_downsample
    (False, True, True))."""

    base_dim: int = 96
    decoder_base_dim: int | None = None
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = 0.0
    latents_mean: tuple[float, ...] = _LATENTS_MEAN
    latents_std: tuple[float, ...] = _LATENTS_STD
    is_residual: bool = False
    in_channels: int = 3
    out_channels: int = 3
    patch_size: int | None = None
    scale_factor_temporal: int | None = 4
    scale_factor_spatial: int | None = 8

    @classmethod
    def from_config(cls, config: dict) -> AutoencoderKLWanConfig:
        """From a diffusers vae/config.json dict; absent keys take diffusers' defaults."""
        values = {}
        for f in dataclasses.fields(cls):
            if f.name not in config or (config[f.name] is None and f.default is not None):
                continue
            v = config[f.name]
            values[f.name] = tuple(v) if isinstance(v, list) else v
        cfg = cls(**values)
        if cfg.patch_size is not None and cfg.patch_size < 1:
            raise ValueError(f"AutoencoderKLWan: patch_size must be >= 1, got {cfg.patch_size}")
        if cfg.attn_scales:
            raise ValueError(
                "AutoencoderKLWan: attn_scales must be empty (diffusers' encoder cannot run attention "
                "there and its decoder ignores it)"
            )
        if len(cfg.temperal_downsample) != len(cfg.dim_mult) - 1:
            raise ValueError("AutoencoderKLWan: temperal_downsample needs one entry per downsampling level")
        for name in ("latents_mean", "latents_std"):
            if len(getattr(cfg, name)) != cfg.z_dim:
                # absent or null, they are Wan 2.1's 16 values, which fit only z_dim 16
                raise ValueError(
                    f"AutoencoderKLWan: {name} needs one value per latent channel (z_dim {cfg.z_dim}), got "
                    f"{len(getattr(cfg, name))}"
                )
        return cfg

    @property
    def temporal_compression(self) -> int:
        return 2 ** sum(self.temperal_downsample)

    @property
    def spatial_compression(self) -> int:
        return 2 ** (len(self.dim_mult) - 1) * self.patch

    @property
    def patch(self) -> int:
        return self.patch_size or 1


# --------------------------------------------------------------------------------------------------
# The feature cache


class FeatureCache:
    """diffusers' feat_cache / feat_idx for one chunk: the cached frames of every causal conv, in call order.

    A trace-time helper: `entries` are the arrays the previous chunk left (None for the first chunk: every
    conv starts from zeros, the causal padding), `updated` collects what this chunk leaves for the next,
    in the same order, with the same shapes, so a `lax.scan` can carry them.
    """

    def __init__(self, entries: list | None = None, constrain: Callable | None = None):
        self.entries = entries
        self.updated: list = []
        # The decode's activation sharding (the pipeline's spatial split over its mesh), applied to the block
        # outputs and to every cached entry; None: identity (one device, or XLA's own propagation).
        self._constrain = constrain

    def constrain(self, x):
        """x [B, T, H, W, C] pinned to the decode's activation sharding (identity without one)."""
        return x if self._constrain is None else self._constrain(x)

    def take(self, x, frames: int):
        """The next conv's cached frames [B, frames, H, W, C] (zeros in the first chunk), for input x."""
        if self.entries is None:
            return jnp.zeros((x.shape[0], frames, *x.shape[2:]), x.dtype)
        cached = self.entries[len(self.updated)]
        if cached.shape[1:] != (frames, *x.shape[2:]):
            raise ValueError(f"feature cache entry {len(self.updated)} is {cached.shape}, input {x.shape}")
        return cached

    def put(self, value) -> None:
        self.updated.append(self.constrain(value))

    def extend(self, x):
        """x with the conv's CACHE_T cached frames prepended; caches the last CACHE_T frames of the result."""
        x = jnp.concatenate([self.take(x, CACHE_T), x], axis=1)
        self.put(x[:, -CACHE_T:])
        return x


# --------------------------------------------------------------------------------------------------
# Layers


def _triple(v) -> tuple[int, int, int]:
    return (v, v, v) if isinstance(v, int) else tuple(v)


class WanCausalConv3d(nnx.Module):
    """nn.Conv3d causal in time: diffusers pads 2 * padding_t frames in front and none behind; here those
    frames come from the feature cache (zeros for the first chunk). Spatial padding is symmetric, as torch.

    Parameters are the conv's own (`kernel` [t, h, w, I, O], `bias` [O]) so the keys are diffusers'
    (`conv_in.weight`, not `conv_in.conv.weight`).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        *,
        stride=1,
        padding=0,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        kernel_size, self.stride, padding = _triple(kernel_size), _triple(stride), _triple(padding)
        self.time_pad = 2 * padding[0]
        if self.time_pad not in (0, CACHE_T):
            raise ValueError(f"WanCausalConv3d: temporal padding {padding[0]} does not fit CACHE_T={CACHE_T}")
        self.spatial_pad = ((padding[1], padding[1]), (padding[2], padding[2]))
        fan_in = in_channels * math.prod(kernel_size)
        bound = 1 / math.sqrt(fan_in)  # torch's default initialisation (only for random test models)
        self.kernel = nnx.Param(
            jax.random.uniform(rngs.params(), (*kernel_size, in_channels, out_channels), dtype, -bound, bound)
        )
        self.bias = nnx.Param(jax.random.uniform(rngs.params(), (out_channels,), dtype, -bound, bound))

    def __call__(self, x, cache: FeatureCache | None = None):
        """x [B, T, H, W, I] -> [B, T', H', W', O]. A conv with temporal padding takes its front frames
        from `cache`; with cache None they are zeros (diffusers' cache-free call)."""
        if self.time_pad:
            if cache is None:
                x = jnp.pad(x, ((0, 0), (self.time_pad, 0), (0, 0), (0, 0), (0, 0)))
            else:
                x = cache.extend(x)
        kernel = self.kernel[...]
        padding = ((0, 0), *self.spatial_pad)
        if self.stride == (1, 1, 1) and prefers_taps(kernel.shape):  # conv_out to RGB: 27 x 3 <= 96 channels
            y = conv_by_taps(x.astype(kernel.dtype), kernel, padding)
        elif prefers_frames():
            y = conv3d_by_frames(x.astype(kernel.dtype), kernel, self.stride, padding[1:])
        else:
            y = lax.conv_general_dilated(
                x.astype(kernel.dtype),
                kernel,
                self.stride,
                padding,
                dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
            )
        return y + self.bias[...]


class WanRMS_norm(nnx.Module):  # noqa: N801 (diffusers' name)
    """F.normalize over channels (L2, eps 1e-12) x sqrt(C) x gamma, no bias (Wan never sets one).

    The normalisation runs in fp32 for low-precision inputs, then returns to the input's dtype before the
    scale, as diffusers does.
    """

    def __init__(self, dim: int, *, dtype=jnp.float32):
        self.scale = dim**0.5
        self.gamma = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(jnp.square(xf), axis=-1, keepdims=True))
        normalized = (xf / jnp.maximum(norm, 1e-12)).astype(x.dtype)
        return normalized * self.scale * self.gamma[...].astype(x.dtype)


class WanResidualBlock(nnx.Module):
    """RMS norm -> SiLU -> causal conv, twice, plus a (1x1x1 conv) shortcut. Dropout is inference-off."""

    def __init__(self, in_dim: int, out_dim: int, *, dtype, rngs: nnx.Rngs):
        self.norm1 = WanRMS_norm(in_dim, dtype=dtype)
        self.conv1 = WanCausalConv3d(in_dim, out_dim, 3, padding=1, dtype=dtype, rngs=rngs)
        self.norm2 = WanRMS_norm(out_dim, dtype=dtype)
        self.conv2 = WanCausalConv3d(out_dim, out_dim, 3, padding=1, dtype=dtype, rngs=rngs)
        self.conv_shortcut = (
            WanCausalConv3d(in_dim, out_dim, 1, dtype=dtype, rngs=rngs) if in_dim != out_dim else None
        )

    def __call__(self, x, cache: FeatureCache, first_chunk: bool = False):
        h = self.conv_shortcut(x) if self.conv_shortcut is not None else x
        x = self.conv1(jax.nn.silu(self.norm1(x)), cache)
        x = self.conv2(jax.nn.silu(self.norm2(x)), cache)
        return x + h


class WanAttentionBlock(nnx.Module):
    """Single-head self-attention within each frame over its H x W positions (1x1 convs for q, k, v and the
    output projection), residual."""

    def __init__(self, dim: int, *, settings: AttentionSettings, dtype, rngs: nnx.Rngs):
        self.settings = settings
        self.norm = WanRMS_norm(dim, dtype=dtype)
        self.to_qkv = conv2d(dim, dim * 3, 1, dtype=dtype, rngs=rngs)
        self.proj = conv2d(dim, dim, 1, dtype=dtype, rngs=rngs)

    def __call__(self, x, cache: FeatureCache | None = None, first_chunk: bool = False):
        b, t, h, w, c = x.shape
        frames = self.norm(x.reshape(b * t, h, w, c))
        qkv = self.to_qkv(frames).reshape(b * t, h * w, 1, 3 * c)
        q, k, v = jnp.split(qkv, 3, axis=-1)  # channels [q | k | v], as diffusers' chunk(3)
        out = attention(q, k, v, settings=self.settings).reshape(b * t, h, w, c)
        return self.proj(out).reshape(b, t, h, w, c) + x


class WanResample(nnx.Module):
    """Spatial 2x up- or downsampling per frame, with a causal time conv for the "3d" modes.

    upsample: nearest-exact 2x (for an exact 2x that is nearest) and a 3x3 conv to `upsample_out_dim`;
    "upsample3d" first doubles the frames: a (3, 1, 1) causal conv to 2C channels, whose halves are the
    even and odd output frames. downsample: ZeroPad2d(0, 1, 0, 1) and a stride-2 3x3 conv; "downsample3d"
    then halves the frames with a stride-2 (3, 1, 1) conv over [the previous chunk's last frame, chunk].
    """

    MODES = ("upsample2d", "upsample3d", "downsample2d", "downsample3d")

    def __init__(self, dim: int, mode: str, upsample_out_dim: int | None = None, *, dtype, rngs: nnx.Rngs):
        if mode not in self.MODES:
            raise ValueError(f"WanResample: mode {mode!r} not in {self.MODES}")
        self.mode = mode
        if mode.startswith("upsample"):
            out = upsample_out_dim or dim // 2
            self.resample = conv2d(dim, out, 3, padding=1, dtype=dtype, rngs=rngs)
        else:
            self.resample = conv2d(dim, dim, 3, stride=2, padding=((0, 1), (0, 1)), dtype=dtype, rngs=rngs)
        if mode == "upsample3d":
            self.time_conv = WanCausalConv3d(
                dim, dim * 2, (3, 1, 1), padding=(1, 0, 0), dtype=dtype, rngs=rngs
            )
        elif mode == "downsample3d":
            self.time_conv = WanCausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1), dtype=dtype, rngs=rngs)
        else:
            self.time_conv = None

    def __call__(self, x, cache: FeatureCache, first_chunk: bool = False):
        b, t, h, w, c = x.shape
        if self.mode == "upsample3d":
            if first_chunk:
                # "Rep": frame 0 is not time-upsampled, and the time conv's cache stays zeros, so chunk 1 sees
                # zeros in front of it, not this frame.
                cache.put(cache.take(x, CACHE_T))
            else:
                x = self.time_conv(x, cache)  # [B, t, H, W, 2C]: channels [even frame | odd frame]
                x = x.reshape(b, t, h, w, 2, c).transpose(0, 1, 4, 2, 3, 5).reshape(b, 2 * t, h, w, c)
                t = 2 * t
        frames = x.reshape(b * t, h, w, c)
        if self.mode.startswith("upsample"):
            kernel = self.resample.kernel[...]
            if kernel.dtype == jnp.float32:
                # The 2x upsample folded into the conv (layers.upsample_nearest2x_conv3x3): the same sums up to
                # the order of two additions, without the 4x upsampled copy of the input, which at the last
                # level of a 480x832 decode is [4, 480, 832, 192] fp32 = 1.2 GB per chunk.
                frames = upsample_nearest2x_conv3x3(
                    frames, kernel, self.resample.bias[...], self.resample.dtype
                )
            else:
                frames = self.resample(jnp.repeat(jnp.repeat(frames, 2, axis=1), 2, axis=2))
        else:
            frames = self.resample(frames)
        x = frames.reshape(b, t, *frames.shape[1:])
        if self.mode == "downsample3d":
            previous = cache.take(x, 1)
            cache.put(x[:, -1:])
            if not first_chunk:  # the first chunk only leaves its last frame for the next one
                x = self.time_conv(jnp.concatenate([previous, x], axis=1))
        return x


class WanMidBlock(nnx.Module):
    """resnet -> (attention -> resnet) x num_layers."""

    def __init__(self, dim: int, *, num_layers: int = 1, settings: AttentionSettings, dtype, rngs: nnx.Rngs):
        self.resnets = nnx.List(
            [WanResidualBlock(dim, dim, dtype=dtype, rngs=rngs) for _ in range(num_layers + 1)]
        )
        self.attentions = nnx.List(
            [WanAttentionBlock(dim, settings=settings, dtype=dtype, rngs=rngs) for _ in range(num_layers)]
        )

    def __call__(self, x, cache: FeatureCache, first_chunk: bool = False):
        x = self.resnets[0](x, cache)
        for attn, resnet in zip(self.attentions, self.resnets[1:], strict=True):
            x = resnet(attn(x), cache)
        return x


class WanUpBlock(nnx.Module):
    """num_res_blocks + 1 residual blocks, then an optional upsampler (halving the channels)."""

    def __init__(
        self, in_dim: int, out_dim: int, *, num_res_blocks: int, upsample_mode: str | None, dtype, rngs
    ):
        self.resnets = nnx.List(
            [
                WanResidualBlock(in_dim if i == 0 else out_dim, out_dim, dtype=dtype, rngs=rngs)
                for i in range(num_res_blocks + 1)
            ]
        )
        self.upsamplers = (
            nnx.List([WanResample(out_dim, upsample_mode, dtype=dtype, rngs=rngs)])
            if upsample_mode is not None
            else None
        )

    def __call__(self, x, cache: FeatureCache, first_chunk: bool = False):
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, cache, first_chunk)
        return x


def avg_down_3d(x, out_channels: int, factor_t: int, factor_s: int):
    """diffusers' AvgDown3D, channel-last: x [B, T, H, W, C] (T padded in front with zeros to a multiple of
    factor_t) -> [B, T / ft, H / fs, W / fs, out]: each output channel the mean of a group of the (C, ft, fs,
    fs) neighbourhood values, grouped in diffusers' (channel, t, h, w) order."""
    b, t, h, w, c = x.shape
    pad = (factor_t - t % factor_t) % factor_t
    x = jnp.pad(x, ((0, 0), (pad, 0), (0, 0), (0, 0), (0, 0)))
    t = (t + pad) // factor_t
    x = x.reshape(b, t, factor_t, h // factor_s, factor_s, w // factor_s, factor_s, c)
    x = x.transpose(0, 1, 3, 5, 7, 2, 4, 6)  # [B, T', H', W', C, ft, fs, fs]
    group = c * factor_t * factor_s * factor_s // out_channels
    return x.reshape(b, t, h // factor_s, w // factor_s, out_channels, group).mean(axis=-1)


def dup_up_3d(x, out_channels: int, factor_t: int, factor_s: int, first_chunk: bool = False):
    """diffusers' DupUp3D, channel-last: x [B, T, H, W, C] -> [B, T ft, H fs, W fs, out], each input channel
    repeated into (out channel, t, h, w) neighbourhood positions in diffusers' order; the first chunk keeps
    only its last ft-th frames (its main path makes one frame)."""
    b, t, h, w, c = x.shape
    repeats = out_channels * factor_t * factor_s * factor_s // c
    x = jnp.repeat(x, repeats, axis=-1).reshape(b, t, h, w, out_channels, factor_t, factor_s, factor_s)
    x = x.transpose(0, 1, 5, 2, 6, 3, 7, 4)  # [B, T, ft, H, fs, W, fs, out]
    x = x.reshape(b, t * factor_t, h * factor_s, w * factor_s, out_channels)
    return x[:, factor_t - 1 :] if first_chunk else x


class WanResidualDownBlock(nnx.Module):
    """Wan 2.2's encoder level: resnets, then a downsampler (not at the last level), plus the input averaged
    down to the output's shape (avg_down_3d)."""

    def __init__(self, in_dim, out_dim, *, num_res_blocks, temperal_downsample, down_flag, dtype, rngs):
        self.out_dim = out_dim
        self.factor_t, self.factor_s = (2 if temperal_downsample else 1), (2 if down_flag else 1)
        self.resnets = nnx.List(
            [
                WanResidualBlock(in_dim if i == 0 else out_dim, out_dim, dtype=dtype, rngs=rngs)
                for i in range(num_res_blocks)
            ]
        )
        mode = "downsample3d" if temperal_downsample else "downsample2d"
        self.downsampler = WanResample(out_dim, mode, dtype=dtype, rngs=rngs) if down_flag else None

    def __call__(self, x, cache: FeatureCache, first_chunk: bool = False):
        shortcut = avg_down_3d(x, self.out_dim, self.factor_t, self.factor_s)
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.downsampler is not None:
            x = self.downsampler(x, cache, first_chunk)
        return x + shortcut


class WanResidualUpBlock(nnx.Module):
    """Wan 2.2's decoder level: num_res_blocks + 1 resnets, then an upsampler keeping the channels (not at the
    last level), plus the input duplicated up to the output's shape (dup_up_3d)."""

    def __init__(self, in_dim, out_dim, *, num_res_blocks, temperal_upsample, up_flag, dtype, rngs):
        self.out_dim, self.up_flag = out_dim, up_flag
        self.factor_t = 2 if temperal_upsample else 1
        self.resnets = nnx.List(
            [
                WanResidualBlock(in_dim if i == 0 else out_dim, out_dim, dtype=dtype, rngs=rngs)
                for i in range(num_res_blocks + 1)
            ]
        )
        mode = "upsample3d" if temperal_upsample else "upsample2d"
        self.upsampler = (
            WanResample(out_dim, mode, upsample_out_dim=out_dim, dtype=dtype, rngs=rngs) if up_flag else None
        )

    def __call__(self, x, cache: FeatureCache, first_chunk: bool = False):
        shortcut = dup_up_3d(x, self.out_dim, self.factor_t, 2, first_chunk) if self.up_flag else None
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.upsampler is not None:
            x = self.upsampler(x, cache, first_chunk)
        return x if shortcut is None else x + shortcut


def patchify(x, p: int):
    """diffusers' patchify, channel-last: [B, T, H, W, C] -> [B, T, H / p, W / p, C p p], channel c p p + the
    patch's (w, h) offset (diffusers' order: w before h)."""
    if p == 1:
        return x
    b, t, h, w, c = x.shape
    x = x.reshape(b, t, h // p, p, w // p, p, c).transpose(0, 1, 2, 4, 6, 5, 3)
    return x.reshape(b, t, h // p, w // p, c * p * p)


def unpatchify(x, p: int):
    """The inverse of `patchify`: [B, T, H, W, C p p] -> [B, T, H p, W p, C]."""
    if p == 1:
        return x
    b, t, h, w, cpp = x.shape
    x = x.reshape(b, t, h, w, cpp // (p * p), p, p).transpose(0, 1, 2, 6, 3, 5, 4)
    return x.reshape(b, t, h * p, w * p, cpp // (p * p))


class WanEncoder3d(nnx.Module):
    def __init__(self, cfg: AutoencoderKLWanConfig, *, settings: AttentionSettings, dtype, rngs: nnx.Rngs):
        dims = [cfg.base_dim * u for u in (1, *cfg.dim_mult)]
        self.conv_in = WanCausalConv3d(cfg.in_channels, dims[0], 3, padding=1, dtype=dtype, rngs=rngs)
        blocks: list[nnx.Module] = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            last = i == len(cfg.dim_mult) - 1
            if cfg.is_residual:
                blocks.append(
                    WanResidualDownBlock(
                        in_dim,
                        out_dim,
                        num_res_blocks=cfg.num_res_blocks,
                        temperal_downsample=not last and cfg.temperal_downsample[i],
                        down_flag=not last,
                        dtype=dtype,
                        rngs=rngs,
                    )
                )
                continue
            for _ in range(cfg.num_res_blocks):
                blocks.append(WanResidualBlock(in_dim, out_dim, dtype=dtype, rngs=rngs))
                in_dim = out_dim
            if not last:
                mode = "downsample3d" if cfg.temperal_downsample[i] else "downsample2d"
                blocks.append(WanResample(out_dim, mode, dtype=dtype, rngs=rngs))
        self.down_blocks = nnx.List(blocks)
        self.mid_block = WanMidBlock(dims[-1], settings=settings, dtype=dtype, rngs=rngs)
        self.norm_out = WanRMS_norm(dims[-1], dtype=dtype)
        # z_dim * 2: mean and log-variance
        self.conv_out = WanCausalConv3d(dims[-1], cfg.z_dim * 2, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, x, cache: FeatureCache, first_chunk: bool = False):
        x = self.conv_in(x, cache)
        for layer in self.down_blocks:
            x = layer(x, cache, first_chunk)
        x = self.mid_block(x, cache)
        return self.conv_out(jax.nn.silu(self.norm_out(x)), cache)


class WanDecoder3d(nnx.Module):
    def __init__(self, cfg: AutoencoderKLWanConfig, *, settings: AttentionSettings, dtype, rngs: nnx.Rngs):
        base = cfg.decoder_base_dim or cfg.base_dim
        dims = [base * u for u in (cfg.dim_mult[-1], *cfg.dim_mult[::-1])]
        temperal_upsample = cfg.temperal_downsample[::-1]
        self.conv_in = WanCausalConv3d(cfg.z_dim, dims[0], 3, padding=1, dtype=dtype, rngs=rngs)
        self.mid_block = WanMidBlock(dims[0], settings=settings, dtype=dtype, rngs=rngs)
        blocks = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            last = i == len(cfg.dim_mult) - 1
            if cfg.is_residual:  # its upsamplers keep the channels
                blocks.append(
                    WanResidualUpBlock(
                        in_dim,
                        out_dim,
                        num_res_blocks=cfg.num_res_blocks,
                        temperal_upsample=not last and temperal_upsample[i],
                        up_flag=not last,
                        dtype=dtype,
                        rngs=rngs,
                    )
                )
                continue
            if i > 0:
                in_dim //= 2  # the previous block's upsampler halved the channels
            mode = None
            if not last:
                mode = "upsample3d" if temperal_upsample[i] else "upsample2d"
            blocks.append(
                WanUpBlock(
                    in_dim,
                    out_dim,
                    num_res_blocks=cfg.num_res_blocks,
                    upsample_mode=mode,
                    dtype=dtype,
                    rngs=rngs,
                )
            )
        self.up_blocks = nnx.List(blocks)
        self.norm_out = WanRMS_norm(dims[-1], dtype=dtype)
        self.conv_out = WanCausalConv3d(dims[-1], cfg.out_channels, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, x, cache: FeatureCache, first_chunk: bool = False):
        # Each block's output pinned to the decode's sharding (cache.constrain): where the pipeline splits the
        # video spatially, XLA's propagation alone left activations of the scan body replicated.
        x = cache.constrain(self.conv_in(x, cache))
        x = cache.constrain(self.mid_block(x, cache))
        for block in self.up_blocks:
            x = cache.constrain(block(x, cache, first_chunk))
        return cache.constrain(self.conv_out(jax.nn.silu(self.norm_out(x)), cache))


# --------------------------------------------------------------------------------------------------
# The model


class AutoencoderKLWan(nnx.Module):
    def __init__(
        self,
        config: AutoencoderKLWanConfig,
        *,
        settings: AttentionSettings | None = None,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        settings = settings or AttentionSettings()
        self.config = config
        z = config.z_dim
        self.encoder = WanEncoder3d(config, settings=settings, dtype=dtype, rngs=rngs)
        self.quant_conv = WanCausalConv3d(z * 2, z * 2, 1, dtype=dtype, rngs=rngs)
        self.post_quant_conv = WanCausalConv3d(z, z, 1, dtype=dtype, rngs=rngs)
        self.decoder = WanDecoder3d(config, settings=settings, dtype=dtype, rngs=rngs)
        # Whether the chunk scans are unrolled. Serving keeps the scan (81 frames: 20 chunks compiled once);
        # training sets it (training/families/wan.py): XLA:CPU ran the scan's backward far slower than
        # straight-line code, the decoder's input gradient on a 3-latent-frame clip 3.03 s scanned and
        # 0.54 s unrolled (2-core EPYC, 2026-11-23, beside a training run: the ratio is what counts).
        self.unroll_chunks = False

    def encode(self, x) -> DiagonalGaussian:
        """x: [B, 1 + 4k, H, W, in_channels] video in [-1, 1] -> DiagonalGaussian, mean/logvar
        [B, 1 + k, H/8, W/8, z_dim] (for the real config; the factors follow dim_mult / temperal_downsample).

        The first frame alone, then chunks of 4 frames in a lax.scan carrying the feature cache.
        """
        x = patchify(x, self.config.patch)
        b, frames, h, w, c = x.shape
        if (frames - 1) % _ENCODE_CHUNK:
            # diffusers silently drops the frames past the last whole chunk; a caller that passes them
            # expects them encoded, so they are an error here.
            raise ValueError(f"AutoencoderKLWan.encode: frames must be 1 + 4k, got {frames}")
        cache = FeatureCache()
        out = self.encoder(x[:, :1], cache, first_chunk=True)
        chunks = (frames - 1) // _ENCODE_CHUNK
        if chunks:

            def body(entries, chunk):
                step = FeatureCache(entries)
                return step.updated, self.encoder(chunk, step)

            xs = x[:, 1:].reshape(b, chunks, _ENCODE_CHUNK, h, w, c).swapaxes(0, 1)
            _, rest = lax.scan(
                body, cache.updated, xs, unroll=self.unroll_chunks
            )  # [chunks, B, t, h', w', 2z]
            rest = rest.swapaxes(0, 1).reshape(b, -1, *rest.shape[3:])
            out = jnp.concatenate([out, rest], axis=1)
        moments = self.quant_conv(out)
        mean, logvar = jnp.split(moments, 2, axis=-1)
        return DiagonalGaussian(mean=mean, logvar=jnp.clip(logvar, -30.0, 20.0))

    def decode(self, z, constrain: Callable | None = None):
        """z: [B, T, h, w, z_dim] (unnormalised latents: z / (1 / latents_std) + latents_mean) -> video
        [B, 1 + 4 (T - 1), 8 h, 8 w, out_channels] in [-1, 1] (real config).

        The first latent frame alone, then one latent frame per lax.scan iteration carrying the cache.
        `constrain` (x [B, T, H, W, C] -> x with a sharding constraint) pins the input, every block's output
        and every cached frame, so a caller can split the decode over devices (the Wan pipeline splits it
        spatially); it changes no value.
        """
        b, t = z.shape[:2]
        cache = FeatureCache(constrain=constrain)
        x = cache.constrain(self.post_quant_conv(cache.constrain(z)))
        out = self.decoder(x[:, :1], cache, first_chunk=True)
        if t > 1:

            def body(entries, frame):
                step = FeatureCache(entries, constrain=constrain)
                return step.updated, self.decoder(step.constrain(frame), step)

            xs = x[:, 1:, None].swapaxes(0, 1)  # [T - 1, B, 1, h, w, z]
            _, rest = lax.scan(body, cache.updated, xs, unroll=self.unroll_chunks)  # [T - 1, B, 4, H, W, out]
            rest = rest.swapaxes(0, 1).reshape(b, -1, *rest.shape[3:])
            out = jnp.concatenate([out, rest], axis=1)
        return cache.constrain(jnp.clip(unpatchify(out, self.config.patch), -1.0, 1.0))


def diffusers_to_ours(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """diffusers' keys -> ours: `resample.1.` (the conv of an nn.Sequential) -> `resample.`; WanRMS_norm's
    gamma [C, 1, 1(, 1)] -> [C]."""
    out = {}
    for key, value in state.items():
        key = key.replace(".resample.1.", ".resample.")
        if key.endswith(".gamma"):
            value = value.reshape(-1)
        out[key] = value
    return out


def load_autoencoder_kl_wan(
    folder: Path, dtype=jnp.float32, settings: AttentionSettings | None = None, place=None
) -> AutoencoderKLWan:
    """An AutoencoderKLWan from a diffusers `vae/` folder (config.json + safetensors), weights cast to `dtype`
    (Wan's pipeline runs its VAE in fp32). `place(path, array)`: see models.loading.load_weights."""
    folder = Path(folder)
    config = AutoencoderKLWanConfig.from_config(read_json(folder / "config.json"))
    dtype = jnp.dtype(dtype)
    model = abstract_module(AutoencoderKLWan, config, settings=settings, dtype=dtype)
    load_weights(
        model, diffusers_to_ours(read_component_weights(folder)), where=str(folder), dtype=dtype, place=place
    )
    return model

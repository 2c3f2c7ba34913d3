"""AutoencoderKL (the Stable Diffusion / SDXL VAE) in Flax NNX, equal to diffusers' on the same weights.

Public I/O is NHWC, unlike diffusers' NCHW (the pipeline owns the layout):

    vae.encode(images [B, H, W, in_channels])  -> DiagonalGaussian(mean, logvar), each [B, H/f, W/f, latent]
    vae.decode(latents [B, H/f, W/f, latent])  -> images [B, H, W, out_channels]     (f = 2 ** (levels - 1))

Neither applies `scaling_factor` / `shift_factor` (nor latents_mean / latents_std): as in diffusers the caller
does, reading them from `vae.config`.

Module names follow diffusers' `autoencoders/autoencoder_kl.py` and `autoencoders/vae.py` (Encoder,
Decoder, DownEncoderBlock2D, UpDecoderBlock2D, UNetMidBlock2D and its single-head spatial attention).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.models.attention import AttentionSettings, attention
from meshserve.models.checkpoints.loading import (
    abstract_module,
    load_weights,
    read_component_weights,
    read_json,
)
from meshserve.models.components.layers import (
    Downsample2D,
    GroupNorm,
    ResnetBlock2D,
    Upsample2D,
    conv2d,
    get_activation,
    linear,
)

# diffusers builds every VAE block with this eps (vae.py), whatever the config says.
_VAE_EPS = 1e-6

# Parameter path regex -> logical axes (models.parallel.placement maps them to mesh axes per pool). Only FSDP:
# "embed" (output channels of the convs, input width of the mid-block attention's projections) is split over
# the pool's weights.shard_over axes (replicated without). Norm scales and biases stay replicated: 65,943 of
# the SDXL VAE's 83,653,863 parameters (0.08 %); so do the convs whose output channels (3, 4, 8) do not divide.
SHARDING_RULES: tuple = (
    (
        r"(conv_in|conv_out|conv1|conv2|conv_shortcut|quant_conv|samplers\.\d+\.conv)\.weight$",
        (None, None, None, "embed"),
    ),
    (r"attentions\.\d+\.(to_q|to_k|to_v|to_out\.0)\.weight$", ("embed", None)),
)


@dataclass(frozen=True)
class AutoencoderKLConfig:
    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",)
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",)
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    act_fn: str = "silu"
    latent_channels: int = 4
    norm_num_groups: int = 32
    sample_size: int | tuple[int, ...] = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    force_upcast: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    @classmethod
    def from_config(cls, config: dict) -> AutoencoderKLConfig:
        """From a diffusers vae/config.json dict; absent keys take diffusers' defaults."""
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in config and config[f.name] is not None:
                v = config[f.name]
                values[f.name] = tuple(v) if isinstance(v, list) else v
        cfg = cls(**values)
        bad = [t for t in cfg.down_block_types if t != "DownEncoderBlock2D"]
        bad += [t for t in cfg.up_block_types if t != "UpDecoderBlock2D"]
        if bad:
            raise ValueError(
                f"AutoencoderKL: unsupported block types {bad} (only DownEncoderBlock2D/UpDecoderBlock2D)"
            )
        if not len(cfg.down_block_types) == len(cfg.up_block_types) == len(cfg.block_out_channels):
            raise ValueError(
                "AutoencoderKL: down_block_types, up_block_types and block_out_channels differ in length"
            )
        return cfg


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DiagonalGaussian:
    """diffusers' DiagonalGaussianDistribution in NHWC: mean and (clamped) log-variance, [B, h, w, latent]."""

    mean: jax.Array
    logvar: jax.Array

    @property
    def std(self):
        return jnp.exp(0.5 * self.logvar)

    def mode(self):
        return self.mean

    def sample(self, key):
        return self.mean + self.std * jax.random.normal(key, self.mean.shape, self.mean.dtype)


# --------------------------------------------------------------------------------------------------
# Blocks


class Attention(nnx.Module):
    """The mid-block spatial self-attention (diffusers' Attention with group_norm, residual, bias).

    diffusers gives it attention_head_dim = channels, so one head over all H*W positions.
    """

    def __init__(
        self,
        channels: int,
        *,
        heads: int,
        groups: int,
        eps: float,
        rescale_output_factor: float,
        settings: AttentionSettings,
        dtype,
        rngs: nnx.Rngs,
    ):
        self.heads = heads
        self.rescale_output_factor = rescale_output_factor
        self.settings = settings
        self.group_norm = GroupNorm(channels, groups, eps, dtype=dtype, rngs=rngs)
        self.to_q = linear(channels, channels, dtype=dtype, rngs=rngs)
        self.to_k = linear(channels, channels, dtype=dtype, rngs=rngs)
        self.to_v = linear(channels, channels, dtype=dtype, rngs=rngs)
        self.to_out = nnx.List([linear(channels, channels, dtype=dtype, rngs=rngs)])

    def __call__(self, x):  # [B, H, W, C] -> [B, H, W, C]
        b, h, w, c = x.shape
        hidden = self.group_norm(x.reshape(b, h * w, c))  # [B, S, C]
        heads = (b, h * w, self.heads, c // self.heads)
        q = self.to_q(hidden).reshape(heads)
        k = self.to_k(hidden).reshape(heads)
        v = self.to_v(hidden).reshape(heads)
        out = attention(q, k, v, settings=self.settings).reshape(b, h * w, c)
        out = self.to_out[0](out).reshape(b, h, w, c)
        return (out + x) / self.rescale_output_factor


class UNetMidBlock2D(nnx.Module):
    """resnet -> (attention -> resnet) x num_layers, no time embedding (the VAE's mid block)."""

    def __init__(
        self,
        channels: int,
        *,
        groups: int,
        act_fn: str,
        add_attention: bool,
        num_layers: int = 1,
        settings: AttentionSettings,
        dtype,
        rngs: nnx.Rngs,
    ):
        def resnet():
            return ResnetBlock2D(
                channels, channels, None, eps=_VAE_EPS, groups=groups, act_fn=act_fn, dtype=dtype, rngs=rngs
            )

        self.resnets = nnx.List([resnet() for _ in range(num_layers + 1)])
        # Without attention diffusers keeps `None` placeholders: no keys either way.
        self.attentions = nnx.List(
            [
                Attention(
                    channels,
                    heads=1,
                    groups=groups,
                    eps=_VAE_EPS,
                    rescale_output_factor=1.0,
                    settings=settings,
                    dtype=dtype,
                    rngs=rngs,
                )
                for _ in range(num_layers if add_attention else 0)
            ]
        )

    def __call__(self, x):
        x = self.resnets[0](x)
        for i, resnet in enumerate(self.resnets[1:]):
            if len(self.attentions):
                x = self.attentions[i](x)
            x = resnet(x)
        return x


def _resnet_stack(
    in_channels: int, out_channels: int, num_layers: int, groups: int, act_fn: str, dtype, rngs
):
    """The `resnets` of an encoder/decoder block: the first maps in -> out channels, the rest out -> out."""
    return nnx.List(
        [
            ResnetBlock2D(
                in_channels if i == 0 else out_channels,
                out_channels,
                None,
                eps=_VAE_EPS,
                groups=groups,
                act_fn=act_fn,
                dtype=dtype,
                rngs=rngs,
            )
            for i in range(num_layers)
        ]
    )


class DownEncoderBlock2D(nnx.Module):
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        *,
        num_layers: int,
        groups: int,
        act_fn: str,
        add_downsample: bool,
        dtype,
        rngs: nnx.Rngs,
    ):
        self.resnets = _resnet_stack(in_channels, out_channels, num_layers, groups, act_fn, dtype, rngs)
        # The encoder's downsamplers pad asymmetrically (downsample_padding=0 in diffusers' Encoder).
        self.downsamplers = (
            nnx.List([Downsample2D(out_channels, padding=0, dtype=dtype, rngs=rngs)])
            if add_downsample
            else None
        )

    def __call__(self, x):
        for resnet in self.resnets:
            x = resnet(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
        return x


class UpDecoderBlock2D(nnx.Module):
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        *,
        num_layers: int,
        groups: int,
        act_fn: str,
        add_upsample: bool,
        dtype,
        rngs: nnx.Rngs,
    ):
        self.resnets = _resnet_stack(in_channels, out_channels, num_layers, groups, act_fn, dtype, rngs)
        self.upsamplers = (
            nnx.List([Upsample2D(out_channels, subpixel=True, dtype=dtype, rngs=rngs)])
            if add_upsample
            else None
        )

    def __call__(self, x):
        for resnet in self.resnets:
            x = resnet(x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        return x


class Encoder(nnx.Module):
    def __init__(self, cfg: AutoencoderKLConfig, *, settings: AttentionSettings, dtype, rngs: nnx.Rngs):
        channels, groups, act = cfg.block_out_channels, cfg.norm_num_groups, cfg.act_fn
        self.conv_in = conv2d(cfg.in_channels, channels[0], 3, padding=1, dtype=dtype, rngs=rngs)
        self.down_blocks = nnx.List(
            [
                DownEncoderBlock2D(
                    channels[max(i - 1, 0)],
                    channels[i],
                    num_layers=cfg.layers_per_block,
                    groups=groups,
                    act_fn=act,
                    add_downsample=i < len(channels) - 1,
                    dtype=dtype,
                    rngs=rngs,
                )
                for i in range(len(channels))
            ]
        )
        self.mid_block = UNetMidBlock2D(
            channels[-1],
            groups=groups,
            act_fn=act,
            add_attention=cfg.mid_block_add_attention,
            settings=settings,
            dtype=dtype,
            rngs=rngs,
        )
        self.conv_norm_out = GroupNorm(channels[-1], groups, _VAE_EPS, dtype=dtype, rngs=rngs)
        # double_z: mean and log-variance
        self.conv_out = conv2d(channels[-1], 2 * cfg.latent_channels, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, x):  # [B, H, W, in] -> [B, H/f, W/f, 2 * latent]
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        # diffusers' Encoder.conv_act is nn.SiLU() whatever act_fn says.
        return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))


class Decoder(nnx.Module):
    def __init__(self, cfg: AutoencoderKLConfig, *, settings: AttentionSettings, dtype, rngs: nnx.Rngs):
        channels, groups, act = cfg.block_out_channels, cfg.norm_num_groups, cfg.act_fn
        self.conv_in = conv2d(cfg.latent_channels, channels[-1], 3, padding=1, dtype=dtype, rngs=rngs)
        self.mid_block = UNetMidBlock2D(
            channels[-1],
            groups=groups,
            act_fn=act,
            add_attention=cfg.mid_block_add_attention,
            settings=settings,
            dtype=dtype,
            rngs=rngs,
        )
        reversed_channels = list(reversed(channels))
        self.up_blocks = nnx.List(
            [
                UpDecoderBlock2D(
                    reversed_channels[max(i - 1, 0)],
                    reversed_channels[i],
                    num_layers=cfg.layers_per_block + 1,
                    groups=groups,
                    act_fn=act,
                    add_upsample=i < len(channels) - 1,
                    dtype=dtype,
                    rngs=rngs,
                )
                for i in range(len(channels))
            ]
        )
        self.conv_norm_out = GroupNorm(channels[0], groups, _VAE_EPS, dtype=dtype, rngs=rngs)
        self.conv_out = conv2d(channels[0], cfg.out_channels, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, z):  # [B, h, w, latent] -> [B, h*f, w*f, out]
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))


# --------------------------------------------------------------------------------------------------
# The model


class AutoencoderKL(nnx.Module):
    def __init__(
        self,
        config: AutoencoderKLConfig,
        *,
        settings: AttentionSettings | None = None,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        settings = settings or AttentionSettings()
        self.config = config
        self.encoder = Encoder(config, settings=settings, dtype=dtype, rngs=rngs)
        self.decoder = Decoder(config, settings=settings, dtype=dtype, rngs=rngs)
        lc = config.latent_channels
        self.quant_conv = conv2d(2 * lc, 2 * lc, 1, dtype=dtype, rngs=rngs) if config.use_quant_conv else None
        self.post_quant_conv = (
            conv2d(lc, lc, 1, dtype=dtype, rngs=rngs) if config.use_post_quant_conv else None
        )
        get_activation(config.act_fn)  # reject an unknown activation at construction, not at trace time

    def encode(self, x) -> DiagonalGaussian:
        """x: [B, H, W, in_channels] (images in [-1, 1]) -> DiagonalGaussian with mean/logvar [B, h, w, latent]."""
        moments = self.encoder(x)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        mean, logvar = jnp.split(moments, 2, axis=-1)
        return DiagonalGaussian(mean=mean, logvar=jnp.clip(logvar, -30.0, 20.0))

    def decode(self, z):
        """z: [B, h, w, latent] (unscaled latents) -> images [B, H, W, out_channels], roughly in [-1, 1]."""
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)


# Pre-0.14 diffusers checkpoints (the original SD VAEs among them) name the mid-block attention like this.
_LEGACY_ATTENTION = {".query.": ".to_q.", ".key.": ".to_k.", ".value.": ".to_v.", ".proj_attn.": ".to_out.0."}


def _modernise(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Legacy attention names -> current ones; 1x1-conv attention weights [O, I, 1, 1] -> linear [O, I]."""
    out = {}
    for key, value in state.items():
        if ".attentions." in key:
            for old, new in _LEGACY_ATTENTION.items():
                key = key.replace(old, new)
            if key.endswith(".weight") and value.ndim == 4 and "group_norm" not in key:
                value = value[:, :, 0, 0]
        out[key] = value
    return out


def load_autoencoder_kl(
    folder: Path, dtype=jnp.float32, settings: AttentionSettings | None = None, place=None
) -> AutoencoderKL:
    """An AutoencoderKL from a diffusers `vae/` folder (config.json + safetensors), weights cast to `dtype`."""
    folder = Path(folder)
    config = AutoencoderKLConfig.from_config(read_json(folder / "config.json"))
    dtype = jnp.dtype(dtype)
    # Built abstractly: no random initialisation of weights the checkpoint is about to replace.
    model = abstract_module(AutoencoderKL, config, settings=settings, dtype=dtype)
    load_weights(
        model, _modernise(read_component_weights(folder)), where=str(folder), dtype=dtype, place=place
    )
    return model

"""ControlNetModel (diffusers' `models/controlnets/controlnet.py`) in Flax NNX, channels-last.

A ControlNet is the UNet's way down (UNetEncoder: conv_in, time and text_time embeddings, down blocks, mid
block, the same module and attribute names), plus:

- controlnet_cond_embedding: the control image [B, H, W, 3] in [0, 1] (diffusers' control image processor does
  not normalise) -> the latent grid, by conv_in, then a 3x3 conv and a stride-2 3x3 conv per level, SiLU after
  each, then conv_out; added to conv_in's output of the latents;
- controlnet_down_blocks: one 1x1 conv per skip of the way down (conv_in's output and every resnet's and
  downsampler's), and controlnet_mid_block after the mid block: their outputs, times the conditioning scale,
  are the residuals the UNet adds to its skips and to its mid block's output
  (UNet2DConditionModel's `down_block_additional_residuals`, `mid_block_additional_residual`).

Guess mode (diffusers' `guess_mode`, per row here): the residuals are scaled by a ramp from 0.1 (conv_in's skip)
to 1.0 (the mid block's), 10^linspace(-1, 0), times the conditioning scale, so the ControlNet steers the coarse
levels most; a config with `global_pool_conditions` averages every residual over its height and width instead
(no ramp; the pipeline then runs guess mode on every row, as diffusers). The config's
`controlnet_conditioning_channel_order` "bgr" flips the image's channels as diffusers. Not implemented:
ControlNet-Union / XS variants.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.models.attention import AttentionSettings
from meshserve.models.checkpoints.loading import (
    abstract_module,
    load_weights,
    read_component_weights,
    read_json,
)
from meshserve.models.components.layers import conv2d
from meshserve.models.sdxl.unet_2d_condition import UNet2DConditionConfig, UNetEncoder

__all__ = ["ControlNetConfig", "ControlNetModel", "load_controlnet"]

_UP = {"DownBlock2D": "UpBlock2D", "CrossAttnDownBlock2D": "CrossAttnUpBlock2D"}
_DEFAULT_DOWN = ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",)  # diffusers' ControlNetModel default


@dataclass(frozen=True)
class ControlNetConfig:
    unet: UNet2DConditionConfig  # the way down's config (its up_block_types mirror the down ones, unused)
    conditioning_channels: int = 3
    conditioning_embedding_out_channels: tuple[int, ...] = (16, 32, 96, 256)
    controlnet_conditioning_channel_order: str = "rgb"
    global_pool_conditions: bool = False

    @classmethod
    def from_config(cls, config: dict) -> ControlNetConfig:
        """From a diffusers controlnet/config.json dict; absent keys take diffusers' defaults."""
        order = config.get("controlnet_conditioning_channel_order", "rgb")
        if order not in ("rgb", "bgr"):
            raise ValueError(f"ControlNetModel: unknown controlnet_conditioning_channel_order {order!r}")
        down = config.get("down_block_types", _DEFAULT_DOWN)
        unet = UNet2DConditionConfig.from_config(
            {**config, "up_block_types": [_UP.get(t, t) for t in reversed(down)], "out_channels": 4}
        )
        names = {f.name for f in dataclasses.fields(cls)} - {"unet"}
        own = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in names}
        return cls(unet=unet, **own)


class ControlNetConditioningEmbedding(nnx.Module):
    def __init__(
        self, embedding_channels: int, conditioning_channels: int, channels, *, dtype, rngs: nnx.Rngs
    ):
        self.conv_in = conv2d(conditioning_channels, channels[0], 3, padding=1, dtype=dtype, rngs=rngs)
        blocks = []
        for c_in, c_out in zip(channels[:-1], channels[1:], strict=True):
            blocks.append(conv2d(c_in, c_in, 3, padding=1, dtype=dtype, rngs=rngs))
            blocks.append(conv2d(c_in, c_out, 3, padding=1, stride=2, dtype=dtype, rngs=rngs))
        self.blocks = nnx.List(blocks)
        self.conv_out = conv2d(channels[-1], embedding_channels, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, x):  # [B, H, W, C] -> [B, H / 2^k, W / 2^k, embedding_channels]
        x = jax.nn.silu(self.conv_in(x))
        for block in self.blocks:
            x = jax.nn.silu(block(x))
        return self.conv_out(x)


class ControlNetModel(UNetEncoder):
    def __init__(
        self,
        config: ControlNetConfig,
        *,
        settings: AttentionSettings | None = None,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        super().__init__(config.unet, settings=settings, dtype=dtype, rngs=rngs)
        self.controlnet_config = config
        channels = list(config.unet.block_out_channels)
        self.controlnet_cond_embedding = ControlNetConditioningEmbedding(
            channels[0],
            config.conditioning_channels,
            list(config.conditioning_embedding_out_channels),
            dtype=dtype,
            rngs=rngs,
        )
        # One 1x1 conv per skip: conv_in's output, then per level its resnets' and (but the last) downsampler's.
        skips = [channels[0]]
        for i, layers in enumerate(config.unet.per_block("layers_per_block")):
            skips += [channels[i]] * (layers + (i < len(channels) - 1))
        self.controlnet_down_blocks = nnx.List([conv2d(c, c, 1, dtype=dtype, rngs=rngs) for c in skips])
        self.controlnet_mid_block = conv2d(channels[-1], channels[-1], 1, dtype=dtype, rngs=rngs)

    def __call__(
        self,
        sample,
        timestep,
        encoder_hidden_states,
        controlnet_cond,
        conditioning_scale=1.0,
        text_embeds=None,
        time_ids=None,
        guess_mode=False,
    ):
        """sample [B, h, w, C] latents, timestep [B] or scalar, encoder_hidden_states [B, S, D],
        controlnet_cond [B, H, W, 3] in [0, 1] (H = h x the VAE's factor), conditioning_scale and guess_mode a
        scalar or [B] -> (the residuals of the UNet's skips, [B, ...] each; the mid block's residual), in the
        UNet's dtype ([B, 1, 1, C] each with global_pool_conditions)."""
        batch = sample.shape[0]
        emb = self._embed_time(timestep, batch, text_embeds, time_ids)
        context = encoder_hidden_states.astype(self.dtype)
        cond = controlnet_cond.astype(self.dtype)
        if self.controlnet_config.controlnet_conditioning_channel_order == "bgr":
            cond = cond[..., ::-1]
        x = self.conv_in(sample.astype(self.dtype)) + self.controlnet_cond_embedding(cond)
        skips = [x]
        for block in self.down_blocks:
            x, block_skips = block(x, emb, context)
            skips += list(block_skips)
        if self.mid_block is not None:
            x = self.mid_block(x, emb, context)
        residuals = [conv(s) for conv, s in zip(self.controlnet_down_blocks, skips, strict=True)]
        residuals.append(self.controlnet_mid_block(x))
        scales = self._scales(conditioning_scale, guess_mode, len(residuals))
        residuals = [
            r * scales[:, k].reshape(-1, 1, 1, 1).astype(self.dtype) for k, r in enumerate(residuals)
        ]
        if self.controlnet_config.global_pool_conditions:
            residuals = [jnp.mean(r, axis=(1, 2), keepdims=True) for r in residuals]
        return residuals[:-1], residuals[-1]

    def _scales(self, conditioning_scale, guess_mode, count: int):
        """[B or 1, count] float32: each residual's factor, per row (diffusers computes them in float32)."""
        scale = jnp.asarray(conditioning_scale, jnp.float32).reshape(-1, 1)
        if self.controlnet_config.global_pool_conditions:
            return scale * jnp.ones((1, count), jnp.float32)
        ramp = jnp.asarray(10.0 ** np.linspace(-1.0, 0.0, count), jnp.float32)  # torch.logspace(-1, 0, count)
        guess = jnp.asarray(guess_mode).reshape(-1, 1) > 0
        return jnp.where(guess, ramp[None, :], 1.0) * scale


def load_controlnet(
    folder: Path, dtype=jnp.float32, settings: AttentionSettings | None = None, place=None
) -> ControlNetModel:
    """A ControlNetModel from a diffusers `controlnet/` folder (config.json + safetensors), weights in `dtype`."""
    folder = Path(folder)
    config = ControlNetConfig.from_config(read_json(folder / "config.json"))
    dtype = jnp.dtype(dtype)
    model = abstract_module(ControlNetModel, config, settings=settings, dtype=dtype)
    load_weights(model, read_component_weights(folder), where=str(folder), dtype=dtype, place=place)
    return model

"""UNet2DConditionModel (the SD / SDXL denoiser) in Flax NNX, equal to diffusers' on the same weights.

    unet(sample [B, H, W, C], timestep [B] | scalar, encoder_hidden_states [B, S, D],
         text_embeds [B, P] | None, time_ids [B, 6] | None) -> noise prediction [B, H, W, out_channels]

NHWC throughout (diffusers is NCHW). The timestep may be int or float and is traced under jit.
`text_embeds` / `time_ids` are SDXL's micro-conditioning (addition_embed_type "text_time"); a UNet without
addition embeddings (SD 1.x / 2.x) takes neither.

Covered from diffusers' zoo: DownBlock2D / CrossAttnDownBlock2D, UNetMidBlock2DCrossAttn (or no mid block),
UpBlock2D / CrossAttnUpBlock2D, Transformer2DModel with linear or 1x1-conv projections, per-block
transformer depths (SDXL's [1, 2, 10]; nested per-layer lists with reverse_transformer_layers_per_block),
positional timestep embeddings. Anything else in a config raises at construction, naming the field.

Heads: diffusers' `attention_head_dim` is, for historical reasons, the number of heads (issue 2011 in
diffusers); the head size is channels // heads. SDXL's [5, 10, 20] at 320/640/1280 channels is 64 each.
Heads stay an explicit [B, S, H, D] reshape and q/k/v/out and the feed-forward are separate Linears, so a
tensor-parallel rules table can shard them by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
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
    LayerNorm,
    ResnetBlock2D,
    TimestepEmbedding,
    Upsample2D,
    conv2d,
    get_activation,
    linear,
    timestep_embedding,
)
from meshserve.models.engine.step_cache import before_blocks, deep_features
from meshserve.models.lora.apply import adapted

# Config values we do not implement -> the value that means "not used" (diffusers' default).
_UNSUPPORTED = {
    "class_embed_type": None,
    "num_class_embeds": None,
    "class_embeddings_concat": False,
    "encoder_hid_dim": None,
    "encoder_hid_dim_type": None,
    "dual_cross_attention": False,
    "attention_type": "default",
    "cross_attention_norm": None,
    "time_embedding_type": "positional",
}
# Logical axes of the split parameters, matched on checkpoint keys, axes in our layout (Linear kernel
# [in, out], conv kernel HWIO); models.parallel.placement maps them to mesh axes per pool.
# Tensor parallelism ("heads", "mlp" -> tensor): attention heads split q/k/v by output and to_out by input,
# so each device holds whole heads; the feed-forward's hidden units split the same way (GEGLU's value and
# gate halves alike: LinearHalves).
# FSDP ("embed" -> the pool's weights.shard_over axes, replicated without): every kernel's model-width
# dimension, which for tensor-split kernels is the one tensor leaves whole, so both combine
# (P(("data", "context"), "tensor")). Norm scales and biases stay replicated: 917,764 of SDXL-base's
# 2,567,463,684 parameters (0.036 %, 1.8 MB in bf16), and each would cost one more gather per use.
SHARDING_RULES = (
    (r"attn[12]\.to_[qkv]\.weight$", ("embed", "heads")),
    (r"attn[12]\.to_out\.0\.weight$", ("heads", "embed")),
    (r"ff\.net\.0\.proj\.weight$", ("embed", None, "mlp")),  # [in, value | gate, out]
    (r"ff\.net\.0\.proj\.bias$", (None, "mlp")),
    (r"ff\.net\.2\.weight$", ("mlp", "embed")),
    # conv_in, conv_out, resnets' conv1/conv2/conv_shortcut, down/upsamplers: output channels (conv_out's 4
    # fall back to replication, 23 KB in bf16).
    (
        r"(conv_in|conv_out|conv1|conv2|conv_shortcut|samplers\.\d+\.conv)\.weight$",
        (None, None, None, "embed"),
    ),
    # Transformer proj_in/proj_out, resnets' time_emb_proj, time and add (text_time) embeddings: input width.
    (r"(proj_in|proj_out|time_emb_proj|linear_1|linear_2)\.weight$", ("embed", None)),
    (r"(proj_in|proj_out)\.weight$", (None, None, None, "embed")),  # 1x1 convs without use_linear_projection
)

_DOWN_BLOCKS = ("DownBlock2D", "CrossAttnDownBlock2D")
_UP_BLOCKS = ("UpBlock2D", "CrossAttnUpBlock2D")


@dataclass(frozen=True)
class UNet2DConditionConfig:
    down_block_types: tuple[str, ...]
    up_block_types: tuple[str, ...]
    block_out_channels: tuple[int, ...]
    sample_size: int | tuple[int, int] | None = None
    in_channels: int = 4
    out_channels: int = 4
    center_input_sample: bool = False
    flip_sin_to_cos: bool = True
    freq_shift: float = 0
    mid_block_type: str | None = "UNetMidBlock2DCrossAttn"
    only_cross_attention: bool | tuple[bool, ...] = False
    layers_per_block: int | tuple[int, ...] = 2
    downsample_padding: int = 1
    mid_block_scale_factor: float = 1.0
    act_fn: str = "silu"
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    cross_attention_dim: int | tuple[int, ...] = 1280
    transformer_layers_per_block: int | tuple = 1
    reverse_transformer_layers_per_block: tuple | None = None
    attention_head_dim: int | tuple[int, ...] = 8
    num_attention_heads: int | tuple[int, ...] | None = None
    use_linear_projection: bool = False
    resnet_time_scale_shift: str = "default"
    addition_embed_type: str | None = None
    addition_time_embed_dim: int | None = None
    projection_class_embeddings_input_dim: int | None = None
    time_embedding_dim: int | None = None
    time_embedding_act_fn: str | None = None
    # LCM-distilled UNets: the guidance scale enters as an embedding of this width (`timestep_cond`), not CFG.
    time_cond_proj_dim: int | None = None
    timestep_post_act: str | None = None
    conv_in_kernel: int = 3
    conv_out_kernel: int = 3

    @classmethod
    def from_config(cls, config: dict) -> UNet2DConditionConfig:
        """From a diffusers unet/config.json dict; absent keys take diffusers' defaults."""
        unsupported = {k: config[k] for k, off in _UNSUPPORTED.items() if config.get(k, off) != off}
        if unsupported:
            raise ValueError(f"UNet2DConditionModel: unsupported config values {unsupported}")

        def frozen(v):
            return tuple(frozen(x) for x in v) if isinstance(v, list) else v

        names = {f.name for f in dataclasses.fields(cls)}
        cfg = cls(**{k: frozen(v) for k, v in config.items() if k in names})
        n = len(cfg.down_block_types)
        if len(cfg.up_block_types) != n or len(cfg.block_out_channels) != n:
            raise ValueError("UNet2DConditionModel: down/up_block_types, block_out_channels differ in length")
        bad = [t for t in cfg.down_block_types if t not in _DOWN_BLOCKS]
        bad += [t for t in cfg.up_block_types if t not in _UP_BLOCKS]
        if cfg.mid_block_type not in ("UNetMidBlock2DCrossAttn", None):
            bad.append(cfg.mid_block_type)
        if bad:
            raise ValueError(f"UNet2DConditionModel: unsupported block types {bad}")
        if cfg.addition_embed_type not in (None, "text_time"):
            raise ValueError(
                f"UNet2DConditionModel: unsupported addition_embed_type {cfg.addition_embed_type}"
            )
        return cfg

    def per_block(self, name: str) -> list:
        """A per-down-block list of the field `name` (an int or bool in the config means: the same for all)."""
        value = getattr(self, name)
        value = value if isinstance(value, tuple) else (value,) * len(self.down_block_types)
        if len(value) != len(self.down_block_types):
            raise ValueError(f"UNet2DConditionModel: {name} needs one entry per block, got {value}")
        return list(value)


def _per_layer(value, num_layers: int) -> list[int]:
    """transformer_layers_per_block for one block: an int for every layer or one count per layer; as in
    diffusers' blocks, a longer list is read up to num_layers."""
    if isinstance(value, int):
        return [value] * num_layers
    if len(value) < num_layers:
        raise ValueError(f"UNet2DConditionModel: {num_layers} transformer depths needed, got {list(value)}")
    return list(value[:num_layers])


# --------------------------------------------------------------------------------------------------
# Attention and the transformer


class Attention(nnx.Module):
    """diffusers' Attention as BasicTransformerBlock uses it: no q/k/v bias, output Linear at to_out[0]."""

    def __init__(
        self,
        query_dim: int,
        *,
        heads: int,
        dim_head: int,
        cross_attention_dim: int | None,
        settings: AttentionSettings,
        dtype,
        rngs: nnx.Rngs,
    ):
        inner, kv_dim = heads * dim_head, cross_attention_dim or query_dim
        self.heads, self.settings = heads, settings
        self.to_q = linear(query_dim, inner, use_bias=False, dtype=dtype, rngs=rngs)
        self.to_k = linear(kv_dim, inner, use_bias=False, dtype=dtype, rngs=rngs)
        self.to_v = linear(kv_dim, inner, use_bias=False, dtype=dtype, rngs=rngs)
        self.to_out = nnx.List([linear(inner, query_dim, dtype=dtype, rngs=rngs)])

    def __call__(self, x, context=None):
        """x: [B, S, query_dim], context: [B, Sk, kv_dim] or None (self-attention) -> [B, S, query_dim]."""
        context = x if context is None else context
        b, s, _ = x.shape
        q = self.to_q(x).reshape(b, s, self.heads, -1)  # [B, S, H, D]
        k = self.to_k(context).reshape(b, context.shape[1], self.heads, -1)  # [B, Sk, H, D]
        v = self.to_v(context).reshape(b, context.shape[1], self.heads, -1)
        out = attention(q, k, v, settings=self.settings)
        return self.to_out[0](out.reshape(b, s, -1))


class LinearHalves(nnx.Module):
    """A Linear whose output is two halves, kept as [in, 2, out] (loaded from the checkpoint's [2 out, in]).

    GEGLU's projection holds [value | gate]. As one [in, 2 out] kernel split over `tensor`, the values landed
    on one device and the gates on another, and XLA moved half the activations to pair them: 44 permutes,
    64 MiB per device per step, 40 % of cfg2 x tensor2's traffic at 1024x1024. With the halves on their own
    axis, `tensor` splits `out` in both at once and each device pairs its own values and gates.
    """

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        init = nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))
        self.halves_kernel = nnx.Param(init(rngs.params(), (in_features, 2, out_features), dtype))
        self.halves_bias = nnx.Param(jnp.zeros((2, out_features), dtype))

    def __call__(self, x):  # [..., in] -> ([..., out], [..., out])
        y = (
            jnp.einsum("...i,ito->...to", x.astype(self.dtype), self.halves_kernel[...])
            + self.halves_bias[...]
        )
        y = adapted(self, x, y)  # LoRA on ff.net.0.proj: [value | gate] rows, as the checkpoint's
        return y[..., 0, :], y[..., 1, :]


class GEGLU(nnx.Module):
    def __init__(self, dim_in: int, dim_out: int, *, dtype, rngs: nnx.Rngs):
        self.proj = LinearHalves(dim_in, dim_out, dtype=dtype, rngs=rngs)  # the checkpoint's ff.net.0.proj

    def __call__(self, x):
        value, gate = self.proj(x)
        return value * jax.nn.gelu(gate, approximate=False)


class FeedForward(nnx.Module):
    def __init__(self, dim: int, *, mult: int = 4, dtype, rngs: nnx.Rngs):
        inner = dim * mult
        # Dropout (rate 0: the identity) keeps index 1 so the output Linear keeps its key `ff.net.2`.
        geglu, out = GEGLU(dim, inner, dtype=dtype, rngs=rngs), linear(inner, dim, dtype=dtype, rngs=rngs)
        self.net = nnx.List([geglu, nnx.Dropout(0.0), out])

    def __call__(self, x):
        for layer in self.net:
            x = layer(x)
        return x


class BasicTransformerBlock(nnx.Module):
    """Pre-LN self-attention, cross-attention, GEGLU feed-forward, each with a residual."""

    def __init__(
        self,
        dim: int,
        heads: int,
        dim_head: int,
        *,
        cross_attention_dim: int,
        only_cross_attention: bool,
        norm_eps: float,
        settings: AttentionSettings,
        dtype,
        rngs: nnx.Rngs,
    ):
        self.only_cross_attention = only_cross_attention
        attn = dict(heads=heads, dim_head=dim_head, settings=settings, dtype=dtype, rngs=rngs)
        self.norm1 = LayerNorm(dim, norm_eps, dtype=dtype, rngs=rngs)
        self.attn1 = Attention(
            dim, cross_attention_dim=cross_attention_dim if only_cross_attention else None, **attn
        )
        self.norm2 = LayerNorm(dim, norm_eps, dtype=dtype, rngs=rngs)
        self.attn2 = Attention(dim, cross_attention_dim=cross_attention_dim, **attn)
        self.norm3 = LayerNorm(dim, norm_eps, dtype=dtype, rngs=rngs)
        self.ff = FeedForward(dim, dtype=dtype, rngs=rngs)

    def __call__(self, x, context):  # x: [B, S, dim], context: [B, Sk, cross_dim]
        x = x + self.attn1(self.norm1(x), context if self.only_cross_attention else None)
        x = x + self.attn2(self.norm2(x), context)
        return x + self.ff(self.norm3(x))


class Transformer2DModel(nnx.Module):
    """diffusers' Transformer2DModel on continuous input: GroupNorm, proj_in, blocks, proj_out, residual."""

    def __init__(
        self,
        heads: int,
        dim_head: int,
        in_channels: int,
        *,
        num_layers: int,
        cross_attention_dim: int,
        norm_num_groups: int,
        use_linear_projection: bool,
        only_cross_attention: bool,
        settings: AttentionSettings,
        dtype,
        rngs: nnx.Rngs,
    ):
        inner = heads * dim_head
        self.use_linear_projection = use_linear_projection
        # eps 1e-6 is hard-coded in diffusers' Transformer2DModel; the LayerNorms use its norm_eps 1e-5.
        self.norm = GroupNorm(in_channels, norm_num_groups, 1e-6, dtype=dtype, rngs=rngs)
        proj = linear if use_linear_projection else (lambda i, o, **kw: conv2d(i, o, 1, **kw))
        self.proj_in = proj(in_channels, inner, dtype=dtype, rngs=rngs)
        self.transformer_blocks = nnx.List(
            [
                BasicTransformerBlock(
                    inner,
                    heads,
                    dim_head,
                    cross_attention_dim=cross_attention_dim,
                    only_cross_attention=only_cross_attention,
                    norm_eps=1e-5,
                    settings=settings,
                    dtype=dtype,
                    rngs=rngs,
                )
                for _ in range(num_layers)
            ]
        )
        self.proj_out = proj(inner, in_channels, dtype=dtype, rngs=rngs)

    def __call__(self, x, context):  # x: [B, H, W, C] -> [B, H, W, C]
        b, h, w, c = x.shape
        hidden = self.norm(x)
        # A 1x1 conv and a Linear are the same map on NHWC; the order only mirrors diffusers'.
        if self.use_linear_projection:
            hidden = self.proj_in(hidden.reshape(b, h * w, c))
        else:
            hidden = self.proj_in(hidden).reshape(b, h * w, -1)
        for block in self.transformer_blocks:
            hidden = block(hidden, context)  # [B, H*W, inner]
        if self.use_linear_projection:
            hidden = self.proj_out(hidden).reshape(b, h, w, c)
        else:
            hidden = self.proj_out(hidden.reshape(b, h, w, -1))
        return hidden + x


# --------------------------------------------------------------------------------------------------
# Down, mid and up blocks. Every block takes (x, temb, context); blocks without attention ignore context.


@dataclass
class LevelArgs:
    """What diffusers' get_down_block / get_mid_block / get_up_block hand the blocks of UNet level `level`
    (0 = the highest resolution): builds their resnets and transformers with explicit arguments."""

    config: UNet2DConditionConfig
    level: int
    settings: AttentionSettings
    dtype: jnp.dtype
    rngs: nnx.Rngs
    output_scale_factor: float = 1.0
    mid_block: bool = False

    def resnet(self, in_channels: int, out_channels: int) -> ResnetBlock2D:
        cfg = self.config
        return ResnetBlock2D(
            in_channels,
            out_channels,
            cfg.time_embedding_dim or cfg.block_out_channels[0] * 4,
            eps=cfg.norm_eps,
            groups=cfg.norm_num_groups,
            act_fn=cfg.act_fn,
            output_scale_factor=self.output_scale_factor,
            time_embedding_norm=cfg.resnet_time_scale_shift,
            dtype=self.dtype,
            rngs=self.rngs,
        )

    def transformer(self, channels: int, num_layers: int) -> Transformer2DModel:
        cfg, i = self.config, self.level
        # diffusers: num_attention_heads = num_attention_heads or attention_head_dim (see the module docstring)
        heads = cfg.per_block("num_attention_heads" if cfg.num_attention_heads else "attention_head_dim")[i]
        return Transformer2DModel(
            heads,
            channels // heads,
            channels,
            num_layers=num_layers,
            cross_attention_dim=cfg.per_block("cross_attention_dim")[i],
            norm_num_groups=cfg.norm_num_groups,
            use_linear_projection=cfg.use_linear_projection,
            # diffusers' UNetMidBlock2DCrossAttn takes no only_cross_attention: its attn1 attends to itself
            only_cross_attention=not self.mid_block and cfg.per_block("only_cross_attention")[i],
            settings=self.settings,
            dtype=self.dtype,
            rngs=self.rngs,
        )


class DownBlock2D(nnx.Module):
    """Resnets (each followed by a transformer when `transformer_layers` gives their depths), then a
    stride-2 conv; every intermediate state is a skip for the up path."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        *,
        num_layers: int,
        add_downsample: bool,
        downsample_padding: int,
        args: LevelArgs,
        transformer_layers: list[int] | None = None,
    ):
        self.resnets = nnx.List(
            [args.resnet(in_channels if i == 0 else out_channels, out_channels) for i in range(num_layers)]
        )
        if transformer_layers is not None:
            self.attentions = nnx.List([args.transformer(out_channels, n) for n in transformer_layers])
        down = Downsample2D(out_channels, padding=downsample_padding, dtype=args.dtype, rngs=args.rngs)
        self.downsamplers = nnx.List([down]) if add_downsample else None

    def __call__(self, x, temb, context):
        """x: [B, H, W, Cin] -> (x [B, H', W', C], the skip states for the up path)."""
        skips = []
        for i, resnet in enumerate(self.resnets):
            x = resnet(x, temb)
            if hasattr(self, "attentions"):
                x = self.attentions[i](x, context)
            skips.append(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
            skips.append(x)
        return x, skips


class CrossAttnDownBlock2D(DownBlock2D):
    """DownBlock2D with transformers (diffusers keeps two classes; the names make the tree read the same)."""


class UNetMidBlock2DCrossAttn(nnx.Module):
    def __init__(self, channels: int, *, transformer_layers: list[int], args: LevelArgs):
        self.resnets = nnx.List([args.resnet(channels, channels) for _ in range(len(transformer_layers) + 1)])
        self.attentions = nnx.List([args.transformer(channels, n) for n in transformer_layers])

    def __call__(self, x, temb, context):  # [B, H, W, C] -> [B, H, W, C]
        x = self.resnets[0](x, temb)
        for attn, resnet in zip(self.attentions, self.resnets[1:], strict=True):
            x = resnet(attn(x, context), temb)
        return x


class UpBlock2D(nnx.Module):
    """Resnets over [x, skip] concatenated on channels (skips consumed last-first), each followed by a
    transformer when `transformer_layers` is given, then a 2x upsample."""

    def __init__(
        self,
        in_channels: int,
        prev_output_channel: int,
        out_channels: int,
        *,
        num_layers: int,
        add_upsample: bool,
        args: LevelArgs,
        transformer_layers: list[int] | None = None,
    ):
        self.resnets = nnx.List(
            [
                args.resnet(
                    (prev_output_channel if i == 0 else out_channels)
                    + (in_channels if i == num_layers - 1 else out_channels),
                    out_channels,
                )
                for i in range(num_layers)
            ]
        )
        if transformer_layers is not None:
            self.attentions = nnx.List([args.transformer(out_channels, n) for n in transformer_layers])
        up = Upsample2D(out_channels, dtype=args.dtype, rngs=args.rngs)
        self.upsamplers = nnx.List([up]) if add_upsample else None

    def __call__(self, x, temb, context, skips: list, upsample_size: tuple[int, int] | None = None):
        for i, resnet in enumerate(self.resnets):
            x = resnet(jnp.concatenate([x, skips.pop()], axis=-1), temb)
            if hasattr(self, "attentions"):
                x = self.attentions[i](x, context)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, upsample_size)
        return x


class CrossAttnUpBlock2D(UpBlock2D):
    """UpBlock2D with transformers."""


# --------------------------------------------------------------------------------------------------
# The model


class UNetEncoder(nnx.Module):
    """The UNet's way down: conv_in, the time (and SDXL's text_time) embedding, the down blocks and the mid
    block, in diffusers' attribute names. UNet2DConditionModel adds the way up; a ControlNet (models/sdxl/
    controlnet.py) is this half with its own input and output convolutions."""

    def __init__(
        self,
        config: UNet2DConditionConfig,
        *,
        settings: AttentionSettings | None = None,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        cfg, settings = config, settings or AttentionSettings()
        self.config, self.dtype = cfg, jnp.dtype(dtype)
        channels = list(cfg.block_out_channels)
        n = len(channels)
        layers = cfg.per_block("layers_per_block")
        depths = cfg.per_block("transformer_layers_per_block")
        for name in (cfg.act_fn, cfg.time_embedding_act_fn, cfg.timestep_post_act):
            if name is not None:
                get_activation(name)  # fail at construction on an unknown activation

        k = cfg.conv_in_kernel
        self.conv_in = conv2d(cfg.in_channels, channels[0], k, padding=(k - 1) // 2, dtype=dtype, rngs=rngs)
        temb = cfg.time_embedding_dim or channels[0] * 4
        self.time_embedding = TimestepEmbedding(
            channels[0],
            temb,
            act_fn=cfg.act_fn,
            post_act_fn=cfg.timestep_post_act,
            cond_proj_dim=cfg.time_cond_proj_dim,
            dtype=dtype,
            rngs=rngs,
        )
        # Optional submodules are assigned once (module or None): flax 0.12 fixes an attribute's kind then.
        self.add_embedding = (
            TimestepEmbedding(cfg.projection_class_embeddings_input_dim, temb, dtype=dtype, rngs=rngs)
            if cfg.addition_embed_type == "text_time"
            else None
        )

        down = []
        for i, kind in enumerate(cfg.down_block_types):
            cross = kind == "CrossAttnDownBlock2D"
            block = CrossAttnDownBlock2D if cross else DownBlock2D
            down.append(
                block(
                    channels[max(i - 1, 0)],
                    channels[i],
                    num_layers=layers[i],
                    add_downsample=i < n - 1,
                    downsample_padding=cfg.downsample_padding,
                    args=self.level(i, settings, rngs),
                    transformer_layers=_per_layer(depths[i], layers[i]) if cross else None,
                )
            )
        self.down_blocks = nnx.List(down)

        self.mid_block = (
            UNetMidBlock2DCrossAttn(
                channels[-1],
                transformer_layers=_per_layer(depths[-1], 1),
                args=self.level(n - 1, settings, rngs, cfg.mid_block_scale_factor, mid_block=True),
            )
            if cfg.mid_block_type == "UNetMidBlock2DCrossAttn"
            else None
        )

    def level(
        self, i: int, settings, rngs, output_scale_factor: float = 1.0, mid_block: bool = False
    ) -> LevelArgs:
        return LevelArgs(self.config, i, settings, self.dtype, rngs, output_scale_factor, mid_block)

    def _embed_time(self, timestep, batch: int, text_embeds, time_ids, timestep_cond=None):
        """The embedding every resnet receives: time (with an LCM UNet's guidance embedding, `timestep_cond`
        [B, time_cond_proj_dim]) + SDXL's text_time micro-conditioning. -> [B, T]."""
        cfg = self.config

        def sinusoids(t, dim: int):  # [N] -> [N, dim] float32
            return timestep_embedding(
                t, dim, flip_sin_to_cos=cfg.flip_sin_to_cos, downscale_freq_shift=cfg.freq_shift
            )

        t = jnp.broadcast_to(jnp.asarray(timestep, jnp.float32).reshape(-1), (batch,))
        emb = self.time_embedding(sinusoids(t, cfg.block_out_channels[0]).astype(self.dtype), timestep_cond)
        if self.add_embedding is not None:
            if text_embeds is None or time_ids is None:
                raise ValueError("this UNet (addition_embed_type='text_time') needs text_embeds and time_ids")
            time_embeds = sinusoids(time_ids.reshape(-1), cfg.addition_time_embed_dim)  # [B * 6, dim]
            add = jnp.concatenate([text_embeds.astype(jnp.float32), time_embeds.reshape(batch, -1)], axis=-1)
            emb = emb + self.add_embedding(add.astype(self.dtype))
        if cfg.time_embedding_act_fn is not None:
            emb = get_activation(cfg.time_embedding_act_fn)(emb)
        return emb


class UNet2DConditionModel(UNetEncoder):
    def __init__(
        self,
        config: UNet2DConditionConfig,
        *,
        settings: AttentionSettings | None = None,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        super().__init__(config, settings=settings, dtype=dtype, rngs=rngs)
        cfg, settings = config, settings or AttentionSettings()
        channels = list(cfg.block_out_channels)
        n = len(channels)
        layers = cfg.per_block("layers_per_block")
        rev_depths = list(
            cfg.reverse_transformer_layers_per_block
            or reversed(cfg.per_block("transformer_layers_per_block"))
        )

        rev = list(reversed(channels))
        up = []
        for i, kind in enumerate(cfg.up_block_types):
            cross, j = kind == "CrossAttnUpBlock2D", n - 1 - i  # j: the level's index on the way down
            block = CrossAttnUpBlock2D if cross else UpBlock2D
            up.append(
                block(
                    rev[min(i + 1, n - 1)],
                    rev[max(i - 1, 0)],
                    rev[i],
                    num_layers=layers[j] + 1,
                    add_upsample=i < n - 1,
                    args=self.level(j, settings, rngs),
                    transformer_layers=_per_layer(rev_depths[i], layers[j] + 1) if cross else None,
                )
            )
        self.up_blocks = nnx.List(up)
        self.num_upsamplers = n - 1

        self.conv_norm_out = GroupNorm(channels[0], cfg.norm_num_groups, cfg.norm_eps, dtype=dtype, rngs=rngs)
        k = cfg.conv_out_kernel
        self.conv_out = conv2d(channels[0], cfg.out_channels, k, padding=(k - 1) // 2, dtype=dtype, rngs=rngs)

    def __call__(
        self,
        sample,
        timestep,
        encoder_hidden_states,
        text_embeds=None,
        time_ids=None,
        timestep_cond=None,
        down_block_additional_residuals=None,
        mid_block_additional_residual=None,
    ):
        """sample [B, H, W, C], timestep [B] or scalar, encoder_hidden_states [B, S, D], text_embeds [B, P],
        time_ids [B, 6], timestep_cond [B, time_cond_proj_dim] (an LCM UNet's guidance embedding) ->
        [B, H, W, out_channels] in the dtype of `sample` (fp32 latents stay fp32). A ControlNet's outputs
        (diffusers' names): one residual per skip, added to the skips once the way down has run, and one added
        to the mid block's output."""
        extra = list(down_block_additional_residuals or [])
        batch, height, width = sample.shape[:3]
        emb = self._embed_time(timestep, batch, text_embeds, time_ids, timestep_cond)
        context = encoder_hidden_states.astype(self.dtype)
        x = sample.astype(self.dtype)
        if self.config.center_input_sample:
            x = 2 * x - 1.0

        x = self.conv_in(x)
        down, up = list(self.down_blocks), list(self.up_blocks)
        # A size that does not halve cleanly at every level: each upsample goes to its skip's size instead.
        factor = 2**self.num_upsamplers
        odd_size = height % factor != 0 or width % factor != 0

        def with_residuals(skips: list, start: int) -> list:  # a ControlNet's residuals for skips[start:]
            if not extra:
                return skips
            return [s if i < start else s + extra[i].astype(s.dtype) for i, s in enumerate(skips)]

        def blocks(x):  # conv_in's output -> the output head's input
            first, first_skips = down[0](x, emb, context)
            skips = with_residuals([x, *first_skips], 0)
            # The last up block takes the shallowest skips (conv_in's and the first down block's resnets');
            # the first down block's downsampled output goes deeper.
            shallow, deep_skips = skips[: len(up[-1].resnets)], skips[len(up[-1].resnets) :]

            def deep(x):  # the first down block's output -> the last up block's input
                skips = [*shallow, *deep_skips]
                for block in down[1:]:
                    x, block_skips = block(x, emb, context)
                    skips = with_residuals(skips + list(block_skips), len(skips))
                if self.mid_block is not None:
                    x = self.mid_block(x, emb, context)
                if mid_block_additional_residual is not None:
                    x = x + mid_block_additional_residual.astype(x.dtype)
                for block in up[:-1]:
                    block_skips = skips[-len(block.resnets) :]
                    skips = skips[: -len(block.resnets)]
                    size = tuple(skips[-1].shape[1:3]) if odd_size else None
                    x = block(x, emb, context, block_skips, size)
                return x

            # A "deep_features" step cache may reuse the deep features of an earlier step.
            x = deep_features(first, deep)
            return up[-1](x, emb, context, shallow, None)

        # A "teacache" step cache may skip every block, adding the residual they added when they last ran; its
        # signal is where the timestep first enters the UNet (the first resnet's time-conditioned state).
        # (Unused without that cache: the compiled program drops it.)
        x = before_blocks(x, down[0].resnets[0].time_conditioned(x, emb), blocks)

        x = get_activation(self.config.act_fn)(self.conv_norm_out(x))
        return self.conv_out(x).astype(sample.dtype)


def load_unet(
    folder: Path, dtype=jnp.float32, settings: AttentionSettings | None = None, place=None
) -> UNet2DConditionModel:
    """A UNet2DConditionModel from a diffusers `unet/` folder (config.json + safetensors), weights in `dtype`."""
    folder = Path(folder)
    config = UNet2DConditionConfig.from_config(read_json(folder / "config.json"))
    dtype = jnp.dtype(dtype)
    # Built abstractly: no random initialisation of ~2.6B parameters the checkpoint is about to replace.
    model = abstract_module(UNet2DConditionModel, config, settings=settings, dtype=dtype)
    load_weights(model, read_component_weights(folder), where=str(folder), dtype=dtype, place=place)
    return model

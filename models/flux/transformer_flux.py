"""FluxTransformer2DModel (the Flux.1 denoiser, an MMDiT) in Flax NNX, equal to diffusers' on the same weights.

    rope = flux_rope(np.concatenate([txt_ids, img_ids]), config.axes_dims_rope)      # host, float64 -> fp32
    model(hidden_states [B, S_img, in_channels], encoder_hidden_states [B, S_txt, joint_attention_dim],
          pooled_projections [B, pooled_projection_dim], timestep [B], rope, guidance [B] | None)
        -> [B, S_img, patch_size^2 * out_channels] in the dtype of `hidden_states`

Inputs are diffusers' own: packed latents, T5 states, the CLIP pooled output, `timestep` already divided by
1000 (the pipeline does; the model multiplies back after rounding to its dtype, as diffusers does), the raw
guidance scale (dev only). The position ids never enter the trace: `flux_rope` turns them into cos/sin tables
in numpy float64 on the host (as diffusers' FluxPosEmbed does in torch float64; fp32 frequencies and
angles put cos/sin off by 6.8e-6 on a 128 x 96 grid), and the model takes the [S_txt + S_img, head_dim]
fp32 tables as arrays.

Structure (diffusers `models/transformers/transformer_flux.py`, attribute names kept so checkpoint keys map by
models.loading's generic rules): x_embedder, context_embedder, time_text_embed (timestep_embedder, optional
guidance_embedder, text_embedder), `num_layers` double-stream `transformer_blocks` (image and text streams
with their own AdaLayerNormZero, projections and feed-forwards, one joint attention over [text, image]),
`num_single_layers` `single_transformer_blocks` over the concatenated stream, norm_out
(AdaLayerNormContinuous: (scale, shift) order), proj_out. One deviation from the checkpoint's names: a single
block's `proj_out` [dim, dim + mlp] is held as two Linears over its two inputs (`proj_out.from_attn`,
`proj_out.from_mlp`), split at load time, so tensor parallelism can split both the way their inputs are
split (SHARDING_RULES); the sum is the same matmul with the reduction split in two.

Precision follows diffusers with the model in `dtype`: matmuls and the residual stream in `dtype`; LayerNorm
and the QK RMSNorm in fp32 (the RMSNorm weight multiply too) cast back, as torch does for bf16; RoPE rotates
in fp32 and casts back; timestep and guidance are rounded to `dtype` before the x1000, the 256-channel
sinusoids are fp32 and cast to `dtype` before their MLPs. Activations (SiLU, tanh-GELU) compute in fp32, as
torch's bf16 kernels do internally. XLA's default excess precision may keep a fused chain of bf16 elementwise
ops in fp32 where torch rounds after each: on the tiny test model our bf16 output is 7.3e-3 from fp32, torch's
8.7e-3. Where a rounding changes the function (the timestep's), it is forced (`scaled_timestep`).

Not covered: fused q/k/v projections (diffusers' `fuse_qkv_projections` is a runtime option, checkpoints
store them apart), IP-adapter and ControlNet residuals, patch_size > 1 (Flux.1 uses 1; the packing of 2x2
latent patches into 64 channels is the pipeline's job).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.models.attention import AttentionSettings, attention
from meshserve.models.checkpoints.loading import (
    CheckpointError,
    abstract_module,
    load_weights,
    read_component_weights,
    read_json,
)
from meshserve.models.components.block_stack import block_at, run_blocks
from meshserve.models.components.layers import TimestepEmbedding, linear, timestep_embedding
from meshserve.models.engine.step_cache import after_first_block, before_blocks

# Parameter path regex (checkpoint names; our split proj_out parts) -> logical axes, in NNX layout ([in, out]
# for a Linear). models.parallel.placement maps "heads"/"mlp" to `tensor` and "embed" to the FSDP axes.
# Sizes quoted are Flux.1-dev's (dim 3072, 24 heads of 128, mlp 12288; 11.9 B parameters).
SHARDING_RULES: tuple = (
    # Attention, both streams: q/k/v column-split by heads, the outputs row-split (one all-reduce each).
    (r"attn\.(to_[qkv]|add_[qkv]_proj)\.weight$", ("embed", "heads")),
    (r"attn\.(to_[qkv]|add_[qkv]_proj)\.bias$", ("heads",)),
    (r"attn\.(to_out\.0|to_add_out)\.weight$", ("heads", "embed")),
    # Feed-forwards and the single blocks' MLP: hidden units over tensor.
    (r"(ff|ff_context)\.net\.0\.proj\.weight$", ("embed", "mlp")),
    (r"(ff|ff_context)\.net\.0\.proj\.bias$", ("mlp",)),
    (r"(ff|ff_context)\.net\.2\.weight$", ("mlp", "embed")),
    (r"proj_mlp\.weight$", ("embed", "mlp")),
    (r"proj_mlp\.bias$", ("mlp",)),
    # A single block's proj_out reads cat[attn (heads split), mlp (units split)]: one [5 dim, dim] weight
    # split in 2 contiguous row blocks would pair device 0's rows with the whole attention output and a
    # quarter of the MLP, so XLA would re-shard the 15360-wide activation every block. Held as two parts,
    # each is row-split like its input, and the two partial sums are all-reduced once (diffusers' torch TP
    # does the same with PackedRowwiseParallel). 47 M parameters x 38 blocks.
    (r"proj_out\.from_attn\.weight$", ("heads", "embed")),
    (r"proj_out\.from_mlp\.weight$", ("mlp", "embed")),
    # The AdaLayerNormZero modulation Linears [dim, 6 dim] (double) and [dim, 3 dim] (single) hold 3.2 B of
    # the 11.9 B parameters; replicated over tensor they would be a quarter of every device's weights at
    # tensor=4. Their output columns split over tensor like MLP units: the price is gathering a [B, 6 dim]
    # vector per block, negligible next to the weights.
    (r"\.(norm1|norm1_context|norm)\.linear\.weight$", ("embed", "mlp")),
    (r"\.(norm1|norm1_context|norm)\.linear\.bias$", ("mlp",)),
    # Embedders and the output head: stored split over FSDP only.
    (r"^(x_embedder|context_embedder)\.weight$", (None, "embed")),
    (r"(linear_1|linear_2)\.weight$", (None, "embed")),
    (r"^norm_out\.linear\.weight$", ("embed", None)),
    (r"^proj_out\.weight$", ("embed", None)),
)

# diffusers' FluxPosEmbed theta (fixed in FluxTransformer2DModel.__init__, not a config field).
ROPE_THETA = 10000.0


@dataclass(frozen=True)
class FluxTransformer2DConfig:
    """diffusers' FluxTransformer2DModel config (defaults: Flux.1-dev/schnell, which differ in guidance_embeds)."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)

    @classmethod
    def from_config(cls, config: dict) -> FluxTransformer2DConfig:
        """From a diffusers config.json; `_`-prefixed metadata is ignored, any other unknown field raises."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in config if not k.startswith("_") and k not in names)
        if unknown:
            raise ValueError(f"FluxTransformer2DModel config: unsupported fields {unknown}")
        values = {k: v for k, v in config.items() if k in names}
        if "axes_dims_rope" in values:
            values["axes_dims_rope"] = tuple(values["axes_dims_rope"])
        out = cls(**values)
        if out.patch_size != 1:
            raise ValueError(f"patch_size {out.patch_size} is not supported (Flux.1 uses 1)")
        if sum(out.axes_dims_rope) != out.attention_head_dim:
            raise ValueError(f"axes_dims_rope {out.axes_dims_rope} must sum to {out.attention_head_dim}")
        return out

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def output_channels(self) -> int:
        return self.patch_size * self.patch_size * (self.out_channels or self.in_channels)


# --------------------------------------------------------------------------------------------------
# Rotary position embedding (host side)


def flux_rope(ids: np.ndarray, axes_dims, theta: float = ROPE_THETA) -> tuple[np.ndarray, np.ndarray]:
    """diffusers' FluxPosEmbed: ids [S, n_axes] -> (cos, sin), each [S, sum(axes_dims)] float32.

    Per axis i, frequencies theta^(-2j/d_i) and angles pos * freq in float64, cos/sin repeated in
    interleaved pairs (each frequency rotates the pair (2j, 2j+1)), rounded to float32 at the end. The ids
    are rounded to float32 first, as diffusers' `ids.float()` does.
    """
    pos = np.asarray(ids).astype(np.float32).astype(np.float64)
    if pos.ndim != 2 or pos.shape[1] != len(axes_dims):
        raise ValueError(f"ids must be [S, {len(axes_dims)}], got {pos.shape}")
    cos, sin = [], []
    for i, dim in enumerate(axes_dims):
        freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))  # [d/2]
        angles = np.outer(pos[:, i], freqs)  # [S, d/2]
        cos.append(np.repeat(np.cos(angles), 2, axis=1))
        sin.append(np.repeat(np.sin(angles), 2, axis=1))
    return (
        np.concatenate(cos, axis=-1).astype(np.float32),
        np.concatenate(sin, axis=-1).astype(np.float32),
    )


def image_ids(height: int, width: int) -> np.ndarray:
    """The pipeline's img_ids for a packed latent grid of height x width tokens: [0, row, col], row-major."""
    ids = np.zeros((height, width, 3), np.float32)
    ids[..., 1] = np.arange(height)[:, None]
    ids[..., 2] = np.arange(width)[None, :]
    return ids.reshape(height * width, 3)


def apply_rope(x, cos, sin):
    """diffusers' apply_rotary_emb (use_real, unbind dim -1): x [B, S, H, D], cos/sin [S, D] fp32.

    Interleaved pairs: (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin), in fp32, cast back to x's dtype.
    """
    x32 = x.astype(jnp.float32)
    pairs = x32.reshape(*x.shape[:-1], -1, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x32 * cos + rotated * sin).astype(x.dtype)


def round_to(x, dtype):
    """x (fp32) rounded to `dtype`'s precision, kept fp32: a rounding XLA cannot drop.

    XLA's default excess precision drops a bf16 rounding that is followed by a cast to fp32: under jit,
    `(t.astype(bf16) * 1000).astype(f32)` gave 988.28 for t = 0.98841 and 3500 for 3.5 (measured), where
    torch gives 988.0 and 3504. `lax.reduce_precision` is never elided. The identity for fp32.
    """
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(
        jnp.asarray(x, jnp.float32), exponent_bits=info.nexp, mantissa_bits=info.nmant
    )


def scaled_timestep(t, dtype):
    """diffusers' `t.to(dtype) * 1000` (timestep and guidance), as fp32 values with dtype's two roundings.

    In bf16: 0.98841 -> 0.98828 -> 988.0, guidance 3.5 -> 3504, 5.0 -> 4992; without them the
    highest-frequency sinusoid (1 rad per unit) moves by 0.28 rad (timestep) and 4 rad (guidance). (The pipeline's own `t.to(dtype) / 1000` before this is rounded the
    same way: `round_to(round_to(t, dtype) / 1000, dtype)`.)
    """
    return round_to(round_to(t, dtype) * 1000, dtype)


# --------------------------------------------------------------------------------------------------
# Norms and small layers


def _silu(x):
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


def _gelu_tanh(x):
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


def layer_norm(x, eps: float = 1e-6):
    """torch LayerNorm without affine parameters: fp32 two-pass statistics, output in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centred = x32 - mean
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    return (centred * jax.lax.rsqrt(var + eps)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """torch.nn.RMSNorm over the last axis (the QK norm, per head): fp32 throughout, weight included."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype))  # checkpoint name: `weight`

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class AdaLayerNormZero(nnx.Module):
    """diffusers' AdaLayerNormZero: (norm(x) modulated, gate_msa, shift_mlp, scale_mlp, gate_mlp)."""

    def __init__(self, dim: int, *, dtype, rngs: nnx.Rngs):
        self.linear = linear(dim, 6 * dim, dtype=dtype, rngs=rngs)

    def __call__(self, x, emb):  # x [B, S, D], emb [B, D]
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = jnp.split(self.linear(_silu(emb)), 6, axis=-1)
        x = layer_norm(x) * (1 + scale[:, None]) + shift[:, None]
        return x, gate, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroSingle(nnx.Module):
    """diffusers' AdaLayerNormZeroSingle: (norm(x) modulated, gate)."""

    def __init__(self, dim: int, *, dtype, rngs: nnx.Rngs):
        self.linear = linear(dim, 3 * dim, dtype=dtype, rngs=rngs)

    def __call__(self, x, emb):
        shift, scale, gate = jnp.split(self.linear(_silu(emb)), 3, axis=-1)
        return layer_norm(x) * (1 + scale[:, None]) + shift[:, None], gate


class AdaLayerNormContinuous(nnx.Module):
    """diffusers' AdaLayerNormContinuous (layer_norm, no affine): the chunks are (scale, shift), in that order."""

    def __init__(self, dim: int, *, dtype, rngs: nnx.Rngs):
        self.linear = linear(dim, 2 * dim, dtype=dtype, rngs=rngs)

    def __call__(self, x, emb):
        scale, shift = jnp.split(self.linear(_silu(emb).astype(x.dtype)), 2, axis=-1)
        return layer_norm(x) * (1 + scale[:, None]) + shift[:, None]


class GELU(nnx.Module):
    """diffusers' GELU (approximate="tanh"): the projection then the activation."""

    def __init__(self, dim_in: int, dim_out: int, *, dtype, rngs: nnx.Rngs):
        self.proj = linear(dim_in, dim_out, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return _gelu_tanh(self.proj(x))


class FeedForward(nnx.Module):
    """diffusers' FeedForward(activation_fn="gelu-approximate"): keys net.0.proj and net.2."""

    def __init__(self, dim: int, *, mult: int = 4, dtype, rngs: nnx.Rngs):
        # Dropout (rate 0: the identity) keeps index 1 so the output Linear keeps its key `net.2`.
        self.net = nnx.List(
            [
                GELU(dim, dim * mult, dtype=dtype, rngs=rngs),
                nnx.Dropout(0.0),
                linear(dim * mult, dim, dtype=dtype, rngs=rngs),
            ]
        )

    def __call__(self, x):
        for layer in self.net:
            x = layer(x)
        return x


class TwoInputLinear(nnx.Module):
    """Linear over cat[a, b] held as two kernels (`from_attn` [Da, O], `from_mlp` [Db, O]) and one bias:
    a @ Wa + b @ Wb + bias, without materialising the concatenation (see SHARDING_RULES for why)."""

    def __init__(self, attn_features: int, mlp_features: int, out_features: int, *, dtype, rngs: nnx.Rngs):
        self.from_attn = linear(attn_features, out_features, use_bias=False, dtype=dtype, rngs=rngs)
        self.from_mlp = linear(mlp_features, out_features, use_bias=False, dtype=dtype, rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype))

    def __call__(self, attn_out, mlp_out):
        return self.from_attn(attn_out) + self.from_mlp(mlp_out) + self.bias[...]


class TimestepTextEmbedding(nnx.Module):
    """diffusers' CombinedTimestepTextProjEmbeddings, or with `guidance` CombinedTimestepGuidanceTextProj...

    temb = timestep_embedder(sinusoids(t)) [+ guidance_embedder(sinusoids(g))] + text_embedder(pooled); the
    text embedder (PixArtAlphaTextProjection, act silu) has the same linear_1/act/linear_2 shape and keys.
    """

    def __init__(self, dim: int, pooled_dim: int, *, guidance: bool, dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        self.timestep_embedder = TimestepEmbedding(256, dim, dtype=dtype, rngs=rngs)
        self.guidance_embedder = TimestepEmbedding(256, dim, dtype=dtype, rngs=rngs) if guidance else None
        self.text_embedder = TimestepEmbedding(pooled_dim, dim, dtype=dtype, rngs=rngs)

    def _sinusoids(self, t):  # [B] fp32 (already x1000, see scaled_timestep) -> [B, 256] in dtype
        return timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0).astype(self.dtype)

    def __call__(self, timestep, pooled, guidance=None):
        emb = self.timestep_embedder(self._sinusoids(timestep))
        if self.guidance_embedder is not None:
            emb = emb + self.guidance_embedder(self._sinusoids(guidance))
        return emb + self.text_embedder(pooled)


# --------------------------------------------------------------------------------------------------
# Attention and blocks


class FluxAttention(nnx.Module):
    """diffusers' FluxAttention with FluxAttnProcessor.

    Joint (double block, `joint=True`): the image stream's to_q/k/v and the text stream's add_q/k/v_proj,
    each QK-RMSNormed per head with its own norms, concatenated [text, image] along the sequence, rotated,
    one attention, split back, to_out.0 (image) and to_add_out (text). Single block (`joint=False`,
    diffusers' pre_only): q/k/v over the already-joined stream, no output projection (proj_out follows).
    """

    def __init__(self, dim: int, heads: int, head_dim: int, *, joint: bool, settings, dtype, rngs: nnx.Rngs):
        inner = heads * head_dim
        self.heads, self.head_dim, self.settings = heads, head_dim, settings
        self.norm_q = RMSNorm(head_dim, 1e-6, dtype=dtype)
        self.norm_k = RMSNorm(head_dim, 1e-6, dtype=dtype)
        self.to_q = linear(dim, inner, dtype=dtype, rngs=rngs)
        self.to_k = linear(dim, inner, dtype=dtype, rngs=rngs)
        self.to_v = linear(dim, inner, dtype=dtype, rngs=rngs)
        if joint:
            self.to_out = nnx.List([linear(inner, dim, dtype=dtype, rngs=rngs)])
            self.norm_added_q = RMSNorm(head_dim, 1e-6, dtype=dtype)
            self.norm_added_k = RMSNorm(head_dim, 1e-6, dtype=dtype)
            self.add_q_proj = linear(dim, inner, dtype=dtype, rngs=rngs)
            self.add_k_proj = linear(dim, inner, dtype=dtype, rngs=rngs)
            self.add_v_proj = linear(dim, inner, dtype=dtype, rngs=rngs)
            self.to_add_out = linear(inner, dim, dtype=dtype, rngs=rngs)
        self.joint = joint

    def _heads(self, x):  # [B, S, H * D] -> [B, S, H, D]
        return x.reshape(*x.shape[:2], self.heads, self.head_dim)

    def __call__(self, x, rope, context=None):
        """x [B, S, dim] (image stream, or the joined stream); context [B, S_txt, dim] for joint attention;
        rope (cos, sin) [S_total, head_dim] -> [B, S, inner] (single) or (image [B, S, dim], text)."""
        q = self.norm_q(self._heads(self.to_q(x)))
        k = self.norm_k(self._heads(self.to_k(x)))
        v = self._heads(self.to_v(x))
        if self.joint:
            q = jnp.concatenate([self.norm_added_q(self._heads(self.add_q_proj(context))), q], axis=1)
            k = jnp.concatenate([self.norm_added_k(self._heads(self.add_k_proj(context))), k], axis=1)
            v = jnp.concatenate([self._heads(self.add_v_proj(context)), v], axis=1)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v, settings=self.settings).astype(x.dtype)
        out = out.reshape(*out.shape[:2], -1)  # [B, S_total, inner]
        if not self.joint:
            return out
        s_txt = context.shape[1]
        return self.to_out[0](out[:, s_txt:]), self.to_add_out(out[:, :s_txt])


class FluxTransformerBlock(nnx.Module):
    """diffusers' FluxTransformerBlock (double stream): returns (text, image)."""

    def __init__(self, dim: int, heads: int, head_dim: int, *, settings, dtype, rngs: nnx.Rngs):
        self.norm1 = AdaLayerNormZero(dim, dtype=dtype, rngs=rngs)
        self.norm1_context = AdaLayerNormZero(dim, dtype=dtype, rngs=rngs)
        self.attn = FluxAttention(dim, heads, head_dim, joint=True, settings=settings, dtype=dtype, rngs=rngs)
        self.ff = FeedForward(dim, dtype=dtype, rngs=rngs)
        self.ff_context = FeedForward(dim, dtype=dtype, rngs=rngs)

    def __call__(self, x, context, temb, rope):
        """x [B, S_img, dim], context [B, S_txt, dim], temb [B, dim] -> (context, x)."""
        norm_x, gate, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, temb)
        norm_c, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(context, temb)
        attn_x, attn_c = self.attn(norm_x, rope, norm_c)

        x = x + gate[:, None] * attn_x
        h = layer_norm(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        x = x + gate_mlp[:, None] * self.ff(h)

        context = context + c_gate[:, None] * attn_c
        h = layer_norm(context) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        context = context + c_gate_mlp[:, None] * self.ff_context(h)
        return context, x


class FluxSingleTransformerBlock(nnx.Module):
    """diffusers' FluxSingleTransformerBlock over the joined [text, image] stream."""

    def __init__(self, dim: int, heads: int, head_dim: int, *, settings, dtype, rngs: nnx.Rngs):
        mlp = 4 * dim
        self.norm = AdaLayerNormZeroSingle(dim, dtype=dtype, rngs=rngs)
        self.proj_mlp = linear(dim, mlp, dtype=dtype, rngs=rngs)
        self.proj_out = TwoInputLinear(heads * head_dim, mlp, dim, dtype=dtype, rngs=rngs)
        self.attn = FluxAttention(
            dim, heads, head_dim, joint=False, settings=settings, dtype=dtype, rngs=rngs
        )

    def __call__(self, x, temb, rope):  # x [B, S_txt + S_img, dim] -> the same
        h, gate = self.norm(x, temb)
        mlp = _gelu_tanh(self.proj_mlp(h))
        return x + gate[:, None] * self.proj_out(self.attn(h, rope), mlp)


# --------------------------------------------------------------------------------------------------
# The model


class FluxTransformer2DModel(nnx.Module):
    scanned_blocks = ("transformer_blocks", "single_transformer_blocks")  # components/block_stack.py

    def __init__(
        self,
        config: FluxTransformer2DConfig,
        *,
        settings: AttentionSettings | None = None,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        c, settings = config, settings or AttentionSettings()
        self.config, self.dtype = c, jnp.dtype(dtype)
        dim, heads, head_dim = c.inner_dim, c.num_attention_heads, c.attention_head_dim
        kw = dict(dtype=dtype, rngs=rngs)
        self.time_text_embed = TimestepTextEmbedding(
            dim, c.pooled_projection_dim, guidance=c.guidance_embeds, **kw
        )
        self.context_embedder = linear(c.joint_attention_dim, dim, **kw)
        self.x_embedder = linear(c.in_channels, dim, **kw)
        block = dict(settings=settings, **kw)
        self.transformer_blocks = nnx.List(
            [FluxTransformerBlock(dim, heads, head_dim, **block) for _ in range(c.num_layers)]
        )
        self.single_transformer_blocks = nnx.List(
            [FluxSingleTransformerBlock(dim, heads, head_dim, **block) for _ in range(c.num_single_layers)]
        )
        self.norm_out = AdaLayerNormContinuous(dim, **kw)
        self.proj_out = linear(dim, c.output_channels, **kw)

    def rope(self, txt_ids: np.ndarray, img_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The (cos, sin) tables for the joint [text, image] sequence (host side, see `flux_rope`)."""
        return flux_rope(np.concatenate([txt_ids, img_ids], axis=0), self.config.axes_dims_rope)

    def __call__(
        self, hidden_states, encoder_hidden_states, pooled_projections, timestep, rope, guidance=None
    ):
        """hidden_states [B, S_img, in_channels], encoder_hidden_states [B, S_txt, joint_attention_dim],
        pooled_projections [B, P], timestep [B] (sigma: the pipeline's t / 1000), rope (cos, sin)
        [S_txt + S_img, head_dim] fp32, guidance [B] (guidance_embeds models only)
        -> [B, S_img, output_channels] in hidden_states' dtype."""
        if (guidance is None) == self.config.guidance_embeds:
            raise ValueError(
                "this Flux transformer "
                + ("needs a guidance value" if self.config.guidance_embeds else "has no guidance embedding")
            )
        dtype = self.dtype
        s_txt = encoder_hidden_states.shape[1]
        rope = tuple(jnp.asarray(t, jnp.float32) for t in rope)
        if rope[0].shape != (s_txt + hidden_states.shape[1], self.config.attention_head_dim):
            raise ValueError(
                f"rope tables {rope[0].shape} do not fit {s_txt} + {hidden_states.shape[1]} tokens"
            )
        timestep = scaled_timestep(timestep, dtype)
        if guidance is not None:
            guidance = scaled_timestep(guidance, dtype)
        temb = self.time_text_embed(timestep, pooled_projections.astype(dtype), guidance)
        x = self.x_embedder(hidden_states.astype(dtype))
        context = self.context_embedder(encoder_hidden_states.astype(dtype))

        joint, single = self.transformer_blocks, self.single_transformer_blocks
        first_block = block_at(joint, 0) if len(joint) else None

        def blocks(x):  # every block, on the embedded image tokens: the image tokens they end with
            first_context, first = first_block(x, context, temb, rope) if first_block else (context, x)

            def rest(x):  # the blocks after the first, on its image output
                def double(block, carry):
                    return block(carry[1], carry[0], temb, rope)

                context, x = run_blocks(joint, double, (first_context, x), start=1)
                x = jnp.concatenate([context, x], axis=1)
                x = run_blocks(single, lambda block, x: block(x, temb, rope), x)
                return x[:, s_txt:]

            return after_first_block(x, first, rest)

        # A step cache (models/engine/step_cache.py) may reuse the residual of the blocks after the first
        # ("first_block") or of all of them ("teacache", decided from the first block's modulated input).
        signal = first_block.norm1(x, temb)[0] if first_block else x
        x = before_blocks(x, signal, blocks)
        x = self.norm_out(x, temb)
        return self.proj_out(x).astype(hidden_states.dtype)


# --------------------------------------------------------------------------------------------------
# Loading

_SINGLE_PROJ_OUT = re.compile(r"^(single_transformer_blocks\.\d+\.proj_out)\.weight$")


def split_single_proj_out(state: dict[str, np.ndarray], inner_dim: int) -> dict[str, np.ndarray]:
    """The checkpoint's single-block `proj_out.weight` [dim, inner + mlp] as our two parts (views, no copy)."""
    out = {}
    for key, value in state.items():
        match = _SINGLE_PROJ_OUT.match(key)
        if match is None:
            out[key] = value
            continue
        if value.ndim != 2 or value.shape[1] <= inner_dim:
            raise CheckpointError(f"{key}: shape {value.shape} is not [dim, {inner_dim} + mlp]")
        out[f"{match[1]}.from_attn.weight"] = value[:, :inner_dim]
        out[f"{match[1]}.from_mlp.weight"] = value[:, inner_dim:]
    return out


def load_flux_transformer(
    folder: Path, dtype=jnp.float32, settings: AttentionSettings | None = None, place=None
) -> FluxTransformer2DModel:
    """A FluxTransformer2DModel from a diffusers `transformer/` folder (config.json + safetensors, single or
    sharded), weights cast to `dtype`. Raises CheckpointMismatchError naming every missing, unexpected or
    misshapen key."""
    folder = Path(folder)
    raw = read_json(folder / "config.json")
    class_name = raw.get("_class_name", "FluxTransformer2DModel")
    if class_name != "FluxTransformer2DModel":
        raise CheckpointError(f"{folder}: _class_name {class_name!r} is not FluxTransformer2DModel")
    config = FluxTransformer2DConfig.from_config(raw)
    dtype = jnp.dtype(dtype)
    model = abstract_module(FluxTransformer2DModel, config, settings=settings, dtype=dtype)
    state = split_single_proj_out(read_component_weights(folder), config.inner_dim)
    load_weights(model, state, where=str(folder), dtype=dtype, place=place)
    return model

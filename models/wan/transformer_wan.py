"""WanTransformer3DModel (the Wan 2.1 text-to-video and image-to-video denoiser) in Flax NNX, equal to diffusers'
on the same weights.

    rope = model.rope(latent_frames, latent_height, latent_width)       # host, float64 -> fp32 tables
    model(hidden_states [B, F, H, W, in_channels], timestep [B], encoder_hidden_states [B, S_txt, text_dim],
          rope, encoder_hidden_states_image [B, S_img, image_dim] (I2V only))
        -> [B, F, H, W, out_channels] in the dtype of `hidden_states`

Layout: channel-last video latents [B, F, H, W, C] in and out (diffusers' model takes and returns
[B, C, F, H, W]; the pipeline transposes once at its ends, not every step). `timestep` is the scheduler's
timestep as diffusers' pipeline passes it (UniPC's integer t in [0, 1000), or any float): no rounding to the
model dtype happens on this path (the Wan pipeline passes `t` untouched, unlike Flux's `t.to(dtype)`).

Structure (diffusers `models/transformers/transformer_wan.py`, attribute names kept so checkpoint keys map by
models.loading's generic rules):
- patch_embedding: Conv3d with kernel = stride = patch_size (1, 2, 2), computed as patchify + one matmul (the
  same sums; its kernel is stored [pt, ph, pw, C, dim] like any of our convs). Tokens are row-major over the
  (frame, row, column) patch grid, as diffusers' `flatten(2)`.
- condition_embedder (diffusers' WanTimeTextImageEmbedding): 256-channel sinusoids (flip_sin_to_cos, shift 0)
  -> time_embedder MLP -> temb; time_proj(SiLU(temb)) -> [B, 6, dim] modulation; text_embedder (linear_1,
  tanh-GELU, linear_2) on the UMT5 states; image-to-video (config image_dim): image_embedder (FP32 LayerNorm,
  erf-GELU MLP of width image_dim, FP32 LayerNorm) on the CLIP penultimate states -> the image tokens.
- `num_layers` blocks: self-attention on AdaLN-modulated LayerNorm(x) (shift, scale, gate), cross-attention
  to the text on norm2(x) (affine LayerNorm, no modulation, no gate, no mask: diffusers passes none, so the
  zero-padded text rows, which text_embedder maps to its bias path, are attended), tanh-GELU feed-forward on
  modulated LayerNorm(x) (c_shift, c_scale, c_gate). Both attentions RMS-normalise q and k over ALL heads
  (the [B, S, heads * head_dim] projection, before the head split); self-attention rotates q and k with the
  3-axis RoPE. Image-to-video (config added_kv_proj_dim): the cross-attention's normalised queries also attend
  to the image tokens through add_k_proj (then norm_added_k) / add_v_proj, and the two results are summed
  before to_out. A config with image_dim but no added_kv_proj_dim (diffusers' own I2V test model) puts the
  image tokens in front of the text and the cross-attention attends to both through to_k / to_v, as
  diffusers' forward concatenates them and its processor splits them off only for added K/V.
- Output head: (scale_shift_table + temb) chunks are (shift, scale) in that order, LayerNorm, proj_out,
  unpatchify back to [B, F, H, W, out_channels].

RoPE (diffusers' WanRotaryPosEmbed): head_dim split into t/h/w parts with h = w = 2 * (head_dim // 6) and t the
rest (128 -> 44/42/42); per axis the table for positions 0..rope_max_seq_len-1 with theta 10000, frequencies
and angles in numpy float64 (as diffusers' torch float64 buffers), cos/sin repeated in interleaved pairs and
rounded to float32; a token (f, h, w) takes rows f, h, w of the three tables. Rotation of interleaved pairs in
fp32, cast back to the activation dtype (diffusers writes the fp32 products into a tensor of q's dtype).

Precision follows diffusers' bf16 load, which honours `_keep_in_fp32_modules` = (rope, time_embedder,
scale_shift_table, norm1, norm2, norm3) (KEEP_IN_FP32 here): those weights are built and loaded in fp32 whatever
`dtype` is, the rest in `dtype`. In a block the modulation `scale_shift_table + temb.float()` is fp32, the
modulated norms are computed in fp32 and cast to `dtype` before the matmuls; the self-attention and FFN
residual adds are fp32 (`x.float() + out * gate`) rounded back to `dtype`; the cross-attention residual is a
plain add in `dtype`; norm2 is an fp32 LayerNorm with fp32 weights. The time embedder runs fp32 on the fp32
sinusoids and its output is cast to `dtype` before SiLU and time_proj (diffusers' `.type_as(text states)`).
The QK RMSNorms (not in the keep list, so their weights are `dtype`) compute in fp32 including the weight
multiply, as torch's bf16 RMSNorm does (checked: bit-equal to an all-fp32 computation rounded once).
Activations (SiLU, tanh-GELU) run in fp32 and round, as torch's bf16 kernels do internally.

Parallelism:
- Tensor (SHARDING_RULES): q/k/v column-split by heads, to_out row-split, FFN units split; the QK-RMSNorm
  weights split with the features they scale. The norm spans every head, so it is written on the global
  [B, S, inner] array and left to XLA's SPMD partitioner, which computes each device's sum of squares over
  its own heads and all-reduces that [B, S, 1] partial sum over `tensor` (a psum of the squares; features
  are never gathered). tests/models/test_transformer_wan.py checks the compiled norm keeps its output split
  and contains the all-reduce, and that tensor=2 equals one device.
- Context: self-attention goes through models.attention's `attention` (ring, Ulysses, all-gather, hybrid,
  which pads and masks a token count that does not divide). Cross-attention uses the same entry, whose rule
  for K/V shorter than `allgather_max_kv` (1024) and of another length than the queries (the 512 text
  tokens) is to keep them whole on every device: local queries x replicated text, no collective. (Should a
  video have exactly as many tokens as the text, the entry shards the text too: still exact, only slower.)
  The image tokens of I2V (257) take the same rule.

Wan 2.1 first-last-frame-to-video (FLF2V): `pos_embed_seq_len` adds a learned position embedding to the image
states, which are then both frames' CLIP states one after the other ([B, 2 x 257, image_dim]; diffusers views
its [2B, 257, D] stack as that). Wan 2.2 TI2V's per-token timesteps (diffusers' timestep [B, S]) in the one form
its image-to-video uses them: the first latent frame's tokens at `first_frame_timestep` (0: the image), the
others at `timestep`; each token's modulation is its timestep's, picked per token from the two (the same
arithmetic as diffusers' per-token embedding, without a [B, S, 6, dim] table). Fused q/k/v
projections are a runtime option in diffusers; checkpoints store them apart. diffusers builds the RMSNorm q/k norms whatever `qk_norm`
says (0.42.1), and so does this model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

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
from meshserve.models.components.layers import LayerNorm, TimestepEmbedding, linear, timestep_embedding
from meshserve.models.engine.step_cache import after_first_block, before_blocks
from meshserve.models.flux.transformer_flux import GELU, RMSNorm, apply_rope, layer_norm


class FirstFrameTimesteps(NamedTuple):
    """The modulation inputs of per-token timesteps (Wan 2.2 TI2V's image-to-video): `rest` [B, ...] for most
    tokens, `first` [B, ...] for the first latent frame's, `mask` [1, S, 1] True at those."""

    rest: jax.Array
    first: jax.Array
    mask: jax.Array


def per_token(table, timestep_proj, parts: int, axis: int = 1):
    """`table + timestep_proj` split into `parts` chunks along `axis`, fp32: [B, 1, dim] each, or, with
    FirstFrameTimesteps, [B, S, dim] each (the first frame's tokens take the first frame's)."""
    if not isinstance(timestep_proj, FirstFrameTimesteps):
        return jnp.split(table + timestep_proj.astype(jnp.float32), parts, axis=axis)
    rest = jnp.split(table + timestep_proj.rest.astype(jnp.float32), parts, axis=axis)
    first = jnp.split(table + timestep_proj.first.astype(jnp.float32), parts, axis=axis)
    return [jnp.where(timestep_proj.mask, f, r) for r, f in zip(rest, first, strict=True)]


# Parameter path regex (checkpoint names) -> logical axes, in NNX layout ([in, out] for a Linear, [pt, ph, pw,
# in, out] for the patch embedding). models.parallel.placement maps "heads"/"mlp" to `tensor` and "embed" to the
# FSDP axes. Sizes quoted are Wan 2.1 1.3B's (dim 1536, 12 heads of 128, ffn 8960; 1.42 B parameters) and 14B's
# (5120, 40 x 128, 13824).
SHARDING_RULES: tuple = (
    # Self- and cross-attention: q/k/v column-split by heads, the output row-split (one all-reduce each).
    (r"attn[12]\.to_[qkv]\.weight$", ("embed", "heads")),
    (r"attn[12]\.to_[qkv]\.bias$", ("heads",)),
    (r"attn[12]\.to_out\.0\.weight$", ("heads", "embed")),
    # Image-to-video's added K/V (cross-attention to the image tokens): split by heads like to_k/to_v; 2 x 5120^2
    # per block at 14B (2.1 B parameters over 40 blocks, 13 % of the I2V model).
    (r"attn2\.add_[kv]_proj\.weight$", ("embed", "heads")),
    (r"attn2\.add_[kv]_proj\.bias$", ("heads",)),
    # The QK RMSNorm weights [heads * head_dim] scale the features q/k are split into (see the module
    # docstring for the norm's all-reduce); norm_added_k likewise for the image keys.
    (r"attn[12]\.norm_(q|k|added_k)\.weight$", ("heads",)),
    # Feed-forward hidden units over tensor.
    (r"ffn\.net\.0\.proj\.weight$", ("embed", "mlp")),
    (r"ffn\.net\.0\.proj\.bias$", ("mlp",)),
    (r"ffn\.net\.2\.weight$", ("mlp", "embed")),
    # Embedders and the output head: stored split over FSDP only. time_proj [dim, 6 dim] is one per model
    # (14 M parameters at 1.3B), so unlike Flux's per-block modulation Linears it is not worth a tensor split.
    (r"^patch_embedding\.weight$", (None, None, None, None, "embed")),
    (r"(linear_1|linear_2)\.weight$", (None, "embed")),
    (r"^condition_embedder\.time_proj\.weight$", ("embed", None)),
    # The image embedder (I2V): 1280 -> 1280 -> 5120 at 14B, once per model.
    (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.weight$", (None, "embed")),
    (r"^condition_embedder\.image_embedder\.ff\.net\.2\.weight$", (None, "embed")),
    (r"^proj_out\.weight$", ("embed", None)),
)

# diffusers' WanTransformer3DModel._keep_in_fp32_modules: a bf16 load keeps these modules' weights in fp32. Our
# modules hold the same weights in fp32 (the blocks' norm1, norm3 and rope have no weights: their math is fp32
# anyway; the names also match the I2V image embedder's norm1/norm2, whose weights are fp32 too).
KEEP_IN_FP32 = ("rope", "time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")

# diffusers' WanRotaryPosEmbed theta (fixed in WanTransformer3DModel.__init__, not a config field).
ROPE_THETA = 10000.0

# diffusers' FP32LayerNorm default eps, which WanImageEmbedding's two norms keep (the blocks' use config.eps).
IMAGE_EMBEDDING_EPS = 1e-5


@dataclass(frozen=True)
class WanTransformer3DConfig:
    """diffusers' WanTransformer3DModel config (defaults: diffusers', i.e. the 14B model's sizes)."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int | None = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None

    @classmethod
    def from_config(cls, config: dict) -> WanTransformer3DConfig:
        """From a diffusers config.json; `_`-prefixed metadata is ignored, any other unknown field raises, and
        so does what this model does not implement (added_kv_proj_dim without image_dim: added K/V with no
        image tokens to project; a pos_embed_seq_len without image_dim)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in config if not k.startswith("_") and k not in names)
        if unknown:
            raise ValueError(f"WanTransformer3DModel config: unsupported fields {unknown}")
        values = {k: v for k, v in config.items() if k in names}
        if "patch_size" in values:
            values["patch_size"] = tuple(values["patch_size"])
        out = cls(**values)
        if out.pos_embed_seq_len is not None and out.image_dim is None:
            raise ValueError(
                f"WanTransformer3DModel config sets pos_embed_seq_len={out.pos_embed_seq_len} (first-last-frame "
                "image-to-video's image position embedding) without image_dim"
            )
        if out.image_dim is None and out.added_kv_proj_dim is not None:
            raise ValueError(
                f"WanTransformer3DModel config sets added_kv_proj_dim={out.added_kv_proj_dim} without image_dim: "
                "the added K/V project image tokens, which need the image embedder"
            )
        if out.added_kv_proj_dim is not None and out.added_kv_proj_dim != out.inner_dim:
            raise ValueError(
                f"added_kv_proj_dim {out.added_kv_proj_dim} must be the model's inner dim {out.inner_dim}: the "
                "added K/V project the image embedder's output, which has that width"
            )
        if len(out.patch_size) != 3:
            raise ValueError(f"patch_size must have 3 entries (t, h, w), got {out.patch_size}")
        t, h, w = wan_rope_dims(out.attention_head_dim)
        if min(t, h, w) <= 0 or t % 2:
            raise ValueError(f"attention_head_dim {out.attention_head_dim} gives RoPE parts {(t, h, w)}")
        return out

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def output_channels(self) -> int:
        return self.out_channels or self.in_channels

    @property
    def image_to_video(self) -> bool:
        """Whether the model takes CLIP image states (Wan 2.1 I2V: image_dim, with added K/V projections)."""
        return self.image_dim is not None

    @property
    def image_in_context(self) -> bool:
        """Image tokens without added K/V: they join the text in front as the cross-attention's context."""
        return self.image_dim is not None and self.added_kv_proj_dim is None


# --------------------------------------------------------------------------------------------------
# Rotary position embedding (host side)


def wan_rope_dims(head_dim: int) -> tuple[int, int, int]:
    """diffusers' split of a head into frame/row/column RoPE parts: h = w = 2 * (head_dim // 6), t the rest."""
    h = w = 2 * (head_dim // 6)
    return head_dim - h - w, h, w


def wan_rope(
    grid: tuple[int, int, int], head_dim: int, max_seq_len: int, theta: float = ROPE_THETA
) -> tuple[np.ndarray, np.ndarray]:
    """diffusers' WanRotaryPosEmbed for a (frames, rows, columns) patch grid -> (cos, sin), each
    [frames * rows * columns, head_dim] float32, tokens row-major over the grid.

    Per axis part of size d: frequencies theta^(-2j/d) and angles pos * freq for pos in 0..max_seq_len-1 in
    float64, cos/sin repeated in interleaved pairs (each frequency rotates the pair (2j, 2j+1)), rounded to
    float32 (diffusers' `.float()`); token (f, h, w) concatenates row f, h and w of the three parts.
    """
    if any(n > max_seq_len for n in grid):
        raise ValueError(f"patch grid {tuple(grid)} exceeds rope_max_seq_len {max_seq_len}")
    cos_parts, sin_parts = [], []
    positions = np.arange(max_seq_len, dtype=np.float64)
    for axis, (n, dim) in enumerate(zip(grid, wan_rope_dims(head_dim), strict=True)):
        freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))  # [d/2]
        angles = np.outer(positions, freqs)[:n]  # [n, d/2]
        shape = [1, 1, 1, dim]
        shape[axis] = n
        for parts, fn in ((cos_parts, np.cos), (sin_parts, np.sin)):
            table = np.repeat(fn(angles), 2, axis=1).astype(np.float32).reshape(shape)
            parts.append(np.broadcast_to(table, (*grid, dim)))
    tokens = math.prod(grid)
    return (
        np.concatenate(cos_parts, axis=-1).reshape(tokens, head_dim),
        np.concatenate(sin_parts, axis=-1).reshape(tokens, head_dim),
    )


# --------------------------------------------------------------------------------------------------
# Small layers


def _silu(x):
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


def _gelu_tanh(x):
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


class PatchEmbed3D(nnx.Module):
    """diffusers' `nn.Conv3d(in, dim, kernel_size=patch, stride=patch)` on channel-last video.

    With kernel = stride the convolution is one matmul per non-overlapping patch: the video is cut into
    [B, tokens, pt * ph * pw * C] patches (tokens row-major over the patch grid) and multiplied by the kernel
    [pt, ph, pw, C, dim] flattened the same way.
    """

    def __init__(
        self, in_channels: int, dim: int, patch_size: tuple[int, int, int], *, dtype, rngs: nnx.Rngs
    ):
        self.patch_size = tuple(patch_size)
        shape = (*self.patch_size, in_channels, dim)
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), shape, dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))

    def __call__(self, x):  # [B, F, H, W, C] -> [B, F/pt * H/ph * W/pw, dim]
        b, f, h, w, c = x.shape
        pt, ph, pw = self.patch_size
        x = x.reshape(b, f // pt, pt, h // ph, ph, w // pw, pw, c)
        x = x.transpose(0, 1, 3, 5, 2, 4, 6, 7).reshape(b, -1, pt * ph * pw * c)
        kernel = self.kernel[...]
        return x @ kernel.reshape(-1, kernel.shape[-1]) + self.bias[...]


class TextProjection(nnx.Module):
    """diffusers' PixArtAlphaTextProjection(act_fn="gelu_tanh"): linear_1 -> tanh-GELU -> linear_2."""

    def __init__(self, in_features: int, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.linear_1 = linear(in_features, hidden_size, dtype=dtype, rngs=rngs)
        self.linear_2 = linear(hidden_size, hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.linear_2(_gelu_tanh(self.linear_1(x)))


class ExactGELU(nnx.Module):
    """diffusers' GELU (approximate="none"): the projection, then the erf GELU in fp32, rounded."""

    def __init__(self, dim_in: int, dim_out: int, *, dtype, rngs: nnx.Rngs):
        self.proj = linear(dim_in, dim_out, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = self.proj(x)
        return jax.nn.gelu(x.astype(jnp.float32), approximate=False).astype(x.dtype)


class WanImageFeedForward(nnx.Module):
    """diffusers' FeedForward(in, out, mult=1, activation_fn="gelu"): net.0.proj, erf GELU, net.2."""

    def __init__(self, dim: int, dim_out: int, *, dtype, rngs: nnx.Rngs):
        # Dropout (rate 0: the identity) keeps index 1 so the output Linear keeps its key `net.2`.
        self.net = nnx.List(
            [
                ExactGELU(dim, dim, dtype=dtype, rngs=rngs),
                nnx.Dropout(0.0),
                linear(dim, dim_out, dtype=dtype, rngs=rngs),
            ]
        )

    def __call__(self, x):
        for layer in self.net:
            x = layer(x)
        return x


class WanImageEmbedding(nnx.Module):
    """diffusers' WanImageEmbedding (Wan 2.1 I2V): [+ pos_embed] -> norm1 -> FeedForward(mult=1, erf GELU) ->
    norm2.

    The CLIP states [B, 257, image_dim] become [B, 257, dim] image tokens for the blocks' added K/V. norm1/norm2
    are diffusers' FP32LayerNorm (eps 1e-5, affine): fp32 statistics and weights (their names are in
    KEEP_IN_FP32, so a bf16 load keeps them fp32), output in the input's dtype; the FF runs in `dtype`.
    FLF2V (`pos_embed_seq_len`): the states are both frames' [B, 2 x 257, image_dim], plus a learned
    pos_embed [1, 2 x 257, image_dim] in `dtype` (not in diffusers' fp32 list).
    """

    def __init__(self, in_features: int, out_features: int, pos_embed_seq_len=None, *, dtype, rngs: nnx.Rngs):
        self.norm1 = LayerNorm(in_features, IMAGE_EMBEDDING_EPS, dtype=jnp.float32, rngs=rngs)
        self.ff = WanImageFeedForward(in_features, out_features, dtype=dtype, rngs=rngs)
        self.norm2 = LayerNorm(out_features, IMAGE_EMBEDDING_EPS, dtype=jnp.float32, rngs=rngs)
        self.pos_embed = (
            nnx.Param(jnp.zeros((1, pos_embed_seq_len, in_features), dtype))
            if pos_embed_seq_len is not None
            else None
        )

    def __call__(self, x):  # [B, S_img, image_dim] -> [B, S_img, dim], x's dtype
        if self.pos_embed is not None:
            if x.shape[1] != self.pos_embed.shape[1]:
                raise ValueError(
                    f"first-last-frame image states: expected {self.pos_embed.shape[1]} tokens (both frames'), "
                    f"got {x.shape[1]}"
                )
            x = x + self.pos_embed[...].astype(x.dtype)
        return self.norm2(self.ff(self.norm1(x)))


class WanTimeTextImageEmbedding(nnx.Module):
    """diffusers' WanTimeTextImageEmbedding.

    timestep [B] -> sinusoids [B, freq_dim] fp32 -> time_embedder (fp32 weights: KEEP_IN_FP32) -> temb, cast to
    `dtype`; time_proj(SiLU(temb)) -> the blocks' modulation [B, 6 dim]; text_embedder(text states); with
    `image_dim` (image-to-video) image_embedder(CLIP states).
    """

    def __init__(
        self,
        dim: int,
        freq_dim: int,
        text_dim: int,
        image_dim: int | None,
        pos_embed_seq_len: int | None = None,
        *,
        dtype,
        rngs: nnx.Rngs,
    ):
        self.freq_dim, self.dtype = freq_dim, dtype
        self.time_embedder = TimestepEmbedding(freq_dim, dim, dtype=jnp.float32, rngs=rngs)
        self.time_proj = linear(dim, 6 * dim, dtype=dtype, rngs=rngs)
        self.text_embedder = TextProjection(text_dim, dim, dtype=dtype, rngs=rngs)
        self.image_embedder = (
            WanImageEmbedding(image_dim, dim, pos_embed_seq_len, dtype=dtype, rngs=rngs)
            if image_dim is not None
            else None
        )

    def __call__(self, timestep, encoder_hidden_states, encoder_hidden_states_image=None):
        """-> (temb [B, dim], timestep_proj [B, 6 dim], text [B, S_txt, dim], image [B, S_img, dim] or None),
        all in `dtype`."""
        image = None
        if encoder_hidden_states_image is not None:
            image = self.image_embedder(encoder_hidden_states_image)
        return *self.time(timestep), self.text_embedder(encoder_hidden_states), image

    def time(self, timestep):
        """timestep [B] -> (temb [B, dim], timestep_proj [B, 6 dim]) in `dtype`."""
        sinusoids = timestep_embedding(
            jnp.asarray(timestep), self.freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0
        )
        temb = self.time_embedder(sinusoids).astype(self.dtype)
        return temb, self.time_proj(_silu(temb))


class WanFeedForward(nnx.Module):
    """diffusers' FeedForward(dim, inner_dim=ffn_dim, activation_fn="gelu-approximate"): net.0.proj, net.2."""

    def __init__(self, dim: int, ffn_dim: int, *, dtype, rngs: nnx.Rngs):
        # Dropout (rate 0: the identity) keeps index 1 so the output Linear keeps its key `net.2`.
        self.net = nnx.List(
            [
                GELU(dim, ffn_dim, dtype=dtype, rngs=rngs),
                nnx.Dropout(0.0),
                linear(ffn_dim, dim, dtype=dtype, rngs=rngs),
            ]
        )

    def __call__(self, x):
        for layer in self.net:
            x = layer(x)
        return x


# --------------------------------------------------------------------------------------------------
# Attention and blocks


class WanAttention(nnx.Module):
    """diffusers' WanAttention with WanAttnProcessor.

    q from x, k/v from `context` (cross-attention) or x (self-attention); q and k RMS-normalised over all heads
    ([B, S, heads * head_dim], before the head split); RoPE on q and k when tables are given (self-attention);
    attention with the default 1/sqrt(head_dim) scale and no mask; to_out.0.

    With `added_kv_proj_dim` (Wan 2.1 I2V's cross-attention) the same normalised queries also attend to the
    image tokens through their own projections (add_k_proj, add_v_proj; norm_added_k over all heads, no norm
    on the values), and the two attention outputs are summed (in the activation dtype, as diffusers' two
    `type_as(query)` results) before to_out. diffusers passes the image tokens as the first
    `S - 512` rows of one context; they come apart here, so any text length works.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        eps: float,
        *,
        added_kv_proj_dim: int | None = None,
        settings,
        dtype,
        rngs: nnx.Rngs,
    ):
        inner = heads * head_dim
        self.heads, self.head_dim, self.settings = heads, head_dim, settings
        self.to_q = linear(dim, inner, dtype=dtype, rngs=rngs)
        self.to_k = linear(dim, inner, dtype=dtype, rngs=rngs)
        self.to_v = linear(dim, inner, dtype=dtype, rngs=rngs)
        self.to_out = nnx.List([linear(inner, dim, dtype=dtype, rngs=rngs)])
        self.norm_q = RMSNorm(inner, eps, dtype=dtype)
        self.norm_k = RMSNorm(inner, eps, dtype=dtype)
        if added_kv_proj_dim is not None:
            self.add_k_proj = linear(added_kv_proj_dim, inner, dtype=dtype, rngs=rngs)
            self.add_v_proj = linear(added_kv_proj_dim, inner, dtype=dtype, rngs=rngs)
            self.norm_added_k = RMSNorm(inner, eps, dtype=dtype)
        else:
            self.add_k_proj = self.add_v_proj = self.norm_added_k = None

    def _heads(self, x):  # [B, S, H * D] -> [B, S, H, D]
        return x.reshape(*x.shape[:2], self.heads, self.head_dim)

    def __call__(self, x, context=None, rope=None, image=None):
        """x [B, S, dim]; context [B, S_txt, dim] or None (self-attention); rope (cos, sin) [S, head_dim];
        image [B, S_img, dim] (the image embedder's tokens; a model with added K/V only)."""
        source = x if context is None else context
        q = self._heads(self.norm_q(self.to_q(x)))
        k = self._heads(self.norm_k(self.to_k(source)))
        v = self._heads(self.to_v(source))
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v, settings=self.settings).astype(x.dtype)
        if image is not None:
            # The image tokens (257 for ViT-H/14) are short K/V: the attention entry keeps them whole on every
            # device, as the text (module docstring, Parallelism).
            k_img = self._heads(self.norm_added_k(self.add_k_proj(image)))
            v_img = self._heads(self.add_v_proj(image))
            out = out + attention(q, k_img, v_img, settings=self.settings).astype(x.dtype)
        return self.to_out[0](out.reshape(*out.shape[:2], -1))


class WanTransformerBlock(nnx.Module):
    """diffusers' WanTransformerBlock (module docstring: precision of each step)."""

    def __init__(self, config: WanTransformer3DConfig, *, settings, dtype, rngs: nnx.Rngs):
        c = config
        dim, heads, head_dim = c.inner_dim, c.num_attention_heads, c.attention_head_dim
        self.eps = c.eps
        kw = dict(settings=settings, dtype=dtype, rngs=rngs)
        self.attn1 = WanAttention(dim, heads, head_dim, c.eps, **kw)
        self.attn2 = WanAttention(dim, heads, head_dim, c.eps, added_kv_proj_dim=c.added_kv_proj_dim, **kw)
        # norm2 is in KEEP_IN_FP32: an affine fp32 LayerNorm with fp32 weights; diffusers' Identity without
        # cross_attn_norm. norm1 and norm3 have no weights (functional layer_norm below).
        self.norm2 = LayerNorm(dim, c.eps, dtype=jnp.float32, rngs=rngs) if c.cross_attn_norm else None
        self.ffn = WanFeedForward(dim, c.ffn_dim, dtype=dtype, rngs=rngs)
        self.scale_shift_table = nnx.Param(
            jax.random.normal(rngs.params(), (1, 6, dim), jnp.float32) / dim**0.5
        )

    def modulated_input(self, x, timestep_proj):
        """(norm1(x) shifted and scaled by the timestep, in x's dtype; the fp32 gate of self-attention and the
        feed-forward's shift, scale and gate): what the block's self-attention sees."""
        # [B, 1, dim] fp32 each ([B, S, dim] with per-token timesteps)
        shift, scale, gate, c_shift, c_scale, c_gate = per_token(
            self.scale_shift_table[...], timestep_proj, 6
        )
        h = (layer_norm(x.astype(jnp.float32), self.eps) * (1 + scale) + shift).astype(x.dtype)
        return h, gate, c_shift, c_scale, c_gate

    def __call__(self, x, context, timestep_proj, rope, image=None):
        """x [B, S, dim], context [B, S_txt, dim], timestep_proj [B, 6, dim] (or FirstFrameTimesteps of them),
        image [B, S_img, dim] or None -> [B, S, dim] (x's dtype)."""
        dtype = x.dtype
        h, gate, c_shift, c_scale, c_gate = self.modulated_input(x, timestep_proj)
        x = (x.astype(jnp.float32) + self.attn1(h, rope=rope).astype(jnp.float32) * gate).astype(dtype)

        h = x if self.norm2 is None else self.norm2(x.astype(jnp.float32)).astype(dtype)
        x = x + self.attn2(h, context, image=image)

        h = (layer_norm(x.astype(jnp.float32), self.eps) * (1 + c_scale) + c_shift).astype(dtype)
        return (x.astype(jnp.float32) + self.ffn(h).astype(jnp.float32) * c_gate).astype(dtype)


# --------------------------------------------------------------------------------------------------
# The model


class WanTransformer3DModel(nnx.Module):
    scanned_blocks = ("blocks",)  # components/block_stack.py

    def __init__(
        self,
        config: WanTransformer3DConfig,
        *,
        settings: AttentionSettings | None = None,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        c, settings = config, settings or AttentionSettings()
        self.config, self.dtype = c, jnp.dtype(dtype)
        dim = c.inner_dim
        kw = dict(dtype=dtype, rngs=rngs)
        self.patch_embedding = PatchEmbed3D(c.in_channels, dim, c.patch_size, **kw)
        self.condition_embedder = WanTimeTextImageEmbedding(
            dim, c.freq_dim, c.text_dim, c.image_dim, c.pos_embed_seq_len, **kw
        )
        self.blocks = nnx.List([WanTransformerBlock(c, settings=settings, **kw) for _ in range(c.num_layers)])
        self.proj_out = linear(dim, c.output_channels * math.prod(c.patch_size), **kw)
        self.scale_shift_table = nnx.Param(
            jax.random.normal(rngs.params(), (1, 2, dim), jnp.float32) / dim**0.5
        )

    def patch_grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The (frames, rows, columns) token grid of a [*, frames, height, width, *] latent video."""
        patch = self.config.patch_size
        if frames % patch[0] or height % patch[1] or width % patch[2]:
            raise ValueError(
                f"latent video {frames} x {height} x {width} does not divide into patches {patch}"
            )
        return frames // patch[0], height // patch[1], width // patch[2]

    def rope(self, frames: int, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The (cos, sin) tables [tokens, head_dim] for a latent video of this size (host side: `wan_rope`)."""
        return wan_rope(
            self.patch_grid(frames, height, width),
            self.config.attention_head_dim,
            self.config.rope_max_seq_len,
        )

    def __call__(
        self,
        hidden_states,
        timestep,
        encoder_hidden_states,
        rope,
        encoder_hidden_states_image=None,
        first_frame_timestep=None,
    ):
        """hidden_states [B, F, H, W, in_channels], timestep [B], encoder_hidden_states [B, S_txt, text_dim],
        rope (cos, sin) [tokens, head_dim] fp32 (`rope(F, H, W)`), encoder_hidden_states_image
        [B, S_img, image_dim] (image-to-video models only: the CLIP penultimate states), first_frame_timestep
        [B] (Wan 2.2 TI2V's image-to-video: the first latent frame's tokens' timestep) -> [B, F, H, W,
        out_channels] in hidden_states' dtype."""
        c, dtype = self.config, self.dtype
        b, frames, height, width, channels = hidden_states.shape
        if channels != c.in_channels:
            raise ValueError(f"hidden_states has {channels} channels, the model takes {c.in_channels}")
        if (encoder_hidden_states_image is None) == c.image_to_video:
            raise ValueError(
                "an image-to-video model (image_dim) needs encoder_hidden_states_image"
                if c.image_to_video
                else "encoder_hidden_states_image given to a text-to-video model (no image_dim)"
            )
        grid = self.patch_grid(frames, height, width)
        rope = tuple(jnp.asarray(t, jnp.float32) for t in rope)
        if rope[0].shape != (math.prod(grid), c.attention_head_dim):
            raise ValueError(f"rope tables {rope[0].shape} do not fit the {grid} patch grid")

        x = self.patch_embedding(hidden_states.astype(dtype))
        image = encoder_hidden_states_image
        temb, timestep_proj, context, image = self.condition_embedder(
            timestep, encoder_hidden_states.astype(dtype), None if image is None else image.astype(dtype)
        )
        timestep_proj = timestep_proj.reshape(b, 6, -1)
        if first_frame_timestep is not None:
            if c.patch_size[0] != 1:  # diffusers' mask is per latent frame: one token frame per latent frame
                raise ValueError("first_frame_timestep needs a temporal patch of 1")
            temb_first, proj_first = self.condition_embedder.time(first_frame_timestep)
            mask = (jnp.arange(math.prod(grid)) < grid[1] * grid[2])[None, :, None]  # [1, S, 1]
            temb = FirstFrameTimesteps(temb[:, None], temb_first[:, None], mask)
            timestep_proj = FirstFrameTimesteps(timestep_proj, proj_first.reshape(b, 6, -1), mask)
        if c.image_in_context:  # diffusers: concat([image, text]) as the context (the module docstring)
            context, image = jnp.concatenate([image, context], axis=1), None
        first_block = block_at(self.blocks, 0)

        def all_blocks(x):
            def rest(x):
                return run_blocks(
                    self.blocks, lambda block, x: block(x, context, timestep_proj, rope, image), x, start=1
                )

            return after_first_block(x, first_block(x, context, timestep_proj, rope, image), rest)

        # A step cache (models/engine/step_cache.py) may reuse the residual of the blocks after the first
        # ("first_block") or of all of them ("teacache", decided from the first block's modulated input).
        x = before_blocks(x, first_block.modulated_input(x, timestep_proj)[0], all_blocks)

        # Output head: the chunks are (shift, scale), fp32 (the fp32 table promotes temb).
        if not isinstance(temb, FirstFrameTimesteps):
            temb = temb[:, None]
        shift, scale = per_token(self.scale_shift_table[...], temb, 2)
        x = (layer_norm(x.astype(jnp.float32), c.eps) * (1 + scale) + shift).astype(dtype)
        x = self.proj_out(x)  # [B, tokens, pt * ph * pw * out]

        pt, ph, pw = c.patch_size
        x = x.reshape(b, *grid, pt, ph, pw, c.output_channels)
        x = x.transpose(0, 1, 4, 2, 5, 3, 6, 7).reshape(b, frames, height, width, c.output_channels)
        return x.astype(hidden_states.dtype)


# --------------------------------------------------------------------------------------------------
# Loading


def _rename(key: str) -> str | None:
    # diffusers' _keys_to_ignore_on_load_unexpected: some exported checkpoints carry unused norm_added_q weights.
    return None if "norm_added_q" in key else key


def load_wan_transformer(
    folder: Path, dtype=jnp.float32, settings: AttentionSettings | None = None, place=None
) -> WanTransformer3DModel:
    """A WanTransformer3DModel from a diffusers `transformer/` folder (config.json + safetensors, single or
    sharded). Weights are cast to `dtype`, except KEEP_IN_FP32's, which stay fp32 as in diffusers' bf16 load.
    Raises CheckpointMismatchError naming every missing, unexpected or misshapen key."""
    folder = Path(folder)
    raw = read_json(folder / "config.json")
    class_name = raw.get("_class_name", "WanTransformer3DModel")
    if class_name != "WanTransformer3DModel":
        raise CheckpointError(f"{folder}: _class_name {class_name!r} is not WanTransformer3DModel")
    config = WanTransformer3DConfig.from_config(raw)
    dtype = jnp.dtype(dtype)
    model = abstract_module(WanTransformer3DModel, config, settings=settings, dtype=dtype)
    # No `dtype` to load_weights: every parameter is cast to the dtype it was built with (fp32 for the keep
    # list, `dtype` otherwise).
    load_weights(model, read_component_weights(folder), where=str(folder), rename=_rename, place=place)
    return model

"""T5-family text encoders in Flax NNX: transformers' `T5EncoderModel` (T5 v1.1, Flux's text_encoder_2) and
`UMT5EncoderModel` (Wan 2.1's text_encoder), one module since they differ in one point: T5 computes its
relative position bias in layer 0 and every later layer reuses it; UMT5 has a bias table in every layer.

Both are pre-norm encoders with T5's RMS LayerNorm (no mean subtraction, no bias, variance in fp32), attention
without 1/sqrt(d) score scaling, and a (gated) ReLU/GELU feed-forward. Attribute names mirror transformers'
module tree (`shared`, `encoder.block.{i}.layer.0.SelfAttention.q`, `...layer.1.DenseReluDense.wi_0`,
`encoder.final_layer_norm`), so a checkpoint maps by models.loading's generic rules.

Precision mirrors transformers loaded with dtype=bfloat16 (as diffusers' Flux and Wan pipelines load them):
every weight in bf16, the residual stream in bf16; each norm computes its statistics in fp32 and casts to the
weight's dtype before the scale. transformers' `_keep_in_fp32_modules = ["wo"]` is honoured for float16 only
(checked with transformers 5.23: a bf16 load keeps `wo` bf16), so `wo` follows `dtype` here too.

Shapes: input_ids [B, S] int; attention_mask [B, S] (1 = token, 0 = padding) or None; out [B, S, d_model].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.models.checkpoints.loading import (
    CheckpointError,
    abstract_module,
    load_weights,
    read_component_weights,
    read_json,
)
from meshserve.models.components.block_stack import block_at, run_blocks

# Parameter path regex -> logical axes (models.parallel.placement maps "embed" to the pool's FSDP axes and
# "heads"/"mlp" to `tensor`). T5 v1.1 XXL is 4.76 B parameters (24 layers of d_model 4096, 64 heads x 64,
# d_ff 10240), a third of Flux-dev's transformer, so unlike CLIP it is split over tensor as well.
SHARDING_RULES: tuple = (
    (r"SelfAttention\.(q|k|v)\.weight$", ("embed", "heads")),  # [d_model, heads * d_kv]
    (r"SelfAttention\.o\.weight$", ("heads", "embed")),  # [heads * d_kv, d_model]
    (r"SelfAttention\.relative_attention_bias\.weight$", (None, "heads")),  # [num_buckets, heads]
    (r"DenseReluDense\.(wi|wi_0|wi_1)\.weight$", ("embed", "mlp")),  # [d_model, d_ff]
    (r"DenseReluDense\.wo\.weight$", ("mlp", "embed")),  # [d_ff, d_model]
    # [vocab, d_model]: 32128 x 4096 = 132 M parameters for T5-XXL, 256384 x 4096 = 1.05 B for UMT5-XXL.
    (r"^shared\.weight$", (None, "embed")),
)

# transformers' ACT2FN names a T5 config's `feed_forward_proj` can yield.
_ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),  # tanh form: "gated-gelu" (T5 v1.1, UMT5)
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
}

# transformers' T5Config / UMT5Config defaults, for config.json files that omit a key.
_DEFAULTS = {
    "t5": dict(
        vocab_size=32128,
        d_model=512,
        d_kv=64,
        d_ff=2048,
        num_layers=6,
        num_heads=8,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        layer_norm_epsilon=1e-6,
        feed_forward_proj="relu",
    ),
    "umt5": dict(
        vocab_size=250112,
        d_model=512,
        d_kv=64,
        d_ff=1024,
        num_layers=8,
        num_heads=6,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        layer_norm_epsilon=1e-6,
        feed_forward_proj="gated-gelu",
    ),
}


@dataclass(frozen=True)
class T5Config:
    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_heads: int
    relative_attention_num_buckets: int
    relative_attention_max_distance: int
    layer_norm_epsilon: float
    feed_forward_proj: str
    model_type: str = "t5"  # "t5": bias table in layer 0 only; "umt5": one in every layer

    @classmethod
    def from_config(cls, config: dict) -> T5Config:
        """From a transformers T5/UMT5 config.json; `model_type` (or `architectures`) picks the variant."""
        model_type = config.get("model_type")
        if model_type is None:
            architectures = config.get("architectures") or []
            model_type = "umt5" if any(a.startswith("UMT5") for a in architectures) else "t5"
        if model_type not in _DEFAULTS:
            raise ValueError(f"model_type {model_type!r} is not a T5-family encoder ({', '.join(_DEFAULTS)})")
        out = cls(
            **{name: config.get(name, default) for name, default in _DEFAULTS[model_type].items()},
            model_type=model_type,
        )
        if out.activation not in _ACTIVATIONS:
            raise ValueError(f"unsupported feed_forward_proj {out.feed_forward_proj!r}")
        return out

    @property
    def is_gated(self) -> bool:
        return self.feed_forward_proj.split("-")[0] == "gated"

    @property
    def activation(self) -> str:
        # transformers' T5Config: "gated-gelu" means the tanh GELU ("gelu_new"), for backward compatibility.
        name = self.feed_forward_proj.split("-")[-1]
        return "gelu_new" if self.feed_forward_proj == "gated-gelu" else name

    @property
    def bias_in_every_layer(self) -> bool:
        return self.model_type == "umt5"


class T5EncoderOutput(NamedTuple):
    last_hidden_state: jax.Array  # [B, S, d_model], after final_layer_norm


# --------------------------------------------------------------------------------------------------
# Relative position buckets (host side: the sequence length is static)


def relative_position_bucket(
    relative_position: np.ndarray, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> np.ndarray:
    """transformers' `T5Attention._relative_position_bucket`, in numpy with the same float32 log and
    truncation, so every bucket is the one transformers picks (checked against it for S up to 600)."""
    relative_position = np.asarray(relative_position, np.int64)
    buckets = np.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).astype(np.int64) * num_buckets
        relative_position = np.abs(relative_position)
    else:
        relative_position = -np.minimum(relative_position, 0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    with np.errstate(divide="ignore"):  # log(0) at distance 0, which takes the is_small branch
        log_ratio = np.log(relative_position.astype(np.float32) / np.float32(max_exact)) / np.float32(
            math.log(max_distance / max_exact)
        )
    large = max_exact + np.where(is_small, 0, log_ratio * np.float32(num_buckets - max_exact)).astype(
        np.int64
    )
    large = np.minimum(large, num_buckets - 1)
    return buckets + np.where(is_small, relative_position, large)


@lru_cache(maxsize=16)
def _bucket_table(seq_len: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """[S, S] int32 bucket of (key position - query position) for the (bidirectional) encoder."""
    positions = np.arange(seq_len)
    relative = positions[None, :] - positions[:, None]
    return relative_position_bucket(
        relative, bidirectional=True, num_buckets=num_buckets, max_distance=max_distance
    ).astype(np.int32)


# --------------------------------------------------------------------------------------------------
# Blocks


class T5LayerNorm(nnx.Module):
    """RMS norm: x / sqrt(mean(x^2) + eps) * weight, statistics in fp32, then cast to the weight's dtype."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype))  # checkpoint name: `weight`

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale.get_value()
        # As transformers: the fp32 result is cast down only for a half-precision weight.
        if scale.dtype in (jnp.bfloat16, jnp.float16):
            normed = normed.astype(scale.dtype)
        return scale * normed


class T5Attention(nnx.Module):
    def __init__(self, config: T5Config, has_relative_attention_bias: bool, *, dtype, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.d_kv = c.num_heads, c.d_kv
        self.num_buckets, self.max_distance = (
            c.relative_attention_num_buckets,
            c.relative_attention_max_distance,
        )
        inner = c.num_heads * c.d_kv
        kw = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.q = nnx.Linear(c.d_model, inner, **kw)
        self.k = nnx.Linear(c.d_model, inner, **kw)
        self.v = nnx.Linear(c.d_model, inner, **kw)
        self.o = nnx.Linear(inner, c.d_model, **kw)
        if has_relative_attention_bias:
            self.relative_attention_bias = nnx.Embed(
                c.relative_attention_num_buckets, c.num_heads, dtype=dtype, param_dtype=dtype, rngs=rngs
            )

    def position_bias(self, seq_len: int) -> jax.Array:
        """[H, S, S] fp32 relative position bias (this layer must own a bias table)."""
        buckets = _bucket_table(seq_len, self.num_buckets, self.max_distance)
        values = self.relative_attention_bias.embedding.get_value()[buckets]  # [S, S, H]
        return jnp.transpose(values, (2, 0, 1)).astype(jnp.float32)

    def __call__(self, x: jax.Array, position_bias: jax.Array, kv_mask: jax.Array | None) -> jax.Array:
        """x [B, S, D]; position_bias [H, S, S]; kv_mask [B, S] bool or None -> [B, S, D].

        The scores are computed here rather than through models.attention's `attention(...)`: that entry takes
        a boolean key mask only, and T5's relative position bias [H, S, S] must be added to the scores before
        the softmax. The encoder runs once per request over at most 512 tokens, so the materialised
        [B, H, S, S] scores are small (64 heads x 512^2 x 4 B = 64 MiB per prompt for T5-XXL); with heads
        split over `tensor` (SHARDING_RULES) the einsums shard with them.
        """
        b, s, _ = x.shape
        shape = (b, s, self.num_heads, self.d_kv)
        q = self.q(x).reshape(shape)
        k = self.k(x).reshape(shape)
        v = self.v(x).reshape(shape)
        # No 1/sqrt(d_kv): T5 folds the scale into its initialisation. Scores and softmax in fp32.
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        scores = scores + position_bias[None]
        if kv_mask is not None:
            # As transformers' sdpa path: masked keys get the dtype's minimum, so a row with no valid key
            # averages every key (finite) instead of producing NaN.
            scores = jnp.where(kv_mask[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return self.o(out.reshape(b, s, self.num_heads * self.d_kv))


class T5LayerSelfAttention(nnx.Module):
    def __init__(self, config: T5Config, has_relative_attention_bias: bool, *, dtype, rngs: nnx.Rngs):
        self.SelfAttention = T5Attention(config, has_relative_attention_bias, dtype=dtype, rngs=rngs)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon, dtype=dtype)

    def __call__(self, x, position_bias, kv_mask):
        return x + self.SelfAttention(self.layer_norm(x), position_bias, kv_mask)


class T5DenseActDense(nnx.Module):
    """wo(act(wi(x))): the original T5's feed-forward."""

    def __init__(self, config: T5Config, *, dtype, rngs: nnx.Rngs):
        self.activation = _ACTIVATIONS[config.activation]
        kw = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.wi = nnx.Linear(config.d_model, config.d_ff, **kw)
        self.wo = nnx.Linear(config.d_ff, config.d_model, **kw)

    def __call__(self, x):
        return self.wo(self.activation(self.wi(x)))


class T5DenseGatedActDense(nnx.Module):
    """wo(act(wi_0(x)) * wi_1(x)): T5 v1.1's and UMT5's gated feed-forward."""

    def __init__(self, config: T5Config, *, dtype, rngs: nnx.Rngs):
        self.activation = _ACTIVATIONS[config.activation]
        kw = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.wi_0 = nnx.Linear(config.d_model, config.d_ff, **kw)
        self.wi_1 = nnx.Linear(config.d_model, config.d_ff, **kw)
        self.wo = nnx.Linear(config.d_ff, config.d_model, **kw)

    def __call__(self, x):
        return self.wo(self.activation(self.wi_0(x)) * self.wi_1(x))


class T5LayerFF(nnx.Module):
    def __init__(self, config: T5Config, *, dtype, rngs: nnx.Rngs):
        ff = T5DenseGatedActDense if config.is_gated else T5DenseActDense
        self.DenseReluDense = ff(config, dtype=dtype, rngs=rngs)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon, dtype=dtype)

    def __call__(self, x):
        return x + self.DenseReluDense(self.layer_norm(x))


class T5Block(nnx.Module):
    def __init__(self, config: T5Config, has_relative_attention_bias: bool, *, dtype, rngs: nnx.Rngs):
        self.layer = nnx.List(
            [
                T5LayerSelfAttention(config, has_relative_attention_bias, dtype=dtype, rngs=rngs),
                T5LayerFF(config, dtype=dtype, rngs=rngs),
            ]
        )

    def __call__(self, x, position_bias, kv_mask):
        return self.layer[1](self.layer[0](x, position_bias, kv_mask))


class T5Stack(nnx.Module):
    # components/block_stack.py: T5's first block alone holds the relative position bias (its head); UMT5's
    # blocks each hold their own, so all of them stack.
    scanned_blocks = ("block",)

    def __init__(self, config: T5Config, *, dtype, rngs: nnx.Rngs):
        self.bias_in_every_layer = config.bias_in_every_layer
        self.block = nnx.List(
            [
                T5Block(config, i == 0 or config.bias_in_every_layer, dtype=dtype, rngs=rngs)
                for i in range(config.num_layers)
            ]
        )
        self.final_layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon, dtype=dtype)

    def __call__(self, x: jax.Array, kv_mask: jax.Array | None) -> jax.Array:
        seq_len = x.shape[1]
        # T5: the first block's bias, shared by all; UMT5: each block's own.
        shared = (
            None
            if self.bias_in_every_layer
            else block_at(self.block, 0).layer[0].SelfAttention.position_bias(seq_len)
        )

        def layer(block, x):
            bias = block.layer[0].SelfAttention.position_bias(seq_len) if shared is None else shared
            return block(x, bias, kv_mask)

        return self.final_layer_norm(run_blocks(self.block, layer, x))


# --------------------------------------------------------------------------------------------------
# The model


class T5EncoderModel(nnx.Module):
    """transformers' T5EncoderModel or UMT5EncoderModel, by `config.model_type`."""

    def __init__(self, config: T5Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.shared = nnx.Embed(config.vocab_size, config.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.encoder = T5Stack(config, dtype=dtype, rngs=rngs)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> T5EncoderOutput:
        """input_ids [B, S]; attention_mask [B, S] or None (Flux runs T5 without one, Wan's UMT5 with one)."""
        kv_mask = None if attention_mask is None else attention_mask.astype(bool)
        return T5EncoderOutput(self.encoder(self.shared(input_ids), kv_mask))


_ARCHITECTURES = (
    "T5EncoderModel",
    "UMT5EncoderModel",
    "T5ForConditionalGeneration",
    "UMT5ForConditionalGeneration",
)


def _rename(key: str) -> str | None:
    # The decoder and LM head of a full encoder-decoder checkpoint are not part of the encoder.
    if key.startswith(("decoder.", "lm_head.")):
        return None
    return key


def load_t5_encoder(folder: Path, dtype=jnp.float32, place=None) -> T5EncoderModel:
    """A transformers T5/UMT5 folder (config.json + model.safetensors or a sharded index) -> T5EncoderModel.

    Weights are cast to `dtype` (module docstring: as transformers for bf16). Raises CheckpointError for a non-T5 architecture and CheckpointMismatchError (listing every
    missing, unexpected and misshapen key) when the weights do not fit the config.
    """
    folder = Path(folder)
    raw = read_json(folder / "config.json")
    architecture = (raw.get("architectures") or ["T5EncoderModel"])[0]
    if architecture not in _ARCHITECTURES:
        raise CheckpointError(
            f"{folder}: architecture {architecture!r} is not a T5-family encoder ({', '.join(_ARCHITECTURES)})"
        )
    config = T5Config.from_config(raw)
    state = dict(read_component_weights(folder))
    # The input embedding is tied to `shared`: transformers saves it once as `shared.weight`, some exports
    # (and older versions) also or only as `encoder.embed_tokens.weight`.
    embed_tokens = state.pop("encoder.embed_tokens.weight", None)
    if "shared.weight" not in state and embed_tokens is not None:
        state["shared.weight"] = embed_tokens
    model = abstract_module(T5EncoderModel, config, dtype=dtype)
    load_weights(model, state, where=str(folder), rename=_rename, place=place)
    return model

"""CLIP text encoders in Flax NNX: `CLIPTextModel` and `CLIPTextModelWithProjection` (transformers' names).

SDXL runs both: the penultimate hidden states of each, concatenated, condition the UNet, and the projected
pooled output of the second (`text_embeds`) feeds its `text_time` embedding. Flux and others reuse the same
encoders, so nothing here knows about SDXL.

Attribute names follow transformers 4's module tree (`text_model.embeddings.token_embedding`, ...,
`text_projection`), which is the layout of every CLIP folder on the Hub. transformers 5 writes a plain
`CLIPTextModel` without the `text_model.` prefix; `load_clip_text_model` accepts both.

Shapes: input_ids [B, S] int; hidden states [B, S, D]; pooled [B, D]; text_embeds [B, P].

The Linears are `layers.Linear` (nnx.Linear's parameters): inside a text_encode program with text-encoder
LoRA they add each text row's adapters (models/lora/apply.py); elsewhere they are plain nnx.Linear.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from meshserve.models.attention import AttentionSettings, attention
from meshserve.models.checkpoints.loading import (
    CheckpointError,
    abstract_module,
    load_weights,
    read_component_weights,
    read_json,
)
from meshserve.models.components.layers import Linear

_DEFAULT_SETTINGS = AttentionSettings()

# Parameter path regex -> logical axes (models.parallel.placement maps them to mesh axes per pool). Only FSDP:
# "embed", the hidden size, is split over the pool's weights.shard_over axes (replicated without); heads and
# MLP units are never tensor-split here (77 tokens: the encoders are a small share of a generation's time).
# Norm scales and biases stay replicated: 0.1 % of CLIP-L's parameters and 0.08 % of OpenCLIP-bigG's
# (hidden 768 / 1280: 9 vectors of the hidden size and one of the MLP's per layer).
SHARDING_RULES: tuple = (
    (r"self_attn\.(q_proj|k_proj|v_proj|out_proj)\.weight$", ("embed", None)),
    (r"mlp\.fc1\.weight$", ("embed", None)),  # [hidden, mlp]
    (r"mlp\.fc2\.weight$", (None, "embed")),  # [mlp, hidden]
    # [vocab, hidden]: bigG's is 49408 x 1280 = 63 M parameters, 9 % of the encoder.
    (r"(token_embedding|position_embedding)\.weight$", (None, "embed")),
    (r"text_projection\.weight$", ("embed", None)),
)

# Activations by transformers' `hidden_act` name (transformers/activations.py ACT2FN).
_ACTIVATIONS = {
    # CLIP's original sigmoid approximation (OpenAI checkpoints, SDXL's first encoder).
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # erf form, as torch's nn.GELU (OpenCLIP bigG)
    # Three names transformers keeps for the same tanh approximation.
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}

# transformers' CLIPTextConfig defaults: a config.json written with only the non-default fields (older
# transformers did that) means these values.
_DEFAULTS = dict(
    vocab_size=49408,
    hidden_size=512,
    intermediate_size=2048,
    num_attention_heads=8,
    num_hidden_layers=12,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    projection_dim=512,
    eos_token_id=49407,
)


@dataclass(frozen=True)
class CLIPTextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_hidden_layers: int
    max_position_embeddings: int
    hidden_act: str
    layer_norm_eps: float
    projection_dim: int
    eos_token_id: int

    @classmethod
    def from_config(cls, config: dict) -> CLIPTextConfig:
        """From a text encoder's config.json (or a full CLIPConfig's `text_config`)."""
        config = config.get("text_config", config)
        return check_encoder_config(
            cls(**{name: config.get(name, default) for name, default in _DEFAULTS.items()})
        )


def check_encoder_config(config):
    """A text or vision config's encoder settings, checked (ValueError); returns it."""
    if config.hidden_act not in _ACTIVATIONS:
        raise ValueError(
            f"unsupported hidden_act {config.hidden_act!r}; supported: {', '.join(_ACTIVATIONS)}"
        )
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"hidden_size {config.hidden_size} is not divisible by num_attention_heads {config.num_attention_heads}"
        )
    return config


class CLIPTextOutput(NamedTuple):
    """A pytree, so a jitted call returns it whole; fields the caller ignores are dead code under jit."""

    last_hidden_state: jax.Array  # [B, S, D], after final_layer_norm
    pooler_output: jax.Array  # [B, D], last_hidden_state at the end-of-text token
    # Embeddings output, then every layer's output (before final_layer_norm): num_hidden_layers + 1 entries of
    # [B, S, D], as transformers' output_hidden_states. SDXL reads hidden_states[-2].
    hidden_states: tuple[jax.Array, ...]
    text_embeds: jax.Array | None = None  # [B, projection_dim], CLIPTextModelWithProjection only


# --------------------------------------------------------------------------------------------------
# Blocks


def _layer_norm(dim: int, eps: float, dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # Parameters stay fp32 (a few KiB) and the statistics are computed in fp32 whatever `dtype` is;
    # use_fast_variance=False computes E[(x - mean)^2] as torch does, for fp32 parity.
    return nnx.LayerNorm(
        dim, epsilon=eps, dtype=dtype, param_dtype=jnp.float32, use_fast_variance=False, rngs=rngs
    )


class CLIPTextEmbeddings(nnx.Module):
    def __init__(self, vocab_size: int, hidden_size: int, max_positions: int, *, dtype, rngs: nnx.Rngs):
        self.token_embedding = nnx.Embed(vocab_size, hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.position_embedding = nnx.Embed(
            max_positions, hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs
        )

    def __call__(self, input_ids: jax.Array) -> jax.Array:  # [B, S] -> [B, S, D]
        seq_len = input_ids.shape[-1]
        max_positions = self.position_embedding.num_embeddings
        if seq_len > max_positions:
            raise ValueError(f"sequence length {seq_len} exceeds max_position_embeddings {max_positions}")
        return self.token_embedding(input_ids) + self.position_embedding(jnp.arange(seq_len))[None]


class CLIPAttention(nnx.Module):
    def __init__(
        self, hidden_size: int, num_heads: int, *, dtype, settings: AttentionSettings, rngs: nnx.Rngs
    ):
        self.num_heads = num_heads
        self.settings = settings
        kw = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.q_proj = Linear(hidden_size, hidden_size, **kw)
        self.k_proj = Linear(hidden_size, hidden_size, **kw)
        self.v_proj = Linear(hidden_size, hidden_size, **kw)
        self.out_proj = Linear(hidden_size, hidden_size, **kw)

    def __call__(self, x: jax.Array, kv_mask: jax.Array | None) -> jax.Array:  # [B, S, D] -> [B, S, D]
        b, s, d = x.shape
        heads = (b, s, self.num_heads, d // self.num_heads)
        q = self.q_proj(x).reshape(heads)  # [B, S, H, Dh]
        k = self.k_proj(x).reshape(heads)
        v = self.v_proj(x).reshape(heads)
        # The text transformer is causal (each token sees itself and those before it); scale 1/sqrt(Dh).
        out = attention(q, k, v, causal=True, kv_mask=kv_mask, settings=self.settings)
        return self.out_proj(out.reshape(b, s, d))


class CLIPMLP(nnx.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, *, dtype, rngs: nnx.Rngs):
        self.activation = _ACTIVATIONS[hidden_act]
        self.fc1 = Linear(hidden_size, intermediate_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.fc2 = Linear(intermediate_size, hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.activation(self.fc1(x)))


class CLIPEncoderLayer(nnx.Module):
    """Pre-norm transformer layer: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        hidden_act: str,
        eps: float,
        *,
        dtype,
        settings: AttentionSettings,
        rngs: nnx.Rngs,
    ):
        self.layer_norm1 = _layer_norm(hidden_size, eps, dtype, rngs)
        self.self_attn = CLIPAttention(hidden_size, num_heads, dtype=dtype, settings=settings, rngs=rngs)
        self.layer_norm2 = _layer_norm(hidden_size, eps, dtype, rngs)
        self.mlp = CLIPMLP(hidden_size, intermediate_size, hidden_act, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, kv_mask: jax.Array | None) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x), kv_mask)
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nnx.Module):
    def __init__(self, layers: list[CLIPEncoderLayer]):
        self.layers = nnx.List(layers)

    def __call__(self, x: jax.Array, kv_mask: jax.Array | None) -> tuple[jax.Array, ...]:
        """[B, S, D] -> every layer's input and the last layer's output (num_layers + 1 arrays)."""
        hidden_states = [x]
        for layer in self.layers:
            x = layer(x, kv_mask)
            hidden_states.append(x)
        return tuple(hidden_states)


class CLIPTextTransformer(nnx.Module):
    """The body both top models share (transformers' `text_model`): embeddings, encoder, final norm, pooling.

    It takes the config because it is the model in all but name; the two classes below only add the
    projection and the output type.
    """

    def __init__(self, config: CLIPTextConfig, *, dtype, settings: AttentionSettings, rngs: nnx.Rngs):
        c = config
        self.eos_token_id = c.eos_token_id
        self.embeddings = CLIPTextEmbeddings(
            c.vocab_size, c.hidden_size, c.max_position_embeddings, dtype=dtype, rngs=rngs
        )
        layers = [
            CLIPEncoderLayer(
                c.hidden_size,
                c.intermediate_size,
                c.num_attention_heads,
                c.hidden_act,
                c.layer_norm_eps,
                dtype=dtype,
                settings=settings,
                rngs=rngs,
            )
            for _ in range(c.num_hidden_layers)
        ]
        self.encoder = CLIPEncoder(layers)
        self.final_layer_norm = _layer_norm(c.hidden_size, c.layer_norm_eps, dtype, rngs)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None):
        """input_ids [B, S]; attention_mask [B, S] (1 = token, 0 = padding) or None (SDXL passes none).

        Returns (last_hidden_state [B, S, D], pooled [B, D], hidden_states).
        """
        kv_mask = None if attention_mask is None else attention_mask.astype(bool)
        hidden_states = self.encoder(self.embeddings(input_ids), kv_mask)
        last = self.final_layer_norm(hidden_states[-1])
        if self.eos_token_id == 2:
            # Checkpoints converted before transformers PR #24773 carry eos_token_id 2 (SDXL's second
            # encoder among them); for those transformers pools at the largest id, which is CLIP's
            # end-of-text token in the original vocabulary. Kept so the outputs stay equal.
            eos_at = jnp.argmax(input_ids, axis=-1)
        else:
            # The first end-of-text token: the pad token may be the same id, so "the last one" would be wrong.
            # A row without one pools at position 0, as transformers does.
            eos_at = jnp.argmax(input_ids == self.eos_token_id, axis=-1)
        pooled = jnp.take_along_axis(last, eos_at[:, None, None], axis=1)[:, 0]  # [B, D]
        return last, pooled, hidden_states


# --------------------------------------------------------------------------------------------------
# The models


class CLIPTextModel(nnx.Module):
    def __init__(
        self,
        config: CLIPTextConfig,
        *,
        dtype=jnp.float32,
        settings: AttentionSettings = _DEFAULT_SETTINGS,
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.text_model = CLIPTextTransformer(config, dtype=dtype, settings=settings, rngs=rngs)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> CLIPTextOutput:
        last, pooled, hidden_states = self.text_model(input_ids, attention_mask)
        return CLIPTextOutput(last, pooled, hidden_states)


class CLIPTextModelWithProjection(CLIPTextModel):
    def __init__(
        self,
        config: CLIPTextConfig,
        *,
        dtype=jnp.float32,
        settings: AttentionSettings = _DEFAULT_SETTINGS,
        rngs: nnx.Rngs,
    ):
        super().__init__(config, dtype=dtype, settings=settings, rngs=rngs)
        self.text_projection = Linear(
            config.hidden_size,
            config.projection_dim,
            use_bias=False,
            dtype=dtype,
            param_dtype=dtype,
            rngs=rngs,
        )

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> CLIPTextOutput:
        last, pooled, hidden_states = self.text_model(input_ids, attention_mask)
        return CLIPTextOutput(last, pooled, hidden_states, self.text_projection(pooled))


_ARCHITECTURES = {cls.__name__: cls for cls in (CLIPTextModel, CLIPTextModelWithProjection)}


def _rename(key: str) -> str:
    # transformers 5 saves a plain CLIPTextModel without the `text_model.` level (its module tree lost it);
    # Hub checkpoints and CLIPTextModelWithProjection keep it.
    return key if key.startswith(("text_model.", "text_projection.")) else "text_model." + key


def load_clip_text_model(
    folder: Path, dtype=jnp.float32, settings: AttentionSettings = _DEFAULT_SETTINGS, place=None
) -> CLIPTextModel:
    """A text encoder folder (config.json + safetensors) -> CLIPTextModel or CLIPTextModelWithProjection.

    The class comes from the config's `architectures`. Weights are cast to `dtype` except the layer norms',
    which stay fp32. Raises CheckpointError for an unknown architecture and CheckpointMismatchError when
    the weights do not fit the config.
    """
    return load_clip_encoder(
        folder,
        _ARCHITECTURES,
        CLIPTextConfig,
        "text encoder",
        _rename,
        dtype=dtype,
        settings=settings,
        place=place,
    )


def load_clip_encoder(
    folder: Path, architectures: dict, config_class, kind: str, rename, *, dtype, settings, place
):
    """What the text and vision loaders share: the class from the config's `architectures` (the first of
    `architectures` when it has none), the config (CheckpointError when it is not one this port runs), and the
    weights (CheckpointMismatchError when they do not fit)."""
    folder = Path(folder)
    raw = read_json(folder / "config.json")
    architecture = (raw.get("architectures") or [next(iter(architectures))])[0]
    cls = architectures.get(architecture)
    if cls is None:
        raise CheckpointError(
            f"{folder}: architecture {architecture!r} is not a CLIP {kind} ({', '.join(architectures)})"
        )
    try:
        config = config_class.from_config(raw)
    except ValueError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    # Shapes only: every parameter is then set from the checkpoint, so random initialisation would be wasted
    # (seconds and a full extra copy for a 700M-parameter encoder).
    model = abstract_module(cls, config, dtype=dtype, settings=settings)
    # `position_ids` is a non-persistent buffer some older checkpoints still carry.
    load_weights(
        model,
        read_component_weights(folder),
        where=str(folder),
        rename=rename,
        ignore=("position_ids",),
        place=place,
    )
    return model

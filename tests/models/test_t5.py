"""T5-family encoders: ours (JAX) against transformers' T5EncoderModel (T5 v1.1 gated-GELU, and the original
ReLU T5) and UMT5EncoderModel, on tiny random checkpoints written by transformers' save_pretrained.

The measured errors are logged: `pytest tests/models/test_t5.py --log-cli-level=INFO` shows them.
"""

from __future__ import annotations

import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from meshserve.models.checkpoints.loading import (
    CheckpointMismatchError,
    read_component_weights,
    write_safetensors,
)
from meshserve.models.components.t5 import T5Config, load_t5_encoder, relative_position_bucket
from meshserve.models.components.t5_tokenizer import build_tiny_t5_tokenizer, load_t5_tokenizer, tokenize_t5

log = logging.getLogger(__name__)

SEQ = 40  # past max_distance 16, so the logarithmic buckets and the clamp at the last bucket are used
TINY = dict(
    vocab_size=64,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    dropout_rate=0.0,
)
VARIANTS = {
    "t5_v1_1": ("T5Config", "T5EncoderModel", dict(feed_forward_proj="gated-gelu")),
    "t5_relu": ("T5Config", "T5EncoderModel", dict(feed_forward_proj="relu")),
    "umt5": ("UMT5Config", "UMT5EncoderModel", dict(feed_forward_proj="gated-gelu")),
}


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="session")
def t5_folders(tmp_path_factory):
    """One folder per variant; umt5's weights are saved sharded (model.safetensors.index.json)."""
    import transformers

    root = tmp_path_factory.mktemp("t5")
    folders = {}
    for name, (config_cls, model_cls, extra) in VARIANTS.items():
        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(**TINY, **extra)
        model = getattr(transformers, model_cls)(config).eval()
        # transformers initialises T5 with tiny-variance weights; widen them so every term matters.
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.3)
        folders[name] = root / name
        model.save_pretrained(folders[name], max_shard_size="20KB" if name == "umt5" else "5GB")
    return folders


@pytest.fixture(scope="session")
def inputs():
    rng = np.random.default_rng(0)
    input_ids = rng.integers(3, TINY["vocab_size"], size=(3, SEQ)).astype(np.int32)
    # Row 0 full, row 1 padded after 11 tokens, row 2 after 1 token (the empty prompt: EOS alone).
    mask = np.ones((3, SEQ), np.int32)
    mask[1, 11:] = 0
    mask[2, 1:] = 0
    input_ids[mask == 0] = 0
    return input_ids, mask


def run(model, input_ids, attention_mask=None):
    """As a pipeline calls it: split once, one jitted function of (state, inputs)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, input_ids, attention_mask):
        return nnx.merge(graphdef, state)(input_ids, attention_mask).last_hidden_state

    mask = None if attention_mask is None else jnp.asarray(attention_mask)
    return np.asarray(jax.device_get(forward(state, jnp.asarray(input_ids), mask)), np.float32)


def torch_reference(folder, input_ids, attention_mask=None, dtype=torch.float32):
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    cls = getattr(transformers, config.architectures[0])
    model = cls.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        mask = None if attention_mask is None else torch.from_numpy(attention_mask).long()
        out = model(torch.from_numpy(input_ids).long(), attention_mask=mask).last_hidden_state
    return out.float().numpy(), model


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp32_equals_transformers(t5_folders, inputs, variant, masked):
    input_ids, mask = inputs
    mask = mask if masked else None
    want, _ = torch_reference(t5_folders[variant], input_ids, mask)
    got = run(load_t5_encoder(t5_folders[variant]), input_ids, mask)
    err = rel_err(got, want)
    log.info("t5 %s %s fp32 rel err %.2e", variant, "masked" if masked else "unmasked", err)
    assert err <= 1e-4
    if masked:  # the mask changes the outputs: the check can fail
        assert rel_err(run(load_t5_encoder(t5_folders[variant]), input_ids), want) > 1e-2


@pytest.mark.parametrize("variant", ["t5_v1_1", "umt5"])
def test_bf16_near_transformers_bf16(t5_folders, inputs, variant):
    """Every weight in bf16 in both (transformers honours _keep_in_fp32_modules = ["wo"] for float16 only).
    Scores and softmax run in fp32 here, in bf16 in transformers, so the error is reported, with a loose bound."""
    input_ids, mask = inputs
    want, ref_model = torch_reference(t5_folders[variant], input_ids, mask, dtype=torch.bfloat16)
    assert ref_model.encoder.block[0].layer[-1].DenseReluDense.wo.weight.dtype == torch.bfloat16
    model = load_t5_encoder(t5_folders[variant], dtype=jnp.bfloat16)
    assert model.encoder.block[0].layer[1].DenseReluDense.wo.kernel.get_value().dtype == jnp.bfloat16
    assert model.encoder.block[0].layer[0].SelfAttention.q.kernel.get_value().dtype == jnp.bfloat16
    got = run(model, input_ids, mask)
    fp32, _ = torch_reference(t5_folders[variant], input_ids, mask)
    err, err_fp32 = rel_err(got, want), rel_err(got, fp32)
    log.info("t5 %s bf16 rel err vs transformers bf16 %.2e, vs fp32 %.2e", variant, err, err_fp32)
    assert err <= 3e-2, err


def test_bias_tables_follow_the_variant(t5_folders):
    """T5: a relative-position table in layer 0 only; UMT5: in every layer. Every key maps (load_weights
    raises on any missing or unexpected one)."""
    for variant, layers in (("t5_v1_1", [0]), ("umt5", [0, 1])):
        keys = set(read_component_weights(t5_folders[variant]))
        with_bias = [
            i
            for i in range(2)
            if f"encoder.block.{i}.layer.0.SelfAttention.relative_attention_bias.weight" in keys
        ]
        assert with_bias == layers
        load_t5_encoder(t5_folders[variant])


def test_unexpected_and_missing_keys_are_named(t5_folders, tmp_path):
    folder = tmp_path / "t5"
    shutil.copytree(t5_folders["t5_v1_1"], folder)
    state = {k: np.asarray(v) for k, v in read_component_weights(folder).items()}
    state["encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"] = state[
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    ]
    del state["encoder.block.1.layer.1.DenseReluDense.wi_1.weight"]
    write_safetensors(folder / "model.safetensors", state)
    with pytest.raises(CheckpointMismatchError) as info:
        load_t5_encoder(folder)
    assert info.value.unexpected == ["encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"]
    assert info.value.missing == ["encoder.block.1.layer.1.DenseReluDense.wi_1.weight"]


def test_tied_embed_tokens_key_loads_as_shared(t5_folders, inputs, tmp_path):
    folder = tmp_path / "t5"
    shutil.copytree(t5_folders["t5_v1_1"], folder)
    state = {k: np.asarray(v) for k, v in read_component_weights(folder).items()}
    state["encoder.embed_tokens.weight"] = state.pop("shared.weight")
    write_safetensors(folder / "model.safetensors", state)
    input_ids, _ = inputs
    np.testing.assert_array_equal(
        run(load_t5_encoder(folder), input_ids), run(load_t5_encoder(t5_folders["t5_v1_1"]), input_ids)
    )


def test_relative_position_buckets_equal_transformers():
    from transformers.models.t5.modeling_t5 import T5Attention

    for seq_len, buckets, distance in ((600, 32, 128), (40, 8, 16), (7, 32, 128)):
        positions = torch.arange(seq_len)
        relative = positions[None, :] - positions[:, None]
        want = T5Attention._relative_position_bucket(
            relative, bidirectional=True, num_buckets=buckets, max_distance=distance
        ).numpy()
        got = relative_position_bucket(
            relative.numpy(), bidirectional=True, num_buckets=buckets, max_distance=distance
        )
        np.testing.assert_array_equal(got, want)


def test_config_variant_and_defaults():
    assert T5Config.from_config({"model_type": "umt5"}).bias_in_every_layer
    assert not T5Config.from_config({"architectures": ["T5EncoderModel"]}).bias_in_every_layer
    v11 = T5Config.from_config({"model_type": "t5", "feed_forward_proj": "gated-gelu"})
    assert v11.is_gated and v11.activation == "gelu_new"
    with pytest.raises(ValueError, match="model_type"):
        T5Config.from_config({"model_type": "bert"})


def test_tokenizer_pads_to_max_sequence_length(tmp_path, t5_folders):
    build_tiny_t5_tokenizer(tmp_path / "tokenizer_2")
    tokenizer = load_t5_tokenizer(tmp_path / "tokenizer_2")
    tokens = tokenize_t5(tokenizer, ["a cat and the dog", "", "the cat " * 40], max_sequence_length=16)
    assert tokens.input_ids.shape == tokens.attention_mask.shape == (3, 16)
    assert tokens.input_ids.dtype == np.int32
    eos, pad = tokenizer.token_id("</s>"), tokenizer.pad_token_id
    assert tokens.input_ids[0].tolist()[:7] == [
        tokenizer.token_id(t) for t in ["▁a", "▁cat", "▁and", "▁the", "▁dog"]
    ] + [eos, pad]
    assert tokens.attention_mask[0].tolist() == [1] * 6 + [0] * 10
    assert tokens.input_ids[1, 0] == eos and tokens.attention_mask[1].sum() == 1  # "" is EOS alone
    assert tokens.input_ids[2, -1] == eos and tokens.attention_mask[2].all()  # truncated, EOS kept
    # The ids run through the encoder (tiny vocab 20 <= the tiny model's 64).
    out = run(load_t5_encoder(t5_folders["umt5"]), tokens.input_ids, tokens.attention_mask)
    assert out.shape == (3, 16, TINY["d_model"]) and np.isfinite(out).all()

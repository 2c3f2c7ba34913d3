"""CLIP text encoders: ours (JAX) against transformers (PyTorch) on the tiny SDXL folder's own weights.

The measured errors are logged: `pytest tests/models/test_clip.py --log-cli-level=INFO` shows them.
"""

from __future__ import annotations

import json
import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from meshserve.models.checkpoints.loading import (
    CheckpointError,
    CheckpointMismatchError,
    read_component_weights,
    write_safetensors,
)
from meshserve.models.components.clip import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    load_clip_text_model,
)
from meshserve.models.components.clip_tokenizer import load_clip_tokenizer, tokenize

log = logging.getLogger(__name__)

# A padded short prompt, the empty prompt (BOS, EOS, then padding) and one truncated at 77 tokens.
PROMPTS = ["a cat and the cat", "", "the cat of the " * 40]
ENCODERS = [("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")]


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def run(model, input_ids, attention_mask=None):
    """Calls the model the way a pipeline does: split once, one jitted function of (state, inputs)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, input_ids, attention_mask):
        return nnx.merge(graphdef, state)(input_ids, attention_mask)

    mask = None if attention_mask is None else jnp.asarray(attention_mask)
    return jax.device_get(forward(state, jnp.asarray(input_ids), mask))


def torch_reference(folder, input_ids, attention_mask=None):
    """transformers' outputs (numpy) for the folder's architecture, with the pooled output for both classes."""
    import transformers

    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(str(folder)).eval()
    ids = torch.tensor(np.asarray(input_ids), dtype=torch.long)
    mask = None if attention_mask is None else torch.tensor(np.asarray(attention_mask))
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_hidden_states=True)
        body = model if architecture == "CLIPTextModel" else model.text_model
        pooled = body(ids, attention_mask=mask).pooler_output
    ref = {
        "last_hidden_state": out.last_hidden_state.numpy(),
        "hidden_states": [h.numpy() for h in out.hidden_states],
        "pooler_output": pooled.numpy(),
    }
    if architecture == "CLIPTextModelWithProjection":
        ref["text_embeds"] = out.text_embeds.numpy()
    return ref


def token_ids(tiny_sdxl_path, tokenizer_name):
    return tokenize(load_clip_tokenizer(tiny_sdxl_path / tokenizer_name), PROMPTS)


def copy_encoder(src, dst, config_update=None, state=None):
    """A text encoder folder copied to `dst`, with its config updated and/or its weights replaced."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.update(config_update or {})
    (dst / "config.json").write_text(json.dumps(config))
    if state is None:
        shutil.copy(src / "model.safetensors", dst / "model.safetensors")
    else:
        write_safetensors(dst / "model.safetensors", state)
    return dst


# --------------------------------------------------------------------------------------------------
# Parity, fp32


@pytest.mark.parametrize("encoder,tokenizer", ENCODERS)
def test_matches_transformers_fp32(tiny_sdxl_path, encoder, tokenizer):
    folder = tiny_sdxl_path / encoder
    ids = token_ids(tiny_sdxl_path, tokenizer)
    assert ids.shape == (3, 77)
    model = load_clip_text_model(folder)
    expected_cls = CLIPTextModel if encoder == "text_encoder" else CLIPTextModelWithProjection
    assert type(model) is expected_cls

    ours, ref = run(model, ids), torch_reference(folder, ids)
    assert len(ours.hidden_states) == len(ref["hidden_states"]) == model.config.num_hidden_layers + 1
    errors = {
        "last_hidden_state": rel_err(ours.last_hidden_state, ref["last_hidden_state"]),
        "hidden_states[-2]": rel_err(ours.hidden_states[-2], ref["hidden_states"][-2]),
        "hidden_states (all)": max(
            rel_err(a, b) for a, b in zip(ours.hidden_states, ref["hidden_states"], strict=True)
        ),
        "pooler_output": rel_err(ours.pooler_output, ref["pooler_output"]),
    }
    if expected_cls is CLIPTextModelWithProjection:
        errors["text_embeds"] = rel_err(ours.text_embeds, ref["text_embeds"])
    else:
        assert ours.text_embeds is None
    log.info("%s fp32 relative errors: %s", encoder, errors)
    assert max(errors.values()) <= 1e-4, errors


def test_attention_mask_matches_transformers(tiny_sdxl_path):
    """With a padding mask, padded positions attend to real tokens only (causal + kv mask), as transformers."""
    folder = tiny_sdxl_path / "text_encoder_2"
    tokenizer = load_clip_tokenizer(tiny_sdxl_path / "tokenizer_2")
    ids, mask = tokenizer.encode(PROMPTS[:2], 77)
    assert 0 < mask.sum() < mask.size

    model = load_clip_text_model(folder)
    ours, ref = run(model, ids, mask), torch_reference(folder, ids, mask)
    err = rel_err(ours.last_hidden_state, ref["last_hidden_state"])
    assert err <= 1e-4, err
    assert rel_err(ours.text_embeds, ref["text_embeds"]) <= 1e-4
    # The mask must have changed something: padded positions differ from the unmasked run.
    unmasked = run(model, ids)
    pad = mask == 0
    assert np.abs(unmasked.last_hidden_state[pad] - ours.last_hidden_state[pad]).max() > 1e-3


def test_eos_token_id_2_pools_at_largest_id(tiny_sdxl_path, tmp_path):
    """Old configs (SDXL's second encoder) say eos_token_id 2: transformers then pools at argmax(ids)."""
    folder = copy_encoder(tiny_sdxl_path / "text_encoder_2", tmp_path / "eos2", {"eos_token_id": 2})
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 500, size=(2, 16)).astype(np.int32)
    ids[:, 2] = 2  # token 2 early: a "first eos" rule would pool here
    ids[0, 9], ids[1, 5] = 510, 515  # the largest ids, where transformers pools
    ours, ref = run(load_clip_text_model(folder), ids), torch_reference(folder, ids)
    np.testing.assert_array_equal(ours.pooler_output, ours.last_hidden_state[[0, 1], [9, 5]])
    assert rel_err(ours.pooler_output, ref["pooler_output"]) <= 1e-4
    assert rel_err(ours.text_embeds, ref["text_embeds"]) <= 1e-4


def test_pools_at_first_eos(tiny_sdxl_path):
    """The pad token is the eos token in the first tokenizer: pooling must read the first one."""
    ids = token_ids(tiny_sdxl_path, "tokenizer")
    model = load_clip_text_model(tiny_sdxl_path / "text_encoder")
    eos = model.config.eos_token_id
    first = [int(np.flatnonzero(row == eos)[0]) for row in ids]
    assert first[0] < 76 and (ids[0] == eos).sum() > 1  # the short prompt is padded with eos
    out = run(model, ids)
    np.testing.assert_array_equal(out.pooler_output, out.last_hidden_state[np.arange(3), first])


# --------------------------------------------------------------------------------------------------
# Loading


def test_loads_hub_layout_with_prefix_and_position_ids(tiny_sdxl_path, tmp_path):
    """Hub checkpoints (transformers 4) name a CLIPTextModel's keys `text_model.*` and may keep position_ids."""
    src = tiny_sdxl_path / "text_encoder"
    state = {"text_model." + k: np.asarray(v) for k, v in read_component_weights(src).items()}
    assert not any(k.startswith("text_model.text_model.") for k in state)
    state["text_model.embeddings.position_ids"] = np.arange(77, dtype=np.int64)[None]
    folder = copy_encoder(src, tmp_path / "hub", state=state)
    ids = token_ids(tiny_sdxl_path, "tokenizer")
    ours = run(load_clip_text_model(folder), ids)
    plain = run(load_clip_text_model(src), ids)
    np.testing.assert_array_equal(ours.last_hidden_state, plain.last_hidden_state)
    np.testing.assert_array_equal(ours.pooler_output, plain.pooler_output)


def test_missing_key_is_named(tiny_sdxl_path, tmp_path):
    src = tiny_sdxl_path / "text_encoder"
    state = dict(read_component_weights(src))
    del state["encoder.layers.1.mlp.fc2.bias"]
    folder = copy_encoder(src, tmp_path / "missing", state=state)
    with pytest.raises(CheckpointMismatchError) as info:
        load_clip_text_model(folder)
    assert info.value.missing == ["text_model.encoder.layers.1.mlp.fc2.bias"]
    assert "text_model.encoder.layers.1.mlp.fc2.bias" in str(info.value)


def test_wrong_size_in_config_is_named(tiny_sdxl_path, tmp_path):
    folder = copy_encoder(tiny_sdxl_path / "text_encoder_2", tmp_path / "proj", {"projection_dim": 16})
    with pytest.raises(CheckpointMismatchError, match="text_projection.weight"):
        load_clip_text_model(folder)


def test_unknown_architecture_and_activation(tiny_sdxl_path, tmp_path):
    src = tiny_sdxl_path / "text_encoder"
    with pytest.raises(CheckpointError, match="CLIPVisionModel"):
        load_clip_text_model(copy_encoder(src, tmp_path / "vision", {"architectures": ["CLIPVisionModel"]}))
    # A config this port cannot run is the folder's fault: a CheckpointError naming the folder and the rule.
    with pytest.raises(CheckpointError, match=r"/act: unsupported hidden_act 'swiglu'"):
        load_clip_text_model(copy_encoder(src, tmp_path / "act", {"hidden_act": "swiglu"}))
    with pytest.raises(CheckpointError, match="not divisible by num_attention_heads"):
        load_clip_text_model(copy_encoder(src, tmp_path / "heads", {"num_attention_heads": 7}))


def test_config_reads_the_folder_and_transformers_defaults(tiny_sdxl_path):
    raw = json.loads((tiny_sdxl_path / "text_encoder_2" / "config.json").read_text())
    config = CLIPTextConfig.from_config(raw)
    assert (config.hidden_size, config.num_hidden_layers, config.hidden_act) == (32, 3, "gelu")
    assert (config.vocab_size, config.eos_token_id, config.intermediate_size) == (521, 520, 37)
    # Fields a sparse (diff-only) config leaves out take transformers' CLIPTextConfig defaults.
    from transformers import CLIPTextConfig as TorchConfig

    sparse = CLIPTextConfig.from_config({"text_config": {"hidden_size": 64}})
    defaults = TorchConfig()
    assert sparse.hidden_size == 64
    for name in ("vocab_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "hidden_act"):
        assert getattr(sparse, name) == getattr(defaults, name), name
    assert sparse.layer_norm_eps == defaults.layer_norm_eps and sparse.eos_token_id == defaults.eos_token_id


# --------------------------------------------------------------------------------------------------
# bf16


@pytest.mark.parametrize("encoder,tokenizer", ENCODERS)
def test_bf16_close_to_fp32_reference(tiny_sdxl_path, encoder, tokenizer):
    folder = tiny_sdxl_path / encoder
    ids = token_ids(tiny_sdxl_path, tokenizer)
    model = load_clip_text_model(folder, dtype=jnp.bfloat16)
    body = model.text_model
    assert body.embeddings.token_embedding.embedding.get_value().dtype == jnp.bfloat16
    assert body.encoder.layers[0].mlp.fc1.kernel.get_value().dtype == jnp.bfloat16
    assert body.final_layer_norm.scale.get_value().dtype == jnp.float32  # norms keep fp32 parameters

    ours, ref = run(model, ids), torch_reference(folder, ids)
    assert ours.last_hidden_state.dtype == jnp.bfloat16
    errors = {
        "last_hidden_state": rel_err(ours.last_hidden_state, ref["last_hidden_state"]),
        "hidden_states[-2]": rel_err(ours.hidden_states[-2], ref["hidden_states"][-2]),
        "pooler_output": rel_err(ours.pooler_output, ref["pooler_output"]),
    }
    if ours.text_embeds is not None:
        errors["text_embeds"] = rel_err(ours.text_embeds, ref["text_embeds"])
    log.info("%s bf16 relative errors vs fp32 transformers: %s", encoder, errors)
    # bf16 keeps 8 bits of mantissa (2**-8 = 4e-3 per rounding); 3 layers of rounding stay well under 3e-2.
    assert max(errors.values()) <= 3e-2, errors
    # ...and bf16 really ran: a result this close to fp32 would mean the dtype was ignored.
    assert max(errors.values()) > 1e-5, errors

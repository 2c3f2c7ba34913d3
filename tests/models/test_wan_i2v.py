"""Wan 2.1 image-to-video: the I2V transformer (image embedder, added K/V cross-attention) against diffusers' on a
tiny random checkpoint; the real Wan2.1-I2V-14B-480P/720P transformer and CLIP ViT-H/14 image encoder keys and
shapes (abstract, no weights).

The measured errors are logged: `pytest tests/models/test_wan_i2v.py --log-cli-level=INFO` shows them.
"""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from meshserve.models.checkpoints.loading import abstract_module, load_weights, torch_key
from meshserve.models.components.clip_vision import CLIPVisionConfig, CLIPVisionModelWithProjection
from meshserve.models.parallel.mesh import MeshSizes, make_mesh
from meshserve.models.parallel.placement import Placement
from meshserve.models.wan.transformer_wan import (
    SHARDING_RULES,
    WanTransformer3DConfig,
    WanTransformer3DModel,
    load_wan_transformer,
)
from tests.fixtures.tiny_wan_i2v import CLIP_VISION, I2V_TRANSFORMER, build_tiny_wan_i2v_transformer

log = logging.getLogger(__name__)

# Latent video 2 x 4 x 6 (a 2 x 2 x 3 patch grid, 12 tokens). diffusers' attention processor takes the image
# tokens to be the first `S - 512` rows of its context, so the text is 512 tokens (WanPipeline's default).
FRAMES, HEIGHT, WIDTH, S_TXT, S_IMG = 2, 4, 6, 512, 17

# Wan2.1-I2V-14B-480P-Diffusers and -720P-Diffusers: the same transformer config (diffusers'
# scripts/convert_wan_to_diffusers.py, "Wan-I2V-14B-480p" / "-720p"), the 720P model differing in weights and
# its scheduler's flow_shift only.
WAN_I2V_14B = dict(
    patch_size=[1, 2, 2],
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=36,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=1280,
    added_kv_proj_dim=5120,
    rope_max_seq_len=1024,
)
# The image encoder both folders ship: laion/CLIP-ViT-H-14-laion2B-s32B-b79K's vision tower, saved as
# CLIPVisionModelWithProjection by the same script.
CLIP_VIT_H_14 = dict(
    hidden_size=1280,
    intermediate_size=5120,
    num_attention_heads=16,
    num_hidden_layers=32,
    num_channels=3,
    image_size=224,
    patch_size=14,
    hidden_act="gelu",
    layer_norm_eps=1e-5,
    projection_dim=1024,
)


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def zero_strided(shape) -> np.ndarray:
    """A stand-in array of `shape` that allocates one element (shapes-only loads)."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), tuple(shape), (0,) * len(shape))


@pytest.fixture(scope="module")
def i2v_transformer_folder(tmp_path_factory):
    return build_tiny_wan_i2v_transformer(tmp_path_factory.mktemp("wan_i2v") / "transformer")


def make_inputs(batch: int = 2, seed: int = 0) -> dict:
    rs = np.random.RandomState(seed)
    return dict(
        hidden_states=rs.randn(batch, FRAMES, HEIGHT, WIDTH, I2V_TRANSFORMER["in_channels"]).astype(
            np.float32
        ),
        encoder_hidden_states=rs.randn(batch, S_TXT, I2V_TRANSFORMER["text_dim"]).astype(np.float32),
        encoder_hidden_states_image=rs.randn(batch, S_IMG, I2V_TRANSFORMER["image_dim"]).astype(np.float32),
        timestep=np.array([999, 421], np.int64)[:batch],
    )


def test_i2v_transformer_equals_diffusers(i2v_transformer_folder):
    """The I2V transformer (image embedder, added K/V on the image tokens, 12 input channels) equals diffusers'
    on the same weights, fp32 <= 1e-4; without the image branch the output differs (the test can fail)."""
    from diffusers import WanTransformer3DModel as TorchWan

    reference = TorchWan.from_pretrained(str(i2v_transformer_folder)).eval()
    inputs = make_inputs()
    with torch.no_grad():
        want = reference(
            hidden_states=torch.from_numpy(inputs["hidden_states"]).permute(0, 4, 1, 2, 3),
            timestep=torch.from_numpy(inputs["timestep"]),
            encoder_hidden_states=torch.from_numpy(inputs["encoder_hidden_states"]),
            encoder_hidden_states_image=torch.from_numpy(inputs["encoder_hidden_states_image"]),
        ).sample.permute(0, 2, 3, 4, 1)

    model = load_wan_transformer(i2v_transformer_folder)
    assert model.config.image_to_video and model.condition_embedder.image_embedder is not None
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, x, t, text, image, rope):
        return nnx.merge(graphdef, state)(x, t, text, rope, image)

    rope = model.rope(FRAMES, HEIGHT, WIDTH)
    args = (
        jnp.asarray(inputs["hidden_states"]),
        jnp.asarray(inputs["timestep"], jnp.int32),
        jnp.asarray(inputs["encoder_hidden_states"]),
    )
    got = forward(state, *args, jnp.asarray(inputs["encoder_hidden_states_image"]), rope)
    err = rel_err(got, want.numpy())
    log.info("Wan I2V transformer fp32: max rel err %.2e", err)
    assert err <= 1e-4
    # Zero image states still go through the embedder's biases: a different output, so the branch matters.
    blank = forward(state, *args, jnp.zeros_like(inputs["encoder_hidden_states_image"]), rope)
    assert rel_err(blank, want.numpy()) > 1e-2


def test_image_states_required_exactly_for_i2v(i2v_transformer_folder):
    config = WanTransformer3DConfig.from_config(
        json.loads((i2v_transformer_folder / "config.json").read_text())
    )
    # Shapes only: both errors are raised before any weight is read.
    model = abstract_module(lambda rngs: WanTransformer3DModel(config, rngs=rngs))
    inputs = make_inputs(batch=1)
    args = (inputs["hidden_states"], inputs["timestep"], inputs["encoder_hidden_states"][:, :8])
    with pytest.raises(ValueError, match="needs encoder_hidden_states_image"):
        model(*args, model.rope(FRAMES, HEIGHT, WIDTH))
    t2v_config = WanTransformer3DConfig.from_config(
        {**I2V_TRANSFORMER, "image_dim": None, "added_kv_proj_dim": None}
    )
    t2v = abstract_module(lambda rngs: WanTransformer3DModel(t2v_config, rngs=rngs))
    with pytest.raises(ValueError, match="given to a text-to-video model"):
        t2v(*args, t2v.rope(FRAMES, HEIGHT, WIDTH), inputs["encoder_hidden_states_image"])


def test_config_rejects_what_i2v_does_not_implement():
    with pytest.raises(ValueError, match="pos_embed_seq_len=514.*not supported"):
        WanTransformer3DConfig.from_config({**WAN_I2V_14B, "pos_embed_seq_len": 514})
    with pytest.raises(ValueError, match="needs both"):
        WanTransformer3DConfig.from_config({**WAN_I2V_14B, "added_kv_proj_dim": None})
    with pytest.raises(ValueError, match="must be the model's inner dim 5120"):
        WanTransformer3DConfig.from_config({**WAN_I2V_14B, "added_kv_proj_dim": 4096})


def test_real_i2v_transformer_keys_and_shapes_map():
    """diffusers' Wan2.1-I2V-14B (480P and 720P: one config) built on the meta device, against ours built
    abstractly: every key and shape maps, none left over; the sharding rules fit every parameter at tensor=8
    and split every image-to-video weight of dim^2 or more."""
    from diffusers import WanTransformer3DModel as TorchWan

    with torch.device("meta"):
        reference = TorchWan(**WAN_I2V_14B)
    state = {key: zero_strided(t.shape) for key, t in reference.state_dict().items()}
    config = WanTransformer3DConfig.from_config({"_class_name": "WanTransformer3DModel", **WAN_I2V_14B})
    model = abstract_module(lambda rngs: WanTransformer3DModel(config, rngs=rngs))
    load_weights(model, state, place=lambda path, array: array)
    total = sum(t.numel() for t in reference.parameters())
    added = sum(t.numel() for k, t in reference.named_parameters() if "add_" in k or "image_embedder" in k)
    log.info("Wan I2V 14B: %.3f B parameters (image branch %.3f B), all mapped", total / 1e9, added / 1e9)
    # The T2V 14B's 14.29 B plus the image branch (added K/V and their norm in 40 blocks, the image embedder)
    # plus the 20 more input channels of the patch embedding.
    assert (total, added) == (16_394_878_784, 2_105_772_800)

    sizes = MeshSizes(tensor=8)
    placement = Placement(make_mesh(sizes, jax.devices()[:8]), sizes)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key, shape = torch_key(path), var.get_value().shape
        spec = placement.param_spec(SHARDING_RULES, key, shape)
        if ("add_" in key or "norm_added_k" in key) and "tensor" not in spec:
            pytest.fail(f"{key} {shape} is not split over tensor: {spec}")


def test_real_image_encoder_keys_and_shapes_map():
    """transformers' CLIP ViT-H/14 vision tower with projection (what the I2V folders' image_encoder/ holds) on
    the meta device against ours built abstractly: every key and shape maps; 257 tokens of 1280 per image."""
    import transformers

    with torch.device("meta"):
        reference = transformers.CLIPVisionModelWithProjection(transformers.CLIPVisionConfig(**CLIP_VIT_H_14))
    state = {key: zero_strided(t.shape) for key, t in reference.state_dict().items()}
    config = CLIPVisionConfig.from_config(CLIP_VIT_H_14)
    assert config.num_positions == 257
    model = abstract_module(lambda rngs: CLIPVisionModelWithProjection(config, rngs=rngs))
    load_weights(model, state, place=lambda path, array: array, ignore=("position_ids",))
    total = sum(t.numel() for t in reference.parameters())
    log.info("CLIP ViT-H/14 vision + projection: %.3f B parameters, all mapped", total / 1e9)
    assert total == 632_076_800
    # The hidden size is what the transformer's image_dim takes (1280 real, 32 tiny).
    assert config.hidden_size == WAN_I2V_14B["image_dim"]
    assert CLIP_VISION["hidden_size"] == I2V_TRANSFORMER["image_dim"]

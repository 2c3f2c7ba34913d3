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
from meshserve.models.components.block_stack import block_at
from meshserve.models.components.clip_vision import CLIPVisionConfig, CLIPVisionModelWithProjection
from meshserve.models.parallel.mesh import MeshSizes, make_mesh
from meshserve.models.parallel.placement import Placement
from meshserve.models.wan.transformer_wan import (
    SHARDING_RULES,
    WanTransformer3DConfig,
    WanTransformer3DModel,
    load_wan_transformer,
)
from tests.fixtures.tiny_wan_i2v import CLIP_VISION, I2V_TRANSFORMER

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
def i2v_transformer_folder(tiny_wan_i2v_path):
    """The tiny I2V folder's transformer (tests/fixtures/tiny_wan_i2v.py: build_tiny_wan_i2v_transformer)."""
    return tiny_wan_i2v_path / "transformer"


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


def diffusers_forward(reference, inputs: dict, image: np.ndarray) -> torch.Tensor:
    """diffusers' WanTransformer3DModel on `inputs` (ours, channels-last) and the CLIP states `image` -> its
    output, channels-last."""
    with torch.no_grad():
        return reference(
            hidden_states=torch.from_numpy(inputs["hidden_states"]).permute(0, 4, 1, 2, 3),
            timestep=torch.from_numpy(inputs["timestep"]),
            encoder_hidden_states=torch.from_numpy(inputs["encoder_hidden_states"]),
            encoder_hidden_states_image=torch.from_numpy(image),
        ).sample.permute(0, 2, 3, 4, 1)


def our_forward(model, inputs: dict):
    """`forward(state, image)`: our transformer `model` (its state given, so a changed parameter can be
    passed) on `inputs` and the CLIP states `image`, jitted."""
    graphdef = nnx.graphdef(model)

    @jax.jit
    def forward(state, image):
        x, t = jnp.asarray(inputs["hidden_states"]), jnp.asarray(inputs["timestep"], jnp.int32)
        rope = model.rope(FRAMES, HEIGHT, WIDTH)
        return nnx.merge(graphdef, state)(x, t, jnp.asarray(inputs["encoder_hidden_states"]), rope, image)

    return forward


def test_i2v_transformer_equals_diffusers(i2v_transformer_folder):
    """The I2V transformer (image embedder, added K/V on the image tokens, 12 input channels) equals diffusers'
    on the same weights, fp32 <= 1e-4; without the image branch the output differs (the test can fail)."""
    from diffusers import WanTransformer3DModel as TorchWan

    reference = TorchWan.from_pretrained(str(i2v_transformer_folder)).eval()
    inputs = make_inputs()
    want = diffusers_forward(reference, inputs, inputs["encoder_hidden_states_image"])

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


def test_image_tokens_without_added_kv_join_the_text_as_diffusers(tmp_path):
    """A config with image_dim and no added_kv_proj_dim (diffusers' own WanImageToVideoPipeline test model):
    diffusers' forward puts the embedded image tokens in front of the text and its cross-attention attends to
    both through to_k / to_v. fp32 <= 1e-4; the image tokens matter (zeroed, the output moves)."""
    from diffusers import WanTransformer3DModel as TorchWan

    from tests.fixtures.tiny_wan_i2v import build_tiny_wan_i2v_transformer

    folder = build_tiny_wan_i2v_transformer(tmp_path / "in_context", added_kv=False)
    reference = TorchWan.from_pretrained(str(folder)).eval()
    inputs = make_inputs()
    want = diffusers_forward(reference, inputs, inputs["encoder_hidden_states_image"])
    model = load_wan_transformer(folder)
    assert model.config.image_in_context and block_at(model.blocks, 0).attn2.add_k_proj is None
    state, forward = nnx.state(model), our_forward(model, inputs)

    got = forward(state, jnp.asarray(inputs["encoder_hidden_states_image"]))
    err = rel_err(got, want.numpy())
    log.info("Wan I2V transformer, image tokens in the context, fp32: max rel err %.2e", err)
    assert err <= 1e-4
    blank = forward(state, jnp.zeros_like(inputs["encoder_hidden_states_image"]))
    assert rel_err(blank, want.numpy()) > 1e-2


def test_first_last_frame_transformer_equals_diffusers(tmp_path):
    """Wan 2.1 FLF2V's transformer: its image embedder adds a learned position embedding over both frames' CLIP
    states. diffusers takes them as [2B, 257, D] (image, last image, image, ...) and views them [B, 514, D];
    ours takes that view. fp32 <= 1e-4; the embedding matters (zeroed, the output moves)."""
    from diffusers import WanTransformer3DModel as TorchWan

    from tests.fixtures.tiny_wan_i2v import build_tiny_wan_i2v_transformer

    folder = build_tiny_wan_i2v_transformer(tmp_path / "flf2v", first_last=True)
    reference = TorchWan.from_pretrained(str(folder)).eval()
    inputs = make_inputs()
    both = np.random.RandomState(7).randn(2, 2 * S_IMG, I2V_TRANSFORMER["image_dim"]).astype(np.float32)
    want = diffusers_forward(reference, inputs, both.reshape(4, S_IMG, -1))
    model = load_wan_transformer(folder)
    state, forward = nnx.state(model), our_forward(model, inputs)

    got = forward(state, jnp.asarray(both))
    err = rel_err(got, want.numpy())
    log.info("Wan FLF2V transformer fp32: max rel err %.2e", err)
    assert err <= 1e-4
    embed = model.condition_embedder.image_embedder.pos_embed
    embed.value = jnp.zeros_like(embed.value)
    assert rel_err(forward(nnx.state(model), jnp.asarray(both)), want.numpy()) > 1e-2


def test_image_states_required_exactly_for_i2v(i2v_transformer_folder):
    config = WanTransformer3DConfig.from_config(
        json.loads((i2v_transformer_folder / "config.json").read_text())
    )
    # Shapes only: both errors are raised before any weight is read.
    model = abstract_module(WanTransformer3DModel, config)
    inputs = make_inputs(batch=1)
    args = (inputs["hidden_states"], inputs["timestep"], inputs["encoder_hidden_states"][:, :8])
    with pytest.raises(ValueError, match="needs encoder_hidden_states_image"):
        model(*args, model.rope(FRAMES, HEIGHT, WIDTH))
    t2v_config = WanTransformer3DConfig.from_config(
        {**I2V_TRANSFORMER, "image_dim": None, "added_kv_proj_dim": None}
    )
    t2v = abstract_module(WanTransformer3DModel, t2v_config)
    with pytest.raises(ValueError, match="given to a text-to-video model"):
        t2v(*args, t2v.rope(FRAMES, HEIGHT, WIDTH), inputs["encoder_hidden_states_image"])


def test_config_rejects_what_i2v_does_not_implement():
    assert (
        WanTransformer3DConfig.from_config({**WAN_I2V_14B, "pos_embed_seq_len": 514}).pos_embed_seq_len == 514
    )
    with pytest.raises(ValueError, match="pos_embed_seq_len=514 .* without image_dim"):
        WanTransformer3DConfig.from_config(
            {**WAN_I2V_14B, "pos_embed_seq_len": 514, "image_dim": None, "added_kv_proj_dim": None}
        )
    assert WanTransformer3DConfig.from_config({**WAN_I2V_14B, "added_kv_proj_dim": None}).image_in_context
    with pytest.raises(ValueError, match="added_kv_proj_dim=5120 without image_dim"):
        WanTransformer3DConfig.from_config({**WAN_I2V_14B, "image_dim": None})
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
    model = abstract_module(WanTransformer3DModel, config)
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
    model = abstract_module(CLIPVisionModelWithProjection, config)
    load_weights(model, state, place=lambda path, array: array, ignore=("position_ids",))
    total = sum(t.numel() for t in reference.parameters())
    log.info("CLIP ViT-H/14 vision + projection: %.3f B parameters, all mapped", total / 1e9)
    assert total == 632_076_800
    # The hidden size is what the transformer's image_dim takes (1280 real, 32 tiny).
    assert config.hidden_size == WAN_I2V_14B["image_dim"]
    assert CLIP_VISION["hidden_size"] == I2V_TRANSFORMER["image_dim"]


# --------------------------------------------------------------------------------------------------
# The pipeline against diffusers' WanImageToVideoPipeline

# 32 x 48 px (non-square), 5 frames -> latents 2 x 4 x 6 (a 2 x 2 x 3 patch grid), 2 UniPC steps.
PIPE = dict(height=32, width=48, num_frames=5, num_inference_steps=2)
NOISE = (4, 2, 4, 6)  # diffusers' [C, T, h, w] of one row
PROMPTS = ["a cat", "the dog and the cat"]


def two_images() -> list:
    """Two different images of sizes that are neither the video's nor CLIP's (both get resized)."""
    from PIL import Image

    rs = np.random.RandomState(3)
    return [
        Image.fromarray(rs.randint(0, 256, (50, 70, 3), np.uint8)),
        Image.fromarray(rs.randint(0, 256, (64, 40, 3), np.uint8)),
    ]


@pytest.fixture(scope="module")
def i2v(tiny_wan_i2v_path):
    from meshserve.models import load_pipeline

    return load_pipeline(tiny_wan_i2v_path, dtype="float32")


@pytest.fixture(scope="module")
def reference(tiny_wan_i2v_path, monkeypatch_module):
    """diffusers' WanImageToVideoPipeline on the same folder, fp32."""
    import diffusers.pipelines.wan.pipeline_wan as t2v
    import diffusers.pipelines.wan.pipeline_wan_i2v as i2v_module
    from diffusers import WanImageToVideoPipeline

    # diffusers 0.42's I2V calls ftfy.fix_text unconditionally (an import guarded by is_ftfy_available): ftfy
    # is not installed, so its prompt cleaning is the T2V one, which skips ftfy then (models/wan/text.py).
    monkeypatch_module.setattr(i2v_module, "basic_clean", t2v.basic_clean)
    pipe = WanImageToVideoPipeline.from_pretrained(str(tiny_wan_i2v_path), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def diffusers_video(pipe, image, prompt, noise, **kw) -> np.ndarray:
    """diffusers' I2V for one image (its I2V takes one image for a call)."""
    with torch.no_grad():
        out = pipe(
            image=image, prompt=prompt, latents=torch.from_numpy(noise), output_type="np", **PIPE, **kw
        )
    return out.frames


def test_i2v_pipeline_equals_diffusers(i2v, reference):
    """A batch of two prompts with two different images, the first with CFG (guidance 4, a negative prompt),
    the second without (guidance 1), non-square, `latents=` as each row's noise: each video equals diffusers'
    I2V called for that image alone, fp32 <= 1e-3 per pixel."""
    images = two_images()
    noise = np.random.default_rng(0).standard_normal((2, *NOISE)).astype(np.float32)
    got = i2v(
        PROMPTS,
        image=images,
        negative_prompt=["blurry", None],
        guidance_scale=[4.0, 1.0],
        latents=noise,
        **PIPE,
    ).images
    assert got.shape == (2, 5, 32, 48, 3)
    errors = []
    for row, guidance in enumerate((4.0, 1.0)):
        negative = {"negative_prompt": "blurry"} if guidance > 1 else {}
        want = diffusers_video(
            reference,
            images[row],
            PROMPTS[row],
            noise[row : row + 1],
            guidance_scale=guidance,
            **negative,
        )
        errors.append(float(np.abs(got[row : row + 1] - want).max()))
        assert want.std() > 1e-2  # a real video, not a blank
    log.info("Wan I2V pipeline fp32 (CFG row, no-CFG row): max abs frame error %s", errors)
    assert max(errors) <= 1e-3
    # The image conditions every row: the same prompts and noise with the images swapped give other videos.
    swapped = i2v(
        PROMPTS,
        image=images[::-1],
        negative_prompt=["blurry", None],
        guidance_scale=[4.0, 1.0],
        latents=noise,
        **PIPE,
    ).images
    assert min(float(np.abs(swapped[r] - got[r]).max()) for r in range(2)) > 1e-2
    # The videos are what a worker writes as .mp4, as text-to-video's (workers/encoding.py).
    from meshserve.workers.encoding import encode_video

    data, content_type = encode_video(got[0], "mp4", fps=16)
    assert content_type == "video/mp4" and data[4:8] == b"ftyp"


def test_i2v_contract_and_errors(i2v, tiny_wan_i2v_path, tiny_wan_path):
    """An I2V folder loads as an image-to-video pipeline that requires `image=`; a mask, a strength, or an
    image given to the text-to-video Wan are clear errors (before anything compiles)."""
    from meshserve.models import PipelineError, load_pipeline
    from meshserve.models.wan.pipeline_i2v import WanImageToVideoPipeline

    assert isinstance(i2v, WanImageToVideoPipeline)
    assert i2v.task == "image-to-video" and list(i2v.tasks) == ["image-to-video"]
    assert i2v.limits["tasks"] == ["image-to-video"] and "frames" in i2v.limits
    image = two_images()[0]
    compiled = i2v.compilations
    with pytest.raises(PipelineError, match="needs an image"):
        i2v("a cat", **PIPE)
    with pytest.raises(PipelineError, match="mask_image|inpaint"):
        i2v("a cat", image=image, mask_image=image, **PIPE)
    with pytest.raises(PipelineError, match="strength"):
        i2v("a cat", image=image, strength=0.5, **PIPE)
    with pytest.raises(PipelineError, match="image"):
        i2v(["a", "b"], image=[image] * 3, **PIPE)  # neither one, one per prompt nor one per row
    with pytest.raises(PipelineError, match="multiple of 16"):
        i2v("a cat", image=image, **{**PIPE, "width": 40})
    assert i2v.compilations == compiled
    t2v = load_pipeline(tiny_wan_path)
    with pytest.raises(PipelineError, match="image"):
        t2v("a cat", image=image, **PIPE)


def test_an_image_processor_without_a_fixed_size_is_refused(tiny_wan_i2v_path, tmp_path):
    """No center crop, a shortest-edge resize: each image's size would follow its aspect, where the image
    encoder takes one fixed size; refused at load with that reason."""
    import json
    import shutil

    from meshserve.models import load_pipeline
    from meshserve.models.registry import ModelFolderError

    folder = tmp_path / "i2v"
    shutil.copytree(tiny_wan_i2v_path, folder)
    path = folder / "image_processor" / "preprocessor_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "do_center_crop": False, "size": {"shortest_edge": 32}}))
    with pytest.raises(ModelFolderError, match="without a center crop or a fixed size"):
        load_pipeline(folder)


def test_first_last_frame_pipeline_equals_diffusers(tiny_wan_flf2v_path, monkeypatch):
    """Wan 2.1 first-last-frame-to-video (a transformer with pos_embed_seq_len): `last_image=` per row as
    `image=`; each video equals diffusers' WanImageToVideoPipeline(image=, last_image=) for that row alone, fp32
    <= 1e-3; another last frame gives another video; it is required, and refused by a plain I2V model."""
    import diffusers.pipelines.wan.pipeline_wan as t2v
    import diffusers.pipelines.wan.pipeline_wan_i2v as i2v_module
    from diffusers import WanImageToVideoPipeline

    from meshserve.models import PipelineError, load_pipeline

    monkeypatch.setattr(i2v_module, "basic_clean", t2v.basic_clean)  # as the `reference` fixture does
    reference = WanImageToVideoPipeline.from_pretrained(str(tiny_wan_flf2v_path), torch_dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    flf2v = load_pipeline(tiny_wan_flf2v_path, dtype="float32")
    firsts, lasts = two_images(), two_images()[::-1]
    noise = np.random.default_rng(2).standard_normal((2, *NOISE)).astype(np.float32)
    kw = dict(negative_prompt="blurry", guidance_scale=4.0, latents=noise, **PIPE)
    got = flf2v(PROMPTS, image=firsts, last_image=lasts, **kw).images
    errors = []
    for row in range(2):
        want = diffusers_video(
            reference,
            firsts[row],
            PROMPTS[row],
            noise[row : row + 1],
            last_image=lasts[row],
            negative_prompt="blurry",
            guidance_scale=4.0,
        )
        errors.append(float(np.abs(got[row : row + 1] - want).max()))
    log.info("Wan FLF2V pipeline fp32: max abs frame error %s", errors)
    assert max(errors) <= 1e-3
    other = flf2v(PROMPTS, image=firsts, last_image=firsts, **kw).images
    assert min(float(np.abs(other[r] - got[r]).max()) for r in range(2)) > 1e-2
    with pytest.raises(PipelineError, match="needs last_image"):
        flf2v(PROMPTS, image=firsts, **kw)


def test_last_image_is_refused_by_a_plain_i2v_model(i2v):
    from meshserve.models import PipelineError

    with pytest.raises(PipelineError, match="not a first-last-frame model"):
        i2v("a cat", image=two_images()[0], last_image=two_images()[1], **PIPE)

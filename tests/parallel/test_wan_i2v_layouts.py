"""Wan 2.1 image-to-video on 8 CPU devices gives the single-device result: CFG parallelism of the negative/positive
passes (both take the same image tokens and condition), context parallelism over the video tokens, the data axis
over the two videos of a batch, and every module's weights (transformer, UMT5, VAE, CLIP vision encoder) stored
split over the mesh (FSDP) and gathered where used.

The tiny I2V folder (tests/fixtures/tiny_wan_i2v.py) at 32 x 48 px and 5 frames: a 2 x 2 x 3 patch grid of 12
video tokens, 17 image tokens and 512 text tokens (both kept whole on every device by the attention entry).
Two prompts with two different images, the first with CFG and the second without, as the parity test
(tests/models/test_wan_i2v.py) calls it, so both compile the same single-device programs.

What is compared is the denoised latents (output_type "latent"): everything image-to-video adds (the
image_encode program: VAE encode of the condition, CLIP; the image tokens and the condition in every step)
happens before the decode, and the decode is text-to-video's, whose split is checked against one device in
tests/parallel/test_wan_layouts.py. Compiling the split decode took 68-73 s per layout on the 2-core test
machine (2026-11-23), more than the rest of a layout's programs together.
"""

import numpy as np
import pytest
from PIL import Image

from meshserve.models import load_pipeline
from meshserve.models.attention import AttentionSettings

PIPE = dict(height=32, width=48, num_frames=5, num_inference_steps=2)
PROMPTS = ["a cat", "the dog and the cat"]
# name -> (mesh sizes, attention settings, weights)
LAYOUTS = {
    # 8 devices: the two videos over data, each video's negative/positive passes over cfg, its tokens over
    # context (Ulysses: 2 of the 4 heads per device), and every module's weights stored split 8 ways.
    "data2-cfg2-context2-ulysses-fsdp": (
        {"data": 2, "cfg": 2, "context": 2},
        AttentionSettings(context_strategy="ulysses"),
        {"shard_over": ["data", "cfg", "context"]},
    ),
}


def _call(pipe) -> np.ndarray:
    rs = np.random.RandomState(3)
    images = [
        Image.fromarray(rs.randint(0, 256, (50, 70, 3), np.uint8)),
        Image.fromarray(rs.randint(0, 256, (64, 40, 3), np.uint8)),
    ]
    noise = np.random.default_rng(0).standard_normal((2, 4, 2, 4, 6)).astype(np.float32)
    return pipe(
        PROMPTS,
        image=images,
        negative_prompt=["blurry", None],
        guidance_scale=[4.0, 1.0],
        latents=noise,
        output_type="latent",
        **PIPE,
    ).images


@pytest.fixture(scope="module")
def reference(tiny_wan_i2v_path):
    latents = _call(load_pipeline(tiny_wan_i2v_path))
    assert latents.shape == (2, 4, 2, 4, 6) and latents.std() > 1e-2
    return latents


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_wan_i2v_layout_matches_single_device(tiny_wan_i2v_path, reference, name, record_property):
    sizes, settings, weights = LAYOUTS[name]
    n = int(np.prod(list(sizes.values())))
    pipe = load_pipeline(
        tiny_wan_i2v_path, mesh=sizes, devices=list(range(n)), attention=settings, weights=weights
    )
    latents = _call(pipe)
    err = float(np.abs(latents - reference).max())
    record_property("latent_max_abs_err", err)
    print(f"{name}: latents max abs err {err:.2e}")
    assert err <= 1e-4, f"{name}: denoised latents max abs error {err:.2e}"
    if weights:
        # The layout really stores split weights: each of the 8 devices holds 1/8 of the image K projection
        # and of the CLIP encoder's first MLP.
        # The blocks are stacked (models/components/block_stack.py): [blocks, in, out], the blocks' axis whole.
        k = pipe._states["transformer"]["blocks"]["stacked"]["attn2"]["add_k_proj"]["kernel"][...]
        assert {s.data.shape for s in k.addressable_shards} == {(k.shape[0], k.shape[1] // 8, k.shape[2])}
        fc1 = pipe._states["image_encoder"]["vision_model"]["encoder"]["layers"][0]["mlp"]["fc1"]["kernel"][
            ...
        ]
        assert {s.data.shape for s in fc1.addressable_shards} == {(fc1.shape[0] // 8, fc1.shape[1])}


def test_first_last_frame_on_cfg2_x_context2_matches_single_device(tiny_wan_flf2v_path):
    """First-last-frame-to-video (both frames' 2 x 17 image tokens with their position embedding, the mask's
    last frame) on cfg2 x context2 (Ulysses) gives the single-device latents."""
    rs = np.random.RandomState(4)
    firsts = [Image.fromarray(rs.randint(0, 256, (40, 60, 3), np.uint8)) for _ in range(2)]
    lasts = [Image.fromarray(rs.randint(0, 256, (40, 60, 3), np.uint8)) for _ in range(2)]
    noise = np.random.default_rng(5).standard_normal((2, 4, 2, 4, 6)).astype(np.float32)
    kw = dict(image=firsts, last_image=lasts, negative_prompt="blurry", guidance_scale=4.0, latents=noise)

    def call(pipe):
        return pipe(PROMPTS, output_type="latent", **kw, **PIPE).images

    single = call(load_pipeline(tiny_wan_flf2v_path))
    mesh = {"cfg": 2, "context": 2}
    split = call(
        load_pipeline(
            tiny_wan_flf2v_path,
            mesh=mesh,
            devices=list(range(4)),
            attention=AttentionSettings(context_strategy="ulysses"),
        )
    )
    err = float(np.abs(split - single).max())
    print(f"FLF2V cfg2 x context2: latents max abs err {err:.2e}")
    assert err <= 1e-4 and single.std() > 1e-2

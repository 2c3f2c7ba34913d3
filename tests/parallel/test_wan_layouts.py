"""Every Wan layout gives the single-device result (8 CPU devices): CFG parallelism of the negative/positive
passes, context parallelism over the video tokens (ring, Ulysses), tensor parallelism over heads and FFN units,
and weights stored split over the mesh (FSDP).

The tiny Wan (4 heads of 16, 2 blocks) at 48 x 80 px and 9 frames has a 3 x 3 x 5 patch grid: 45 video
tokens, divisible by neither 2 nor 4, so every context layout pads the sequence and must mask the padded keys
(one attended pad would change every output). CFG runs (guidance 5, a negative prompt), so the transformer
batch is the interleaved [negative, positive] pair the cfg axis splits. Strategies are forced: with 45 tokens
`auto` would pick allgather everywhere. The 512 text tokens of the cross-attention stay whole on every device.
"""

import numpy as np
import pytest

from meshserve.models import load_pipeline
from meshserve.models.attention import AttentionSettings

H, W, F = 48, 80, 9  # latents 3 x 6 x 10 -> 45 patches
STEPS = 2
# name -> (mesh sizes, attention settings, weights). Ulysses-4 puts one of the 4 heads on each device;
# cfg2 x context2 x tensor2 leaves 2 heads per tensor shard for Ulysses-2.
LAYOUTS = {
    "cfg2-context4-ring": ({"cfg": 2, "context": 4}, AttentionSettings(context_strategy="ring"), None),
    "cfg2-context4-ulysses": ({"cfg": 2, "context": 4}, AttentionSettings(context_strategy="ulysses"), None),
    "cfg2-context2-tensor2-ulysses": (
        {"cfg": 2, "context": 2, "tensor": 2},
        AttentionSettings(context_strategy="ulysses"),
        None,
    ),
    # Weights (transformer, UMT5, VAE) stored split 8 ways over cfg x context, gathered where used.
    "cfg2-context4-ring-fsdp": (
        {"cfg": 2, "context": 4},
        AttentionSettings(context_strategy="ring"),
        {"shard_over": ["cfg", "context"]},
    ),
}
PROMPT = "a photo of a cat"


def _kw(steps: int, output_type: str) -> dict:
    latents = np.random.default_rng(0).standard_normal((1, 4, 3, 6, 10)).astype(np.float32)
    return dict(
        negative_prompt="blurry",
        guidance_scale=5.0,
        height=H,
        width=W,
        num_frames=F,
        num_inference_steps=steps,
        latents=latents,
        output_type=output_type,
    )


@pytest.fixture(scope="module")
def reference(tiny_wan_path):
    """One device: the latents after one step and the video after STEPS steps."""
    pipe = load_pipeline(tiny_wan_path)
    step = pipe(PROMPT, **_kw(1, "latent")).images
    video = pipe(PROMPT, **_kw(STEPS, "np")).images
    assert video.std() > 1e-3 and np.abs(step).max() > 0.1
    return step, video


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_wan_layout_matches_single_device(tiny_wan_path, reference, name, record_property):
    sizes, settings, weights = LAYOUTS[name]
    n = int(np.prod(list(sizes.values())))
    pipe = load_pipeline(
        tiny_wan_path, mesh=sizes, devices=list(range(n)), attention=settings, weights=weights
    )
    step_ref, video_ref = reference
    step = pipe(PROMPT, **_kw(1, "latent")).images
    video = pipe(PROMPT, **_kw(STEPS, "np")).images
    latent_err = float(np.abs(step - step_ref).max())
    video_err = float(np.abs(video - video_ref).max())
    record_property("latent_max_abs_err", latent_err)
    record_property("video_max_abs_err", video_err)
    print(f"{name}: latent max abs err {latent_err:.2e}, video max abs err {video_err:.2e}")
    assert latent_err <= 1e-4, f"{name}: one denoise step, latents max abs error {latent_err:.2e}"
    assert video_err <= 1e-4, f"{name}: {STEPS}-step video max abs frame error {video_err:.2e}"
    if weights:
        # The layout really stores split weights: each device holds 1/8 of a q projection.
        q = pipe._states["transformer"]["blocks"][0]["attn1"]["to_q"]["kernel"][...]
        assert {s.data.shape for s in q.addressable_shards} == {(q.shape[0] // 8, q.shape[1])}


def test_ulysses_refuses_heads_that_do_not_divide(tiny_wan_path):
    """4 heads over Ulysses-8: a load-time error naming the heads, not a wrong video."""
    with pytest.raises(ValueError, match="head"):
        load_pipeline(
            tiny_wan_path,
            mesh={"context": 8},
            devices=list(range(8)),
            attention=AttentionSettings(context_strategy="ulysses"),
        )


def test_data_axis_splits_the_videos_of_a_batch(tiny_wan_path):
    """data2 x cfg2 x context2 (ring): two prompts with their own seeds and guidance (one without CFG), each
    video on its own side of the data axis, equal to the single-device batch."""
    kw = dict(
        negative_prompt=["blurry", None],
        guidance_scale=[5.0, 1.0],
        seed=[1, 2],
        height=H,
        width=W,
        num_frames=F,
        num_inference_steps=STEPS,
        output_type="np",
    )
    prompts = [PROMPT, "a dog on a beach"]
    expected = load_pipeline(tiny_wan_path)(prompts, **kw).images
    pipe = load_pipeline(
        tiny_wan_path,
        mesh={"data": 2, "cfg": 2, "context": 2},
        devices=list(range(8)),
        attention=AttentionSettings(context_strategy="ring"),
    )
    got = pipe(prompts, **kw).images
    err = float(np.abs(got - expected).max())
    print(f"data2-cfg2-context2-ring, 2 videos: max abs err {err:.2e}")
    assert err <= 1e-4
    assert float(np.abs(expected[0] - expected[1]).max()) > 1e-2

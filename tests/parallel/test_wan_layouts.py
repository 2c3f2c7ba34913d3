"""Every Wan layout gives the single-device result (8 CPU devices): CFG parallelism of the negative/positive
passes, context parallelism over the video tokens (ring, Ulysses), tensor parallelism over heads and FFN units,
and weights stored split over the mesh (FSDP).

The tiny Wan (4 heads of 16, 2 blocks) at 48 x 80 px and 9 frames has a 3 x 3 x 5 patch grid: 45 video
tokens, divisible by neither 2 nor 4, so every context layout pads the sequence and must mask the padded keys
(one attended pad would change every output). CFG runs (guidance 5, a negative prompt), so the transformer
batch is the interleaved [negative, positive] pair the cfg axis splits. Strategies are forced: with 45 tokens
`auto` would pick allgather everywhere. The 512 text tokens of the cross-attention stay whole on every device.
The VAE decode is split spatially over the devices the batch leaves (`decode_sharding`); the decode tests at
the end check the split and its exactness on widths that do not divide the device count.
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
    # Weights (transformer, UMT5, VAE) stored split 8 ways, gathered where used, are
    # tests/parallel/test_wan_i2v_layouts.py's (data2 x cfg2 x context2 with Ulysses): the same Wan modules.
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


# The decode program alone on given latents, batch 1: 48 x 80 px is 6 x 10 latents, whose 10 columns split
# over 8 (cfg2 x context4: one video leaves the cfg axis to the width) or 4 (context2 x tensor2) devices do not
# divide; nor do 48 x 112's 14 columns.
DECODE_LAYOUTS = {
    "cfg2-context4": ({"cfg": 2, "context": 4}, 8),
    "context2-tensor2": ({"context": 2, "tensor": 2}, 4),
}


def _decode(pipe, latents: np.ndarray):
    """The pipeline's vae_decode program (as __call__ runs it) on latents [B, T, h, w, C]."""
    shape = latents.shape[1:]
    return pipe.programs.run(
        "vae_decode", pipe.decode, {"shape": shape}, pipe._states["vae"], pipe.put_batch(latents)
    )


# One width per layout: each pair compiles two decode programs (~30 s of the suite), and both widths leave a
# short last shard on both layouts.
@pytest.mark.parametrize(
    "name,latent_hw",
    [("cfg2-context4", (6, 14)), ("context2-tensor2", (6, 10))],
    ids=["48x112-cfg2-context4", "48x80-context2-tensor2"],
)
def test_wan_decode_is_split_spatially_and_matches_single_device(tiny_wan_path, name, latent_hw):
    """Issue 10: one video's VAE decode split over the pool's devices, not replicated. The decoded video is
    split along its width over every mesh axis the batch does not use (each device holds 1/n of the columns)
    and equals the single-device decode; the widths do not divide the device count at the latent level."""
    sizes, n = DECODE_LAYOUTS[name]
    h, w = latent_hw
    latents = np.random.default_rng(1).standard_normal((1, 3, h, w, 4)).astype(np.float32)
    expected = np.asarray(_decode(load_pipeline(tiny_wan_path), latents))
    pipe = load_pipeline(tiny_wan_path, mesh=sizes, devices=list(range(n)))
    video = _decode(pipe, latents)
    err = float(np.abs(np.asarray(video) - expected).max())
    print(f"{name}, latents {h}x{w}: decode max abs err {err:.2e}")
    assert err <= 1e-5, f"{name}: decoded video max abs error {err:.2e}"
    assert expected.shape == (1, 9, 8 * h, 8 * w, 3)
    widths = sorted({s.data.shape[3] for s in video.addressable_shards})
    assert max(widths) == -(-8 * w // n), (
        name,
        widths,
    )  # the width split n ways (the last shard may be short)
    assert {s.data.shape[:3] for s in video.addressable_shards} == {(1, 9, 8 * h)}


def test_a_tiny_video_decodes_as_on_one_device(tiny_wan_path):
    """2x2 latents (a 16x16 video) on data 2 x context 4: split over context the decode's maps had under a
    column per device, where XLA's partitioned convolutions were wrong (0.33 max abs pixel); such maps stay
    whole across the spatial axes now (decode_constraint)."""
    latents = np.random.default_rng(2).standard_normal((2, 2, 2, 2, 4)).astype(np.float32)
    expected = np.asarray(_decode(load_pipeline(tiny_wan_path), latents))
    pipe = load_pipeline(tiny_wan_path, mesh={"data": 2, "context": 4}, devices=list(range(8)))
    err = float(np.abs(np.asarray(_decode(pipe, latents)) - expected).max())
    assert err <= 1e-5, f"decoded video max abs error {err:.2e}"
    assert expected.std() > 1e-3


def test_decode_sharding_splits_the_larger_side_over_the_axes_the_batch_leaves():
    from jax.sharding import PartitionSpec as P

    from meshserve.models.parallel.mesh import MeshSizes, make_mesh
    from meshserve.models.wan.pipeline import decode_sharding

    mesh = make_mesh(MeshSizes(data=2, cfg=2, context=2))
    # [B, T, H, W, C]: landscape splits W, portrait H; a batch of 1 leaves every axis to the picture.
    assert decode_sharding(mesh, 1, 30, 52).spec == P(None, None, None, ("data", "cfg", "context"), None)
    assert decode_sharding(mesh, 2, 30, 52).spec == P(("data",), None, None, ("cfg", "context"), None)
    assert decode_sharding(mesh, 4, 52, 30).spec == P(("data", "cfg"), None, "context", None, None)

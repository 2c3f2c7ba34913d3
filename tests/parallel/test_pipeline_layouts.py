"""Every mesh layout gives the single-device result: the SDXL denoise step and the whole pipeline (8 CPU devices)."""

import numpy as np
import pytest

from meshserve.models import load_pipeline
from meshserve.models.attention import AttentionSettings
from meshserve.models.parallel import LayoutError

H, W = 64, 48
# name -> (mesh sizes, attention settings, batch). The tiny UNet attends with 4 heads at its one attention
# level (16 x 12 = 192 latent tokens at 64 x 48); "context4-hybrid" splits context 4 into 2 Ulysses groups of
# 2 devices with a ring of 2 across them. Each layout compiles its own three programs (~35 s of the suite on a
# 2-core CPU), so the set covers every axis and strategy once: context 2 is in cfg2-context2-tensor2, and pure
# Ulysses runs on the same attention code in tests/parallel/test_flux_layouts.py and test_wan_layouts.py.
LAYOUTS = {
    "cfg2": ({"cfg": 2}, AttentionSettings(), 1),
    "context4-ring": ({"context": 4}, AttentionSettings(context_strategy="ring"), 1),
    "context4-hybrid": ({"context": 4}, AttentionSettings(context_strategy="hybrid", ulysses_degree=2), 1),
    "tensor2": ({"tensor": 2}, AttentionSettings(), 1),
    "cfg2-context2-tensor2": ({"cfg": 2, "context": 2, "tensor": 2}, AttentionSettings(), 1),
    "data2-batch2": ({"data": 2}, AttentionSettings(), 2),
}


@pytest.fixture(scope="module")
def single(tiny_sdxl_path):
    return load_pipeline(tiny_sdxl_path)


def _inputs(batch):
    rng = np.random.default_rng(batch)
    latents = rng.standard_normal((batch, 4, H // 2, W // 2)).astype(np.float32)
    prompts = ["a photo of a cat", "a red car"][:batch]
    return prompts, latents


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_device(tiny_sdxl_path, single, name, record_property):
    sizes, settings, batch = LAYOUTS[name]
    n = int(np.prod(list(sizes.values())))
    pipe = load_pipeline(tiny_sdxl_path, mesh=sizes, devices=list(range(n)), attention=settings)
    prompts, latents = _inputs(batch)
    # guidance_rescale's standard deviations run over every latent: sharded tokens (context) reduce across devices.
    # clip_skip's layer index and prompt_2's texts are text rows, split over `data` like the prompts.
    kw = dict(
        height=H,
        width=W,
        guidance_scale=5.0,
        guidance_rescale=0.7,
        negative_prompt="blurry",
        prompt_2="oil painting",
        clip_skip=[1, 0][:batch],
        latents=latents,
    )

    # One denoise step (UNet on the CFG batch + guidance + scheduler step), compared on the latents.
    step_ref = single(prompts, num_inference_steps=1, output_type="latent", **kw).images
    step = pipe(prompts, num_inference_steps=1, output_type="latent", **kw).images
    step_err = float(np.abs(step - step_ref).max() / np.abs(step_ref).max())
    # The whole pipeline, three steps and the VAE, compared on the pixels.
    full_ref = single(prompts, num_inference_steps=3, output_type="np", **kw).images
    full = pipe(prompts, num_inference_steps=3, output_type="np", **kw).images
    full_err = float(np.abs(full - full_ref).max())
    record_property("denoise_step_rel_err", step_err)
    record_property("pipeline_max_abs_err", full_err)
    assert step_err <= 1e-4, f"{name}: denoise step relative error {step_err:.2e}"
    assert full_err <= 1e-4, f"{name}: pipeline max abs pixel error {full_err:.2e}"
    assert full_ref.std() > 1e-3
    if name == "data2-batch2":  # given prompt embeddings: rows assembled on the mesh as the texts' are
        embeds = _diffusers_embeds(tiny_sdxl_path, prompts)
        given = {k: v for k, v in kw.items() if k not in ("prompt_2", "clip_skip")} | embeds
        full_ref = single(num_inference_steps=3, output_type="np", **given).images
        full = pipe(num_inference_steps=3, output_type="np", **given).images
        assert float(np.abs(full - full_ref).max()) <= 1e-4 and full_ref.std() > 1e-3


def _diffusers_embeds(path, prompts) -> dict:
    """diffusers' prompt_embeds and pooled_prompt_embeds of `prompts` (its own encode_prompt), as numpy."""
    import torch
    from diffusers import StableDiffusionXLPipeline

    reference = StableDiffusionXLPipeline.from_pretrained(str(path), torch_dtype=torch.float32)
    with torch.no_grad():
        pe, _, ppe, _ = reference.encode_prompt(prompts, device="cpu", do_classifier_free_guidance=False)
    return {"prompt_embeds": pe.numpy(), "pooled_prompt_embeds": ppe.numpy()}


def test_weights_are_sharded_not_copied(tiny_sdxl_path):
    pipe = load_pipeline(tiny_sdxl_path, mesh={"tensor": 2}, devices=[0, 1])
    state = pipe._states["unet"]
    q = state["down_blocks"][1]["attentions"][0]["transformer_blocks"][0]["attn1"]["to_q"]["kernel"][...]
    shard_shapes = {s.data.shape for s in q.addressable_shards}
    assert shard_shapes == {(q.shape[0], q.shape[1] // 2)}  # each device holds half the heads, no full copy


@pytest.mark.parametrize(
    "sizes,devices,match",
    [
        ({"tensor": 3}, [0, 1, 2], "does not split over tensor=3"),
        ({"cfg": 2}, [0, 1, 2, 3], "but the slice has 4"),
        ({"cfg": 4}, [0, 1, 2, 3], "cfg must be 1 or 2"),
    ],
)
def test_bad_layouts_fail_before_compiling(tiny_sdxl_path, sizes, devices, match):
    with pytest.raises(LayoutError, match=match):
        load_pipeline(tiny_sdxl_path, mesh=sizes, devices=devices)


def test_maps_of_a_row_per_device_match_single_device(tiny_sdxl_path, single):
    """At 8x8 pixels the tiny UNet's lower level is 2x2: split over context 2, a row per device, where XLA's
    partitioned convolutions were wrong on a mesh with a second axis (0.28 max abs pixel on cfg 2 x context 2,
    before models/parallel/small_maps.py). Text-to-image and inpainting (the VAE encoder's maps too)."""
    pipe = load_pipeline(tiny_sdxl_path, mesh={"cfg": 2, "context": 2}, devices=[0, 1, 2, 3])
    image = np.random.default_rng(0).random((8, 8, 3)).astype(np.float32)
    mask = np.zeros((8, 8), np.float32)
    mask[2:6, 2:6] = 1
    kw = dict(height=8, width=8, num_inference_steps=2, guidance_scale=5.0, seed=3, output_type="np")
    for extra in ({}, {"image": image, "mask_image": mask, "strength": 0.7}):
        ref = single(["a cat", "a dog"], **extra, **kw).images
        got = pipe(["a cat", "a dog"], **extra, **kw).images
        err = float(np.abs(got - ref).max())
        assert err <= 1e-4, f"{sorted(extra)}: max abs pixel error {err:.2e}"
        assert ref.std() > 1e-3

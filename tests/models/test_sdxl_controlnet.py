"""SDXL with a ControlNet against diffusers' StableDiffusionXLControlNetPipeline (the tiny SDXL and a tiny random
ControlNet whose zero convolutions were given weights: tests/fixtures/tiny_controlnet.py), fp32, the same
starting latents, two prompts with their own control images and negatives, CFG."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from meshserve.models import PipelineError, load_pipeline
from meshserve.models.engine.common import UnsupportedArgument
from tests.fixtures.parity import check_pixels, diffusers_pipeline, layout_error

log = logging.getLogger(__name__)

H, W = 48, 64  # latents 24 x 32
PROMPTS = ["a house", "a tree on a hill"]
NEGATIVE = ["blurry", "dark"]


def _controls(seed: int, size=(W, H)) -> list:
    """Two edge-map-like PIL pictures: white outlines on black, different."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        img = Image.new("RGB", size, (0, 0, 0))
        draw = ImageDraw.Draw(img)
        for _ in range(4):
            x0, x1 = sorted(int(v) for v in rng.integers(0, size[0], 2))
            y0, y1 = sorted(int(v) for v in rng.integers(0, size[1], 2))
            draw.rectangle((x0, y0, x1, y1), outline=(255, 255, 255), width=2)
        out.append(img)
    return out


def _latents(seed: int, rows: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 4, H // 2, W // 2)).astype(np.float32)


@pytest.fixture(scope="module")
def ours(tiny_sdxl_controlnet_path):
    return load_pipeline(tiny_sdxl_controlnet_path, dtype="float32")


@pytest.fixture(scope="module")
def reference(tiny_sdxl_controlnet_path):
    return diffusers_pipeline("StableDiffusionXLControlNetPipeline", tiny_sdxl_controlnet_path)


KW = dict(negative_prompt=NEGATIVE, guidance_scale=5.0, num_inference_steps=3, output_type="np")


def test_controlnet_matches_diffusers_and_a_new_scale_compiles_nothing(ours, reference):
    controls, latents = _controls(0), _latents(1)
    kw = dict(KW, image=controls, controlnet_conditioning_scale=0.8)
    expected = reference(PROMPTS, latents=torch.from_numpy(latents), **kw).images
    got = ours(PROMPTS, latents=latents, **kw)  # no size: the control images' (diffusers' rule)
    check_pixels(got.images, expected, "SDXL ControlNet, CFG, scale 0.8")
    compiled = ours.compilations
    weaker = ours(PROMPTS, latents=latents, **{**kw, "controlnet_conditioning_scale": [0.8, 0.0]})
    assert not weaker.compiled and ours.compilations == compiled
    np.testing.assert_array_equal(weaker.images[0], got.images[0])  # per row: row 0 kept its scale
    without = reference(
        PROMPTS, latents=torch.from_numpy(latents), **{**kw, "controlnet_conditioning_scale": 0.0}
    )
    check_pixels(weaker.images[1:], without.images[1:], "SDXL ControlNet, scale 0 on row 1")
    moved = float(np.abs(got.images[1] - weaker.images[1]).max())
    log.info("SDXL ControlNet: the control image moves row 1 by %.3f", moved)
    assert moved > 5e-3


def test_two_images_per_prompt_pair_as_diffusers(ours, reference):
    """Prompt p's control image serves its two images (diffusers' repeat_interleave), given as control_image=."""
    controls, latents = _controls(2), _latents(3, rows=4)
    kw = dict(KW, num_images_per_prompt=2, height=H, width=W)
    expected = reference(PROMPTS, image=controls, latents=torch.from_numpy(latents), **kw).images
    got = ours(PROMPTS, control_image=controls, latents=latents, **kw).images
    check_pixels(got, expected, "SDXL ControlNet, 2 prompts x 2 images")


def test_what_it_takes_and_refuses(ours):
    assert ours.tasks == ("text-to-image",) and ours.limits["control_image"] is True
    assert ours.limits["cache"] is None and ours.defaults["controlnet_conditioning_scale"] == 1.0
    controls = _controls(4)
    with pytest.raises(PipelineError, match="control_image"):
        ours(PROMPTS, **KW)
    with pytest.raises(PipelineError, match="not both"):
        ours(PROMPTS, image=controls, control_image=controls, **KW)
    with pytest.raises(PipelineError, match="0 <= start < end <= 1"):
        ours(PROMPTS, image=controls, control_guidance_start=0.5, control_guidance_end=0.5, **KW)
    with pytest.raises(UnsupportedArgument, match="controlnet_guidance"):
        ours(PROMPTS, image=controls, controlnet_guidance=0.5, **KW)
    with pytest.raises(PipelineError, match="cache"):
        ours(PROMPTS, image=controls, cache={"method": "teacache"}, **KW)


def test_the_guidance_window_is_diffusers_to_the_step(ours):
    """diffusers' controlnet_keep, in double precision: 0.3 of 10 steps keeps step 3 (3 / 10 == 0.3 there; in
    float32, 0.3 rounds up and would drop it), 0.7 keeps step 6."""
    for calls in (1, 3, 7, 10, 25, 59):
        for start, end in [(0.0, 1.0), (0.3, 0.7), (0.25, 0.75), (0.1, 0.15), (0.5, 1.0), (0.0, 0.01)]:
            keep = [
                1.0 - float(i / calls < start or (i + 1) / calls > end) for i in range(calls)
            ]  # diffusers'
            rows = ours.step_rows({"control_guidance_start": [start], "control_guidance_end": [end]}, calls)
            first, stop = rows["controlnet_first_step"][0], rows["controlnet_stop_step"][0]
            assert keep == [float(first <= i < stop) for i in range(calls)], (calls, start, end)
    rows = ours.step_rows({"control_guidance_start": [0.3], "control_guidance_end": [0.7]}, 10)
    assert (rows["controlnet_first_step"], rows["controlnet_stop_step"]) == ([3], [7])


def test_a_guidance_window_and_guess_mode_per_row_match_diffusers(ours, reference):
    """Row 0 with the ControlNet on steps 1 and 2 of 4 only, row 1 in guess mode (its unconditional pass without
    residuals, the ramp over levels), in one call compiled once; diffusers: a call for each."""
    controls, latents = _controls(10), _latents(11)
    kw = dict(KW, image=controls, num_inference_steps=4, height=H, width=W)
    window = dict(control_guidance_start=0.25, control_guidance_end=0.75)
    got = ours(
        PROMPTS,
        latents=latents,
        **kw,
        control_guidance_start=[0.25, 0.0],  # row 1: diffusers' defaults
        control_guidance_end=[0.75, 1.0],
        guess_mode=[False, True],
    )
    compiled = ours.compilations
    expected_window = reference(PROMPTS, latents=torch.from_numpy(latents), **kw, **window).images
    expected_guess = reference(PROMPTS, latents=torch.from_numpy(latents), **kw, guess_mode=True).images
    check_pixels(got.images[:1], expected_window[:1], "SDXL ControlNet, steps 1-2 of 4")
    check_pixels(got.images[1:], expected_guess[1:], "SDXL ControlNet, guess mode")
    plain = ours(PROMPTS, latents=latents, **kw)
    assert ours.compilations == compiled  # the window and guess mode are traced
    moved = [float(np.abs(plain.images[r] - got.images[r]).max()) for r in (0, 1)]
    log.info("SDXL ControlNet: the window moves row 0 by %.3f, guess mode row 1 by %.3f", *moved)
    assert min(moved) > 5e-3


def test_controlnet_on_a_layout_matches_one_device(ours, tiny_sdxl_controlnet_path):
    """cfg2 x context2, the weights (the UNet's and the ControlNet's) split over both."""
    kw = dict(KW, control_image=_controls(5), latents=_latents(6), height=H, width=W)
    err = layout_error(ours, tiny_sdxl_controlnet_path, {"cfg": 2, "context": 2}, PROMPTS, **kw)
    log.info("SDXL ControlNet cfg2 x context2: max abs %.2e of one device's latents", err)
    assert err <= 1e-4


def test_a_unet_lora_matches_diffusers_with_the_controlnet(ours, tiny_sdxl_controlnet_path, tmp_path):
    """The ControlNet rides inside the denoiser's module, the UNet's layer names unchanged: a UNet adapter finds
    its layers (diffusers' load_lora_weights on its ControlNet pipeline as the reference)."""

    from tests.fixtures.tiny_lora import random_factors, write_diffusers_lora

    ref = diffusers_pipeline("StableDiffusionXLControlNetPipeline", tiny_sdxl_controlnet_path)
    factors = random_factors(ref.unet, r"attn[12]\.to_(q|v)$", rank=4, seed=7)
    adapter = write_diffusers_lora(tmp_path / "a.safetensors", factors, prefix="unet")
    ref.load_lora_weights(str(adapter))
    ours.load_lora("a", adapter)
    controls, latents = _controls(8), _latents(9)
    kw = dict(KW, image=controls, height=H, width=W)
    expected = ref(PROMPTS, latents=torch.from_numpy(latents), **kw).images
    got = ours(PROMPTS, latents=latents, loras=[{"name": "a", "scale": 1.0}], **kw).images
    check_pixels(got, expected, "SDXL ControlNet with a UNet LoRA")
    plain = ours(PROMPTS, latents=latents, **kw).images
    assert float(np.abs(plain - got).max()) > 5e-3

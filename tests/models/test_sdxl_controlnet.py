"""SDXL with a ControlNet against diffusers' StableDiffusionXLControlNetPipeline (the tiny SDXL and a tiny random
ControlNet whose zero convolutions were given weights: tests/fixtures/tiny_controlnet.py), fp32, the same
starting latents, two prompts with their own control images and negatives, CFG."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from meshserve.models import ModelFolderError, PipelineError, load_pipeline
from meshserve.models.engine.common import UnsupportedArgument
from tests.fixtures.parity import check_pixels, diffusers_pipeline, gradient_pictures, layout_error

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


def _pictures(seed: int) -> list:
    return gradient_pictures(seed, H, W)


@pytest.fixture
def same_noise(monkeypatch):
    """diffusers' ControlNet image pipelines draw the test's noise and encode to the posterior's mode."""
    from diffusers.pipelines.controlnet import (
        pipeline_controlnet_inpaint_sd_xl,
        pipeline_controlnet_sd_xl_img2img,
    )

    from tests.fixtures.diffusers_noise import same_noise as patch_noise

    return patch_noise(monkeypatch, pipeline_controlnet_sd_xl_img2img, pipeline_controlnet_inpaint_sd_xl)


@pytest.mark.parametrize("task", ["image-to-image", "inpaint"])
def test_image_tasks_with_the_controlnet_match_diffusers(ours, reference, same_noise, task):
    """StableDiffusionXLControlNetImg2ImgPipeline / ...InpaintPipeline: image= the picture, control_image= the
    control; the window counts the steps the strength leaves (diffusers' len(timesteps)): strength 0.75 of 4
    steps runs 3, and end 0.5 steers the first of them only (1 / 3 <= 0.5 < 2 / 3)."""
    from diffusers import (
        StableDiffusionXLControlNetImg2ImgPipeline,
        StableDiffusionXLControlNetInpaintPipeline,
    )
    from PIL import Image

    cls = {"image-to-image": StableDiffusionXLControlNetImg2ImgPipeline}.get(
        task, StableDiffusionXLControlNetInpaintPipeline
    )
    ref = cls.from_pipe(reference)
    ref.set_progress_bar_config(disable=True)
    noise = _latents(12)
    same_noise["noise"] = noise
    kw = dict(KW, image=_pictures(13), control_image=_controls(14), num_inference_steps=4, height=H, width=W)
    kw |= dict(strength=0.75, controlnet_conditioning_scale=0.8, control_guidance_end=0.5)
    if task == "inpaint":
        y, x = np.mgrid[0:H, 0:W]
        kw["mask_image"] = [
            Image.fromarray((((y > 8) & (x > 12) & (x < 48)) * 255).astype(np.uint8)),
            Image.fromarray((((y - 24) ** 2 + (x - 30) ** 2 < 15**2) * 255).astype(np.uint8)),
        ]
    expected = ref(PROMPTS, **kw).images
    got = ours(PROMPTS, latents=noise, **kw)
    check_pixels(got.images, expected, f"SDXL ControlNet {task}, strength 0.75, end 0.5")
    steered_all = ours(PROMPTS, latents=noise, **{**kw, "control_guidance_end": 1.0}).images
    assert float(np.abs(steered_all - got.images).max()) > 5e-3  # the window counted the strength's steps


def test_inpaint_with_a_9_channel_unet_matches_diffusers(tiny_sdxl_path, tmp_path, same_noise):
    """The inpainting UNet takes [latents, mask, masked image latents]; the ControlNet (of the 4-channel UNet)
    the latents alone, as diffusers' StableDiffusionXLControlNetInpaintPipeline."""
    from diffusers import StableDiffusionXLControlNetInpaintPipeline, StableDiffusionXLPipeline
    from PIL import Image

    from tests.fixtures.tiny_controlnet import build_tiny_controlnet
    from tests.fixtures.tiny_sdxl import build_tiny_sdxl

    inpaint = StableDiffusionXLPipeline.from_pretrained(
        str(build_tiny_sdxl(tmp_path / "inpaint", inpaint=True)), torch_dtype=torch.float32
    )
    names = ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "unet", "scheduler")
    ref = StableDiffusionXLControlNetInpaintPipeline(
        **{k: inpaint.components[k] for k in names}, controlnet=build_tiny_controlnet(tiny_sdxl_path)
    )
    ref.save_pretrained(str(tmp_path / "folder"), safe_serialization=True)
    ref.set_progress_bar_config(disable=True)
    ours = load_pipeline(tmp_path / "folder", dtype="float32")
    assert ours.tasks == ("inpaint",)
    noise = _latents(16)
    same_noise["noise"] = noise
    y, x = np.mgrid[0:H, 0:W]
    mask = Image.fromarray((((y > 8) & (x > 12) & (x < 48)) * 255).astype(np.uint8))
    kw = dict(KW, image=_pictures(17), mask_image=mask, control_image=_controls(18), height=H, width=W)
    expected = ref(PROMPTS, **kw, strength=0.75).images
    got = ours(PROMPTS, latents=noise, **kw, strength=0.75).images
    check_pixels(got, expected, "SDXL ControlNet inpaint, 9-channel UNet, strength 0.75")


def test_a_generator_reproduces_diffusers_text_to_image(ours, reference):
    """diffusers draws nothing for the control image (the ControlNet reads its pixels): generator= replays
    the starting noise as diffusers draws it."""
    kw = dict(KW, image=_controls(15), height=H, width=W)
    expected = reference(PROMPTS, generator=torch.Generator().manual_seed(3), **kw).images
    got = ours(PROMPTS, generator=torch.Generator().manual_seed(3), **kw).images
    check_pixels(got, expected, "SDXL ControlNet, generator=")


def test_what_it_takes_and_refuses(ours):
    assert (
        ours.tasks == ("text-to-image", "image-to-image", "inpaint") and ours.limits["control_image"] is True
    )
    assert ours.limits["cache"] is None and ours.defaults["controlnet_conditioning_scale"] == 1.0
    controls = _controls(4)
    with pytest.raises(PipelineError, match="control_image"):
        ours(PROMPTS, **KW)
    with pytest.raises(PipelineError, match="control_image="):  # inpaint: image= is the picture
        ours(PROMPTS, image=controls, mask_image=controls, **KW)
    with pytest.raises(PipelineError, match="padding_mask_crop"):
        ours(PROMPTS, image=controls, control_image=controls, mask_image=controls, padding_mask_crop=8, **KW)
    with pytest.raises(PipelineError, match="0 <= start < end <= 1"):
        ours(PROMPTS, image=controls, control_guidance_start=0.5, control_guidance_end=0.5, **KW)
    with pytest.raises(UnsupportedArgument, match="controlnet_guidance"):
        ours(PROMPTS, image=controls, controlnet_guidance=0.5, **KW)
    with pytest.raises(PipelineError, match="cache"):
        ours(PROMPTS, image=controls, cache={"method": "teacache"}, **KW)


def test_the_guidance_window_is_diffusers_to_the_step(ours):
    """diffusers' controlnet_keep over the steps a call runs, in double precision: 0.3 of 10 steps keeps step 3
    (3 / 10 == 0.3 there; in float32, 0.3 rounds up and would drop it), 0.7 keeps step 6; a strength that
    starts at step `start` counts the steps from there (diffusers' len(timesteps) after get_timesteps)."""
    for calls in (1, 3, 7, 10, 25, 59):
        for start in {0, calls // 3}:
            runs = calls - start
            for begin, end in [(0.0, 1.0), (0.3, 0.7), (0.25, 0.75), (0.1, 0.15), (0.5, 1.0), (0.0, 0.01)]:
                keep = [
                    1.0 - float(i / runs < begin or (i + 1) / runs > end) for i in range(runs)
                ]  # diffusers'
                window = {"control_guidance_start": [begin], "control_guidance_end": [end]}
                rows = ours.step_rows(window, start, calls)
                first, stop = rows["controlnet_first_step"][0], rows["controlnet_stop_step"][0]
                assert keep == [float(first <= start + i < stop) for i in range(runs)], (
                    calls,
                    start,
                    begin,
                    end,
                )
    rows = ours.step_rows({"control_guidance_start": [0.3], "control_guidance_end": [0.7]}, 0, 10)
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


def test_a_controlnet_whose_residuals_miss_the_unets_skips_is_refused(tiny_sdxl_controlnet_path, tmp_path):
    """One layer per block where the UNet has two: its residuals could not meet the UNet's skips."""
    from diffusers import ControlNetModel

    folder = tmp_path / "folder"
    folder.mkdir()
    for part in tiny_sdxl_controlnet_path.iterdir():
        if part.name != "controlnet":
            (folder / part.name).symlink_to(part)
    config = dict(ControlNetModel.load_config(str(tiny_sdxl_controlnet_path / "controlnet")))
    assert config["layers_per_block"] == 2
    config = {k: v for k, v in config.items() if not k.startswith("_")} | {"layers_per_block": 1}
    ControlNetModel.from_config(config).save_pretrained(str(folder / "controlnet"))
    with pytest.raises(ModelFolderError, match="layers_per_block"):
        load_pipeline(folder, dtype="float32")

"""FLUX.1 Canny/Depth against diffusers' FluxControlPipeline (a tiny Control folder diffusers wrote, fp32).

Both sides draw the same noise (diffusers' `randn_tensor` returns the test's array, ours takes it packed as
`latents=`) and encode the control image to its posterior's mode (diffusers samples it:
tests/fixtures/diffusers_noise.py). Two prompts with a control image each and two images per prompt, so the
control images' pairing with the rows (diffusers' repeat_interleave: p0 i0, p0 i0, p1 i1, p1 i1) is checked.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from meshserve.models import PipelineError, load_pipeline
from tests.fixtures.diffusers_noise import same_noise as patch_noise
from tests.fixtures.parity import (
    check_pixels,
    diffusers_pipeline,
    flux_noise,
    gradient_pictures,
    layout_error,
)

log = logging.getLogger(__name__)

H, W = 36, 44  # latents 18 x 22, 99 packed tokens
PROMPTS = ["a house by a lake", "a portrait"]
KW = dict(height=H, width=W, num_inference_steps=4, max_sequence_length=24, output_type="np")


def _controls(seed: int) -> list:
    """Two edge-map-like pictures: white lines on black, different."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        img = Image.new("RGB", (W, H), (0, 0, 0))
        draw = ImageDraw.Draw(img)
        for _ in range(4):
            x0, x1 = sorted(rng.integers(0, W, 2))
            y0, y1 = sorted(rng.integers(0, H, 2))
            draw.rectangle((int(x0), int(y0), int(x1), int(y1)), outline=(255, 255, 255))
        out.append(img)
    return out


def _pictures(seed: int) -> list:
    return gradient_pictures(seed, H, W)


@pytest.fixture
def same_noise(monkeypatch):
    from diffusers.pipelines.flux import (
        pipeline_flux_control,
        pipeline_flux_control_img2img,
        pipeline_flux_control_inpaint,
    )

    return patch_noise(
        monkeypatch, pipeline_flux_control, pipeline_flux_control_img2img, pipeline_flux_control_inpaint
    )


@pytest.fixture(scope="module")
def ours(tiny_flux_control_path):
    return load_pipeline(tiny_flux_control_path, dtype="float32")


@pytest.fixture(scope="module")
def reference(tiny_flux_control_path):
    return diffusers_pipeline("FluxControlPipeline", tiny_flux_control_path)


def test_control_matches_diffusers_and_other_controls_compile_nothing(ours, reference, same_noise):
    controls = _controls(0)
    same_noise["noise"], packed = flux_noise(1, 4, H, W)
    kw = dict(KW, control_image=controls, num_images_per_prompt=2, guidance_scale=3.5)
    expected = reference(PROMPTS, **kw).images
    got = ours(PROMPTS, latents=packed, **kw)
    check_pixels(got.images, expected, "FLUX.1 Control, 2 prompts x 2 images")
    other = ours(PROMPTS, latents=packed, **{**kw, "control_image": _controls(2)})
    assert not other.compiled
    moved = float(np.abs(other.images - got.images).max())
    log.info("FLUX.1 Control: other control images move the output by %.3f", moved)
    assert moved > 5e-3


@pytest.mark.parametrize("task", ["image-to-image", "inpaint"])
def test_image_tasks_with_the_control_image_match_diffusers(ours, tiny_flux_control_path, same_noise, task):
    """FluxControlImg2ImgPipeline / FluxControlInpaintPipeline: image= the picture, control_image= the control,
    strength 0.75 (the inpaint puts the known region back every step)."""
    from PIL import Image

    name = {"image-to-image": "FluxControlImg2ImgPipeline"}.get(task, "FluxControlInpaintPipeline")
    ref = diffusers_pipeline(name, tiny_flux_control_path)
    same_noise["noise"], packed = flux_noise(7, 2, H, W)
    kw = dict(KW, image=_pictures(8), control_image=_controls(9), strength=0.75, guidance_scale=3.5)
    if task == "inpaint":
        y, x = np.mgrid[0:H, 0:W]
        kw["mask_image"] = [
            Image.fromarray((((y > 6) & (x > 10) & (x < 36)) * 255).astype(np.uint8)),
            Image.fromarray((((y - 18) ** 2 + (x - 22) ** 2 < 12**2) * 255).astype(np.uint8)),
        ]
    expected = ref(PROMPTS, **kw).images
    got = ours(PROMPTS, latents=packed, **kw).images
    check_pixels(got, expected, f"FLUX.1 Control {task}, strength 0.75")


def test_what_it_takes_and_refuses(ours):
    import torch

    assert ours.tasks == ("text-to-image", "image-to-image", "inpaint")
    assert ours.limits["control_image"] is True
    assert ours.limits["strength"]["defaults"] == {"image-to-image": 0.6, "inpaint": 0.6}
    controls = _controls(3)
    with pytest.raises(PipelineError, match="control_image"):
        ours(PROMPTS, **KW)
    with pytest.raises(PipelineError, match="control_image: expected"):
        ours(PROMPTS, control_image=controls + controls[:1], **KW)
    with pytest.raises(PipelineError, match="generator"):
        ours(PROMPTS, control_image=controls, generator=torch.Generator().manual_seed(0), **KW)
    with pytest.raises(PipelineError, match="padding_mask_crop"):
        ours(PROMPTS, control_image=controls, image=controls, mask_image=controls, padding_mask_crop=4, **KW)


def test_a_warmed_up_call_compiles_nothing(ours):
    ours.warm_up(buckets=[(32, 24)])
    compiled = ours.compilations
    out = ours(PROMPTS[0], control_image=_controls(4)[0], height=24, width=32, seed=3, num_inference_steps=2)
    assert out.images[0].size == (32, 24)
    assert not out.compiled and ours.compilations == compiled


def test_control_on_a_layout_matches_one_device(ours, tiny_flux_control_path):
    """cfg2 x context2 with true CFG (an extension: both passes see the control image), the weights split."""
    kw = dict(KW, control_image=_controls(5), latents=flux_noise(6, 2, H, W)[1])
    kw |= {"negative_prompt": ["blurry", None], "true_cfg_scale": 2.0}
    err = layout_error(ours, tiny_flux_control_path, {"cfg": 2, "context": 2}, PROMPTS, **kw)
    log.info("FLUX.1 Control cfg2 x context2: max abs %.2e of one device's latents", err)
    assert err <= 1e-4

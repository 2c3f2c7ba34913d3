"""FLUX.1 Fill against diffusers' FluxFillPipeline (a tiny Fill folder diffusers wrote, fp32).

Both sides draw the same noise (diffusers' `randn_tensor` returns the test's array, ours takes it packed as
`latents=`) and encode to the posterior's mode (diffusers samples it: tests/fixtures/diffusers_noise.py). Two
prompts with different PIL images and masks (a band and a disc, not symmetric, so a mask folded into
channels in the wrong order fails), non-square.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from meshserve.models import PipelineError, load_pipeline
from tests.fixtures.diffusers_noise import same_noise as patch_noise
from tests.fixtures.parity import check_pixels, diffusers_pipeline, flux_noise, layout_error

log = logging.getLogger(__name__)

H, W = 36, 44  # latents 18 x 22, 99 packed tokens
PROMPTS = ["a red door", "a tree on a hill"]
KW = dict(height=H, width=W, num_inference_steps=4, max_sequence_length=24, output_type="np")


def _inputs(seed: int) -> tuple[list, list]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:H, 0:W]
    images = []
    for _ in range(2):
        a, b = rng.uniform(0.2, 0.8, 2)
        img = np.stack([a * x / W + 0.2, b * y / H + 0.1, 1 - x * y / (H * W)], axis=-1)
        img = np.clip(img + 0.05 * rng.standard_normal(img.shape), 0, 1)
        images.append(Image.fromarray((img * 255).astype(np.uint8)))
    band = ((y > 6) & (y < 25) & (x > 3)) * 255
    disc = (((y - 20) ** 2 + (x - 30) ** 2) < 90) * 255
    return images, [Image.fromarray(m.astype(np.uint8)) for m in (band, disc)]


@pytest.fixture
def same_noise(monkeypatch):
    from diffusers.pipelines.flux import pipeline_flux_fill

    return patch_noise(monkeypatch, pipeline_flux_fill)


@pytest.fixture(scope="module")
def ours(tiny_flux_fill_path):
    return load_pipeline(tiny_flux_fill_path, dtype="float32")


@pytest.fixture(scope="module")
def reference(tiny_flux_fill_path):
    return diffusers_pipeline("FluxFillPipeline", tiny_flux_fill_path)


@pytest.mark.parametrize("strength", [1.0, 0.75])
def test_fill_matches_diffusers(ours, reference, same_noise, strength):
    images, masks = _inputs(0)
    same_noise["noise"], packed = flux_noise(1, 2, H, W)
    kw = dict(KW, image=images, mask_image=masks, strength=strength, guidance_scale=30.0)
    expected = reference(PROMPTS, **kw).images
    got = ours(PROMPTS, latents=packed, **kw)
    check_pixels(got.images, expected, f"FLUX.1 Fill, strength {strength}")
    if strength == 1.0:  # the masked image and the mask reach the model: other ones, another picture
        other_images, other_masks = _inputs(2)
        other = ours(PROMPTS, latents=packed, **{**kw, "image": other_images, "mask_image": other_masks})
        assert not other.compiled
        moved = float(np.abs(other.images - got.images).max())
        log.info("FLUX.1 Fill: other images and masks move the output by %.3f", moved)
        assert moved > 5e-3


def test_defaults_tasks_and_limits(ours):
    assert ours.tasks == ("inpaint",)
    assert ours.limits["tasks"] == ["inpaint"]
    assert ours.limits["strength"]["defaults"] == {"inpaint": 1.0}
    assert (ours.defaults["num_inference_steps"], ours.defaults["guidance_scale"]) == (50, 30.0)
    assert ours.condition_channels == 32 and ours.transformer_config.in_channels == 48
    images, masks = _inputs(3)
    with pytest.raises(PipelineError, match="inpaint"):
        ours(PROMPTS, image=images, **KW)  # an image without a mask: not a task this model takes
    with pytest.raises(PipelineError, match="needs an image"):
        ours(PROMPTS, **KW)


def test_fill_on_a_layout_matches_one_device(ours, tiny_flux_fill_path):
    """data2 x context2, the weights split over both: the two rows (and their conditions) over data, the
    joint [text, image] tokens over context."""
    images, masks = _inputs(4)
    kw = dict(KW, image=images, mask_image=masks, latents=flux_noise(5, 2, H, W)[1])
    err = layout_error(ours, tiny_flux_fill_path, {"data": 2, "context": 2}, PROMPTS, **kw)
    log.info("FLUX.1 Fill data2 x context2: max abs %.2e of one device's latents", err)
    assert err <= 1e-4

"""FLUX.1 Kontext against diffusers' FluxKontextPipeline (tiny dev components in a Kontext folder, fp32).

Both sides get the same packed noise as `latents=` and PIL images at the call's size; diffusers runs with
`_auto_resize=False` and `max_area=height * width`, the one setting where its image and output sizes are the
call's (models/flux/pipeline_kontext.py says why ours always are).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from meshserve.models import PipelineError, load_pipeline
from tests.fixtures.parity import (
    check_pixels,
    diffusers_pipeline,
    flux_noise,
    gradient_pictures,
    layout_error,
)

log = logging.getLogger(__name__)

H, W = 36, 44  # latents 18 x 22: 99 packed tokens, and 99 more of the image
PROMPTS = ["turn the cat into a dog", "make it night"]
NEGATIVE = ["blurry", "ugly"]
KW = dict(
    guidance_scale=3.5,
    height=H,
    width=W,
    num_inference_steps=4,
    max_sequence_length=24,
    output_type="np",
)


def _pictures(seed: int) -> list:
    return gradient_pictures(seed, H, W, grain=0.05)


@pytest.fixture(scope="module")
def ours(tiny_flux_kontext_path):
    return load_pipeline(tiny_flux_kontext_path, dtype="float32")


@pytest.fixture(scope="module")
def reference(tiny_flux_kontext_path):
    return diffusers_pipeline("FluxKontextPipeline", tiny_flux_kontext_path)


def _diffusers(reference, latents, **kw):
    import torch

    latents = torch.from_numpy(latents.copy())
    return reference(prompt=PROMPTS, latents=latents, max_area=H * W, _auto_resize=False, **KW, **kw).images


def test_editing_matches_diffusers_and_other_images_compile_nothing(ours, reference):
    pictures, latents = _pictures(0), flux_noise(1, 2, H, W)[1]
    cfg = dict(negative_prompt=NEGATIVE, true_cfg_scale=2.0)
    expected = _diffusers(reference, latents, image=pictures, **cfg)
    got = ours(PROMPTS, image=pictures, latents=latents, **cfg, **KW).images
    check_pixels(got, expected, "Kontext editing, true CFG")
    without_image = _diffusers(reference, latents, **cfg)
    moved = float(np.abs(expected - without_image).max())
    log.info("Kontext: the image moves the output by %.3f (max abs pixel)", moved)
    assert moved > 5e-3  # over 5x the tolerance: a parity test that drops or misplaces the image fails

    compiled = ours.compilations
    other = ours(PROMPTS, image=_pictures(2), latents=latents, **KW).images  # no CFG: a program of its own
    expected = _diffusers(reference, latents, image=_pictures(2))
    check_pixels(other, expected, "Kontext editing, no true CFG")
    again = ours(PROMPTS, image=_pictures(3), latents=latents, **KW)
    assert not again.compiled and ours.compilations == compiled + 2  # `other`'s no-CFG text_encode, denoise
    assert not np.allclose(again.images, other)


def test_text_to_image_matches_diffusers_without_an_image(ours, reference):
    latents = flux_noise(4, 2, H, W)[1]
    expected = _diffusers(reference, latents)
    check_pixels(ours(PROMPTS, latents=latents, **KW).images, expected, "Kontext without an image")


def test_tasks_limits_and_what_it_refuses(ours):
    assert ours.tasks == ("text-to-image", "image-to-image")
    assert ours.limits["tasks"] == ["text-to-image", "image-to-image"]
    assert ours.limits["strength"] is None
    assert ours.batch_key({"image": "ref", "width": W, "height": H})[:2] == ("image-to-image", None)
    pictures = _pictures(5)
    with pytest.raises(PipelineError, match="strength"):
        ours(PROMPTS, image=pictures, strength=0.5, **KW)
    with pytest.raises(PipelineError, match="inpaint"):
        ours(PROMPTS, image=pictures, mask_image=pictures, **KW)


def test_editing_on_a_layout_matches_one_device(ours, tiny_flux_kontext_path):
    """cfg2 x context2, the weights split over both: the [text, latents, image] sequence's tokens over the
    context pair (padded), each row's two true-CFG passes over cfg."""
    kw = dict(
        KW,
        image=_pictures(6),
        latents=flux_noise(7, 2, H, W)[1],
        negative_prompt=NEGATIVE,
        true_cfg_scale=2.0,
    )
    err = layout_error(ours, tiny_flux_kontext_path, {"cfg": 2, "context": 2}, PROMPTS, **kw)
    log.info("Kontext editing cfg2 x context2: max abs %.2e of one device's latents", err)
    assert err <= 1e-4


def test_a_warmed_up_edit_compiles_nothing(ours):
    ours.warm_up(buckets=[(32, 24)], batch_sizes=[2], tasks=["image-to-image"])
    compiled = ours.compilations
    kw = {**KW, "width": 32, "height": 24, "max_sequence_length": 512}  # warm_up's text length: the default
    out = ours(PROMPTS, image=_pictures(8), seed=[1, 2], **kw)
    assert out.images.shape == (2, 24, 32, 3)
    assert not out.compiled and ours.compilations == compiled

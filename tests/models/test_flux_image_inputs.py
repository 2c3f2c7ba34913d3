"""Flux.1 image inputs against diffusers' FluxImg2ImgPipeline and FluxInpaintPipeline (tiny dev, fp32).

Both sides get the same noise: diffusers' `randn_tensor` is replaced by the test's array (ours takes it packed
as `latents=`), its posterior `sample()` by `mode()`. One run per pipeline: a batch of 2 prompts with
different images, non-square, true CFG with negatives, strength < 1, images resized by both sides.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshserve.models import load_pipeline
from meshserve.models.flux.pipeline import pack_latents
from tests.fixtures.diffusers_noise import same_noise as patch_noise

H, W = 36, 44  # latents 18 x 22, 99 packed tokens
PROMPTS = ["a cat", "the dog and the cat"]
NEGATIVE = ["blurry", "ugly"]
TEXT = 24
STEPS = 4


def _images(seed: int, height: int, width: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    out = []
    for _ in range(2):
        a, b, c = rng.uniform(0.2, 0.8, 3)
        img = np.stack([a * x + 0.2, b * y + 0.1, c * (1 - x * y)], axis=-1)
        out.append(np.clip(img + 0.05 * rng.standard_normal(img.shape), 0, 1).astype(np.float32))
    return out


def _noise(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """diffusers' unpacked noise [2, 4, 18, 22] and ours, packed [2, 99, 16]."""
    noise = np.random.default_rng(seed).standard_normal((2, 4, H // 2, W // 2)).astype(np.float32)
    return noise, np.asarray(pack_latents(noise.transpose(0, 2, 3, 1)))


@pytest.fixture
def same_noise(monkeypatch):
    """diffusers' Flux image pipelines draw `holder["noise"]` and encode to the posterior's mode."""
    from diffusers.pipelines.flux import pipeline_flux_img2img, pipeline_flux_inpaint

    return patch_noise(monkeypatch, pipeline_flux_img2img, pipeline_flux_inpaint)


@pytest.fixture(scope="module")
def dev(tiny_flux_dev_path):
    return load_pipeline(tiny_flux_dev_path, dtype="float32")


@pytest.fixture(scope="module")
def reference(tiny_flux_dev_path):
    import torch
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(str(tiny_flux_dev_path), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


KW = dict(
    negative_prompt=NEGATIVE,
    true_cfg_scale=2.0,
    guidance_scale=3.5,
    height=H,
    width=W,
    num_inference_steps=STEPS,
    max_sequence_length=TEXT,
    output_type="np",
)


def _check(got, expected, what):
    assert got.shape == expected.shape, (got.shape, expected.shape)
    err = float(np.abs(got - expected).max())
    print(f"{what}: max abs pixel difference from diffusers {err:.2e}")  # the figure the note quotes (-rP)
    assert err <= 1e-3, f"{what}: max abs pixel difference {err:.2e}"
    assert expected.std() > 1e-3


def test_img2img_matches_diffusers_and_never_recompiles(dev, reference, same_noise):
    from diffusers import FluxImg2ImgPipeline

    ref = FluxImg2ImgPipeline.from_pipe(reference)
    ref.set_progress_bar_config(disable=True)
    images = _images(0, 2 * H, 2 * W)  # numpy at twice the size: both resize by nearest neighbour
    same_noise["noise"], packed = _noise(1)
    expected = ref(PROMPTS, image=images, strength=0.6, **KW).images
    steps = []
    got = dev(
        PROMPTS, image=images, strength=0.6, latents=packed, callback=lambda s, t: steps.append(t), **KW
    )
    _check(got.images, expected, "Flux img2img")
    assert steps == [3, 3, 3]  # Flux's rule: int(4 - 4 x 0.6) = 1 is the start, 3 steps run

    before = dev.compilations
    other = dev(PROMPTS, image=images[::-1], strength=0.9, latents=packed[::-1].copy(), **KW)
    assert dev.compilations == before and not other.compiled
    assert not np.allclose(other.images, got.images)


def test_inpaint_matches_diffusers(dev, reference, same_noise):
    from diffusers import FluxInpaintPipeline
    from PIL import Image

    ref = FluxInpaintPipeline.from_pipe(reference)
    ref.set_progress_bar_config(disable=True)
    images = [Image.fromarray((i * 255).astype(np.uint8)) for i in _images(2, 40, 40)]
    y, x = np.mgrid[0:40, 0:40]
    masks = [
        Image.fromarray((((y > 8) & (y < 30) & (x > 4)) * 255).astype(np.uint8)),
        Image.fromarray(((((y - 20) ** 2 + (x - 18) ** 2) < 100) * 255).astype(np.uint8)),
    ]
    same_noise["noise"], packed = _noise(3)
    expected = ref(PROMPTS, image=images, mask_image=masks, strength=0.75, **KW).images
    got = dev(PROMPTS, image=images, mask_image=masks, strength=0.75, latents=packed, **KW).images
    _check(got, expected, "Flux inpaint")


def test_padding_mask_crop_matches_diffusers(dev, reference, same_noise):
    """The masked region inpainted at the call's size and laid back into the image (8-bit outputs: diffusers
    takes one PIL image and mask and gives PIL images)."""
    from diffusers import FluxInpaintPipeline
    from PIL import Image

    ref = FluxInpaintPipeline.from_pipe(reference)
    ref.set_progress_bar_config(disable=True)
    image = Image.fromarray((_images(5, 70, 100)[1] * 255).astype(np.uint8))
    values = np.zeros((70, 100), np.uint8)
    values[40:62, 55:70] = 255
    mask = Image.fromarray(values)
    same_noise["noise"], packed = _noise(6)
    kw = dict(KW, image=image, mask_image=mask, strength=0.8, padding_mask_crop=3, output_type="pil")
    expected = np.stack([np.asarray(im) for im in ref(PROMPTS, **kw).images])
    got = dev(PROMPTS, latents=packed, **kw).images
    assert [im.size for im in got] == [(100, 70)] * 2
    got = np.stack([np.asarray(im) for im in got])
    diff = np.abs(got.astype(int) - expected.astype(int))
    print(f"Flux padding_mask_crop: max {diff.max()} / 255, {np.mean(diff > 0):.2%} of pixel values differ")
    assert diff.max() <= 2 and np.mean(diff > 0) < 0.02  # 8-bit: a rounding flip, spread by the scaling back
    assert np.array_equal(got[0][values == 0], np.asarray(image)[values == 0])
    assert np.std(got[0][values > 0].astype(float)) > 1


def test_one_image_per_prompt_is_tiled_over_its_images_as_diffusers_does(dev, reference, same_noise):
    """Two prompts, an image and a mask each, two images per prompt: diffusers repeats the prompts
    prompt-major (p0, p0, p1, p1) and tiles the images and masks (i0, i1, i0, i1); so does ours."""
    from diffusers import FluxInpaintPipeline

    ref = FluxInpaintPipeline.from_pipe(reference)
    ref.set_progress_bar_config(disable=True)
    images = _images(4, H, W)
    masks = [np.zeros((H, W), np.float32), np.ones((H, W), np.float32)]
    masks[0][8:30, 4:] = 1.0
    noise = np.random.default_rng(5).standard_normal((4, 4, H // 2, W // 2)).astype(np.float32)
    same_noise["noise"], packed = noise, np.asarray(pack_latents(noise.transpose(0, 2, 3, 1)))
    kw = {**KW, "num_images_per_prompt": 2}
    expected = ref(PROMPTS, image=images, mask_image=masks, strength=0.75, **kw).images
    got = dev(PROMPTS, image=images, mask_image=masks, strength=0.75, latents=packed, **kw).images
    _check(got, expected, "Flux inpaint, 2 images per prompt")


def test_tasks_and_limits(dev):
    assert dev.tasks == ("text-to-image", "image-to-image", "inpaint")
    assert dev.limits["strength"]["defaults"] == {"image-to-image": 0.6, "inpaint": 0.6}
    key = dev.batch_key({"image": "ref", "width": W, "height": H})
    assert key[:2] == ("image-to-image", 0.6) and key[-1] == 512

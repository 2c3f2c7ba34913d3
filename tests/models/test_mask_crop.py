"""`padding_mask_crop` on the host (models/components/mask_crop.py) against diffusers' VaeImageProcessor: the box,
the cut-out inputs and the result laid back, on masks of many shapes, pads and call sizes. The pipelines' use of
it is compared with diffusers' inpainting pipelines in test_sdxl_image_inputs.py and test_flux_image_inputs.py."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from meshserve.models import PipelineError
from meshserve.models.components.mask_crop import MaskCrops, crop_inputs, crop_region, paste_back


@pytest.fixture(scope="module")
def processors():
    from diffusers.image_processor import VaeImageProcessor

    image = VaeImageProcessor(vae_scale_factor=8)
    mask = VaeImageProcessor(
        vae_scale_factor=8, do_normalize=False, do_binarize=True, do_convert_grayscale=True
    )
    return image, mask


def _picture(rng, height: int, width: int) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    a, b, c = rng.uniform(0.2, 0.8, 3)
    img = np.stack([a * x + 0.2, b * y + 0.1, c * (1 - x * y)], axis=-1) + 0.05 * rng.standard_normal(
        (height, width, 3)
    )
    return Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8))


def _mask(rng, height: int, width: int, soft: bool = False) -> Image.Image:
    """A rectangle somewhere (maybe touching an edge), soft-edged or not."""
    y0, x0 = rng.integers(0, height - 2), rng.integers(0, width - 2)
    y1, x1 = rng.integers(y0 + 1, height + 1), rng.integers(x0 + 1, width + 1)
    values = np.zeros((height, width), np.uint8)
    values[y0:y1, x0:x1] = 255
    if soft:
        values[y0:y1, x0] = 100  # grey: blended by the overlay, binarised away by the mask processor
    return Image.fromarray(values)


CASES = [  # (image height, width), (call height, width), pad
    ((80, 56), (64, 48), 0),
    ((80, 56), (64, 48), 6),
    ((56, 96), (64, 64), 10),
    ((120, 40), (48, 64), 3),
    ((64, 64), (32, 96), 0),
    ((50, 70), (64, 48), 100),  # the pad reaches past every edge
]


@pytest.mark.parametrize("sizes", CASES, ids=[f"{a[0]}x{a[1]}-{b[0]}x{b[1]}-pad{p}" for a, b, p in CASES])
def test_box_inputs_and_overlay_are_diffusers(processors, sizes):
    image_proc, mask_proc = processors
    (h, w), (height, width), pad = sizes
    rng = np.random.default_rng(h * w + pad)
    for trial in range(8):
        image, mask = _picture(rng, h, w), _mask(rng, h, w, soft=trial % 2 == 1)
        if (
            trial == 7
        ):  # PIL inputs in other modes (a coloured mask, an RGBA image) give diffusers' pixels too
            mask = Image.merge("RGB", (mask, mask.point(lambda v: v // 2), Image.new("L", mask.size)))
            image = image.convert("RGBA")
        region = crop_region(mask, width, height, pad)
        assert region == tuple(mask_proc.get_crop_region(mask, width, height, pad=pad)), trial

        rgb, gray = crop_inputs(image, mask, region, width, height)
        expected = image_proc.preprocess(image, height, width, resize_mode="fill", crops_coords=region)
        pixels, masks = MaskCrops([image], [mask], [region]).inputs(width, height)
        np.testing.assert_array_equal(pixels[0], expected[0].numpy().transpose(1, 2, 0))
        expected_mask = mask_proc.preprocess(mask, height, width, resize_mode="fill", crops_coords=region)
        np.testing.assert_array_equal(masks[0], expected_mask[0].numpy().transpose(1, 2, 0))
        assert rgb.size == gray.size == (width, height)

        generated = _picture(rng, height, width)
        laid = paste_back(mask, image, generated, region)
        np.testing.assert_array_equal(
            np.asarray(laid), np.asarray(image_proc.apply_overlay(mask, image, generated, region))
        )
        assert laid.size == image.size
        kept = np.asarray(mask.convert("L")) == 0
        np.testing.assert_array_equal(np.asarray(laid)[kept], np.asarray(image.convert("RGB"))[kept])


def test_an_empty_mask_starts_from_the_whole_image():
    # diffusers' box there is inside out (or divides by zero); ours is the image, which growing to the call's
    # aspect cannot enlarge (the margins are then filled), so the crop is the image and the inpaint a plain one.
    mask = Image.new("L", (40, 60))
    for width, height, pad in ((64, 64, 0), (32, 64, 5), (96, 32, 1000)):
        assert crop_region(mask, width, height, pad) == (0, 0, 40, 60)
    mask.putpixel((10, 20), 1)  # one faint pixel is a mask (diffusers: not == 0)
    assert crop_region(mask, 64, 64, 0) == (10, 20, 11, 21)


def test_rows_tile_as_the_pipelines_inputs_do_and_sizes_must_agree():
    rng = np.random.default_rng(0)
    images = [_picture(rng, 40, 40), _picture(rng, 48, 40)]
    masks = [_mask(rng, 40, 40), _mask(rng, 48, 40)]
    crops = MaskCrops.of(images, masks, prompts=2, n=2, width=32, height=32, pad=2)
    # diffusers' tiling: one image per prompt, n = 2 -> i0, i1, i0, i1
    assert [im.size for im in crops.images] == [(40, 40), (40, 48), (40, 40), (40, 48)]
    generated = np.full((4, 32, 32, 3), 128, np.uint8)
    assert [im.size for im in crops.paste(generated, "pil")] == [(40, 40), (40, 48)] * 2
    with pytest.raises(PipelineError, match="sizes, which differ"):
        crops.paste(generated, "uint8")
    same = MaskCrops.of(images[0], masks[0], prompts=1, n=2, width=32, height=32, pad=2)
    out = same.paste(generated[:2], "np")
    assert out.shape == (2, 40, 40, 3) and out.dtype == np.float32
    np.testing.assert_array_equal(np.round(out * 255).astype(np.uint8), same.paste(generated[:2], "uint8"))
    # numpy inputs as the pipelines take them (uint8 or floats in [0, 1]; a mask [H, W]) are the same pictures
    as_arrays = MaskCrops.of(
        np.asarray(images[0]).astype(np.float32) / 255, np.asarray(masks[0]), 1, 1, 32, 32, 2
    )
    assert as_arrays.regions == same.regions[:1]
    np.testing.assert_array_equal(np.asarray(as_arrays.images[0]), np.asarray(images[0]))
    with pytest.raises(PipelineError, match="need one size"):
        MaskCrops.of(images[0], masks[1], 1, 1, 32, 32, 0)

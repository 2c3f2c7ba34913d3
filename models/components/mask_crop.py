"""Inpainting the masked region only (diffusers' `padding_mask_crop`), on the host with PIL.

    region = crop_region(mask, width, height, pad)              # (x1, y1, x2, y2) in the image's pixels
    image_in, mask_in = crop_inputs(image, mask, region, width, height)  # what the pipeline inpaints
    ... inpaint image_in / mask_in at width x height ...
    result = paste_back(mask, image, generated, region)         # the image's size, outside the mask untouched

The mask's bounding box (every pixel that is not 0), grown by `pad` pixels and then to the call's aspect
ratio, is cut out of the image and the mask and scaled to the call's size: a small masked area is repainted at
the model's full resolution. The result is scaled back into the box and laid over the original image through
the (unbinarised) mask, so the output has the original image's size and the pixels the mask keeps are the
original's. Each step is diffusers' `VaeImageProcessor` (get_crop_region, resize_mode "fill" on the way in,
"crop" on the way back, apply_overlay) call for call, because its pixels are what the parity tests compare.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from meshserve.models.components.image_processor import (
    as_image_list,
    as_pil,
    preprocess_image,
    preprocess_mask,
    tile_rows,
)
from meshserve.models.engine.common import PipelineError

LANCZOS = Image.Resampling.LANCZOS  # the processors' `resample`


@dataclass(frozen=True)
class MaskCrops:
    """A call's inpainting rows with `padding_mask_crop`: each output row's original image, mask and box."""

    images: list[Image.Image]
    masks: list[Image.Image]
    regions: list[tuple[int, int, int, int]]

    @classmethod
    def of(cls, image, mask_image, prompts: int, n: int, width: int, height: int, pad: int) -> MaskCrops:
        """The call's images and masks (one for all, one per prompt or one per output row; PIL, or numpy as
        preprocess_image / preprocess_mask take them) and each row's box for a width x height call."""
        images = [as_pil(x, "image", "RGB") for x in as_image_list(image, "image")]
        masks = [as_pil(x, "mask_image", "L") for x in as_image_list(mask_image, "mask_image")]
        images, masks = tile_rows(images, prompts, n, "image"), tile_rows(masks, prompts, n, "mask_image")
        for i, (im, mask) in enumerate(zip(images, masks, strict=True)):
            if im.size != mask.size:
                raise PipelineError(
                    f"padding_mask_crop: row {i}'s mask_image is {mask.size[0]}x{mask.size[1]} and its image "
                    f"{im.size[0]}x{im.size[1]}: the result is laid over the image through the mask, so both "
                    "need one size"
                )
        regions = [crop_region(mask, width, height, pad) for mask in masks]
        return cls(images, masks, regions)

    def inputs(self, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
        """Each row's crop as the pipeline's inputs: pixels [B, H, W, 3] in [-1, 1] and mask [B, H, W, 1] of 0
        (keep) and 1 (repaint), binarised at 0.5 as the inpainting mask processor does."""
        pixels, masks = [], []
        for image, mask, region in zip(self.images, self.masks, self.regions, strict=True):
            rgb, gray = crop_inputs(image, mask, region, width, height)  # already the call's size
            pixels.append(preprocess_image(rgb, height, width))
            masks.append(preprocess_mask(gray, height, width))
        return np.stack(pixels), np.stack(masks)

    def paste(self, generated: np.ndarray, output_type: str):
        """The decoded rows [B, H, W, 3] (uint8, or floats in [0, 1] rounded to 8 bits as diffusers' PIL
        output is) laid back into their images: PIL images ("pil"), or [B, H0, W0, 3] uint8 / floats in
        [0, 1] ("uint8" / "np"), which needs every row's image to have one size."""
        if generated.dtype != np.uint8:
            generated = np.round(generated * 255).astype(np.uint8)
        out = [
            paste_back(mask, image, Image.fromarray(row), region)
            for row, image, mask, region in zip(generated, self.images, self.masks, self.regions, strict=True)
        ]
        if output_type == "pil":
            return out
        if len({im.size for im in out}) > 1:
            raise PipelineError(
                "padding_mask_crop: the outputs have their images' sizes, which differ here; ask for "
                "output_type='pil' (a list) or give images of one size"
            )
        stacked = np.stack([np.asarray(im) for im in out])
        return stacked if output_type == "uint8" else stacked.astype(np.float32) / np.float32(255.0)


def crop_region(mask: Image.Image, width: int, height: int, pad: int) -> tuple[int, int, int, int]:
    """The box (x1, y1, x2, y2) to inpaint: the mask's non-zero pixels' bounding box, `pad` pixels larger on
    each side (within the image), then grown on one axis to `width / height`'s aspect, kept inside the image
    where it fits (diffusers' get_crop_region). A mask with no non-zero pixel starts from the whole image."""
    values = np.asarray(mask.convert("L"))
    h, w = values.shape
    cols, rows = np.flatnonzero(values.any(axis=0)), np.flatnonzero(values.any(axis=1))
    if cols.size:
        x1, y1 = int(max(cols[0] - pad, 0)), int(max(rows[0] - pad, 0))
        x2, y2 = int(min(cols[-1] + 1 + pad, w)), int(min(rows[-1] + 1 + pad, h))
    else:  # nothing masked: diffusers' box would be empty or inside out (its ratio then divides by zero)
        x1, y1, x2, y2 = 0, 0, w, h
    ratio = width / height
    if (x2 - x1) / (y2 - y1) > ratio:
        grow = int((x2 - x1) / ratio - (y2 - y1))
        y1, y2 = _grown(y1, y2, grow, h)
    else:
        grow = int((y2 - y1) * ratio - (x2 - x1))
        x1, x2 = _grown(x1, x2, grow, w)
    return x1, y1, x2, y2


def _grown(start: int, end: int, grow: int, size: int) -> tuple[int, int]:
    """[start, end) grown by `grow` (half before, the rest after), shifted back inside [0, size), then cut at
    size (diffusers' arithmetic, the shift included)."""
    start -= grow // 2
    end += grow - grow // 2
    if end >= size:
        start -= end - size
        end = size
    if start < 0:
        end -= start
        start = 0
    return start, min(end, size)


def crop_inputs(
    image: Image.Image, mask: Image.Image, region: tuple[int, int, int, int], width: int, height: int
) -> tuple[Image.Image, Image.Image]:
    """The image (RGB) and mask (L) the pipeline inpaints: both cut to `region` and scaled into width x height
    keeping their aspect, the margins filled by stretching the edge rows or columns (resize_mode "fill")."""
    rgb = _resize_and_fill(image.crop(region), width, height).convert("RGB")
    gray = _resize_and_fill(mask.crop(region), width, height).convert("L")
    return rgb, gray


def paste_back(
    mask: Image.Image, image: Image.Image, generated: Image.Image, region: tuple[int, int, int, int]
) -> Image.Image:
    """`generated` (the call's size) scaled into `region` (resize_mode "crop"), then the original image laid
    over it where `mask` keeps it (its inverse as the alpha; a grey mask value blends): the image's size, RGB."""
    width, height = image.size
    kept = Image.new("RGBa", (width, height))
    kept.paste(image.convert("RGBA").convert("RGBa"), mask=ImageOps.invert(mask.convert("L")))
    kept = kept.convert("RGBA")
    x1, y1, x2, y2 = region
    canvas = Image.new("RGBA", (width, height))
    canvas.paste(_resize_and_crop(generated, x2 - x1, y2 - y1), (x1, y1))
    out = canvas.convert("RGB").convert("RGBA")
    out.alpha_composite(kept)
    return out.convert("RGB")


def _resize_and_fill(image: Image.Image, width: int, height: int) -> Image.Image:
    """Scaled to fit inside width x height with its aspect, centred; the margins are its first and last rows
    (or columns) stretched (diffusers' _resize_and_fill, its calls as they are)."""
    ratio, src_ratio = width / height, image.width / image.height
    src_w = width if ratio < src_ratio else image.width * height // image.height
    src_h = height if ratio >= src_ratio else image.height * width // image.width
    resized = image.resize((src_w, src_h), resample=LANCZOS)
    res = Image.new("RGB", (width, height))
    res.paste(resized, box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
    if ratio < src_ratio:
        fill = height // 2 - src_h // 2
        if fill > 0:
            res.paste(resized.resize((width, fill), box=(0, 0, width, 0)), box=(0, 0))
            res.paste(
                resized.resize((width, fill), box=(0, resized.height, width, resized.height)),
                box=(0, fill + src_h),
            )
    elif ratio > src_ratio:
        fill = width // 2 - src_w // 2
        if fill > 0:
            res.paste(resized.resize((fill, height), box=(0, 0, 0, height)), box=(0, 0))
            res.paste(
                resized.resize((fill, height), box=(resized.width, 0, resized.width, height)),
                box=(fill + src_w, 0),
            )
    return res


def _resize_and_crop(image: Image.Image, width: int, height: int) -> Image.Image:
    """Scaled to cover width x height with its aspect, centred, the excess cut (diffusers' _resize_and_crop)."""
    ratio, src_ratio = width / height, image.width / image.height
    src_w = width if ratio > src_ratio else image.width * height // image.height
    src_h = height if ratio <= src_ratio else image.height * width // image.width
    resized = image.resize((src_w, src_h), resample=LANCZOS)
    res = Image.new("RGB", (width, height))
    res.paste(resized, box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
    return res

"""Image and mask inputs on the host, as diffusers' `VaeImageProcessor` prepares them (pure numpy and PIL).

    pixels = preprocess_image(image, height, width)    # [H, W, 3] float32 in [-1, 1]
    mask = preprocess_mask(mask_image, height, width)  # [H, W, 1] float32, 0 (keep) or 1 (repaint)
    rows = image_rows(images, prompts, n, "image", preprocess_image, height, width)   # [B, H, W, C]

What an input may be: a PIL image, or a numpy array [H, W, 3] (a mask: [H, W] or [H, W, 1]) of uint8 (0..255)
or floats in [0, 1]. Resizing follows diffusers' processor exactly, because the pixels it makes are what
the parity tests compare: a PIL image is resized with PIL's Lanczos filter (`resample="lanczos"`), a numpy
array by nearest neighbour as torch's `interpolate(mode="nearest")` picks its source pixels
(floor(dst * in / out)). A mask is resized first (PIL: in its own mode), then made grayscale, then binarised
(< 0.5 -> 0, else 1), as the inpainting pipelines' mask processor (do_binarize, do_convert_grayscale) does.
diffusers' numpy path takes floats only; a uint8 array here is divided by 255 as a PIL image's pixels are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from meshserve.models.engine.common import PipelineError


def _is_pil(x) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow is a base dependency
        return False
    return isinstance(x, Image.Image)


def _as_float(array: np.ndarray, name: str) -> np.ndarray:
    """uint8 -> /255; floats must lie in [0, 1] (diffusers' expected range)."""
    if array.dtype == np.uint8:
        return array.astype(np.float32) / np.float32(255.0)
    if array.dtype.kind != "f":
        raise PipelineError(
            f"{name}: a numpy image must be uint8 (0..255) or float in [0, 1], got {array.dtype}"
        )
    array = array.astype(np.float32)
    if not np.all(np.isfinite(array)) or array.min() < 0.0 or array.max() > 1.0:
        raise PipelineError(f"{name}: float pixels must lie in [0, 1]")
    return array


def resize_nearest(array: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, C] -> [height, width, C] by torch's nearest rule: source index floor(dst * in / out)."""
    h, w = array.shape[:2]
    if (h, w) == (height, width):
        return array
    rows = np.minimum(
        np.floor(np.arange(height, dtype=np.float32) * np.float32(h / height)).astype(np.int64), h - 1
    )
    cols = np.minimum(
        np.floor(np.arange(width, dtype=np.float32) * np.float32(w / width)).astype(np.int64), w - 1
    )
    return array[rows][:, cols]


def _resize_pil(image, height: int, width: int):
    from PIL import Image

    return image.resize((width, height), resample=Image.Resampling.LANCZOS, reducing_gap=None)


def preprocess_image(image, height: int, width: int, name: str = "image") -> np.ndarray:
    """One image -> [height, width, 3] float32 in [-1, 1] (diffusers' normalize: 2x - 1)."""
    if _is_pil(image):
        image = _resize_pil(image, height, width).convert("RGB")
        pixels = np.asarray(image).astype(np.float32) / np.float32(255.0)
    elif isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[-1] != 3:
            raise PipelineError(f"{name}: a numpy image must be [H, W, 3], got shape {list(image.shape)}")
        pixels = resize_nearest(_as_float(image, name), height, width)
    else:
        raise PipelineError(f"{name} must be a PIL image or a numpy array, got {type(image).__name__}")
    return 2.0 * pixels - 1.0


def preprocess_mask(mask, height: int, width: int, name: str = "mask_image") -> np.ndarray:
    """One mask -> [height, width, 1] float32 of 0 (keep the image) and 1 (repaint)."""
    if _is_pil(mask):
        mask = _resize_pil(mask, height, width).convert("L")
        values = np.asarray(mask).astype(np.float32)[..., None] / np.float32(255.0)
    elif isinstance(mask, np.ndarray):
        if mask.ndim == 2:
            mask = mask[..., None]
        if mask.ndim != 3 or mask.shape[-1] != 1:
            raise PipelineError(
                f"{name}: a numpy mask must be [H, W] or [H, W, 1], got shape {list(mask.shape)}"
            )
        values = resize_nearest(_as_float(mask, name), height, width)
    else:
        raise PipelineError(f"{name} must be a PIL image or a numpy array, got {type(mask).__name__}")
    return np.where(values < 0.5, 0.0, 1.0).astype(np.float32)


def as_image_list(images, name: str) -> list:
    """One image, a list of images, or a numpy batch [N, H, W, (C)] -> a list of single images."""
    if isinstance(images, np.ndarray) and images.ndim == 4 and name == "image":
        return list(images)
    if isinstance(images, Sequence) and not isinstance(images, str | bytes):
        images = list(images)
        if not images:
            raise PipelineError(f"{name} must be an image or a non-empty list of images")
        return images
    return [images]


def image_size(images, name: str, multiple: int) -> tuple[int, int]:
    """(height, width) of a call's first image, each rounded down to `multiple`: the size diffusers'
    VaeImageProcessor gives an image when the call names none (SDXL img2img takes no height or width)."""
    first = as_image_list(images, name)[0]
    if _is_pil(first):
        width, height = first.size
    elif isinstance(first, np.ndarray) and first.ndim == 3:
        height, width = first.shape[:2]
    else:
        raise PipelineError(f"{name} must be a PIL image or a numpy array [H, W, 3]")
    return height - height % multiple, width - width % multiple


def image_rows(
    images, prompts: int, n: int, name: str, preprocess: Callable, height: int, width: int
) -> np.ndarray:
    """The images of a call -> one preprocessed image per output row [prompts * n, H, W, C] (`tile_rows`),
    each distinct image preprocessed once."""
    items = as_image_list(images, name)
    rows = tile_rows(list(range(len(items))), prompts, n, name)
    processed = [preprocess(item, height, width, name) for item in items]
    return np.stack([processed[i] for i in rows])


def control_rows(
    images, prompts: int, n: int, height: int, width: int, name: str = "control_image"
) -> np.ndarray:
    """A call's control images -> one per output row [prompts * n, H, W, 3] in [-1, 1]: one for all, one per
    prompt repeated over its n images (diffusers' control pipelines' `repeat_interleave`: p0 i0, p0 i0, p1 i1,
    p1 i1; not tiled as `image=` is, `tile_rows`), or one per output row."""
    items = as_image_list(images, name)
    if len(items) not in (1, prompts, prompts * n):
        raise PipelineError(
            f"{name}: expected one image, one per prompt ({prompts}) or one per output image ({prompts * n}), "
            f"got {len(items)}"
        )
    processed = [preprocess_image(item, height, width, name) for item in items]
    return np.stack([processed[i] for i in np.repeat(np.arange(len(items)), prompts * n // len(items))])


def tile_rows(items: list, prompts: int, n: int, name: str) -> list:
    """A call's images (one for all, one per prompt or one per output row) -> one per output row, tiled over
    the n images per prompt as diffusers' image pipelines tile them (`torch.cat([image_latents] * n)`,
    `mask.repeat(n, ...)`): with prompts p0, p1 and n = 2 the rows are (p0, i0), (p0, i1), (p1, i0), (p1, i1)."""
    if len(items) not in (1, prompts, prompts * n):
        raise PipelineError(
            f"{name}: expected one image, one per prompt ({prompts}) or one per output image ({prompts * n}), "
            f"got {len(items)}"
        )
    if len(items) == 1:
        return items * (prompts * n)
    if len(items) == prompts and n > 1:
        return items * n
    return list(items)


def as_pil(image, name: str, mode: str):
    """One image as a PIL image: a PIL image as it is (diffusers' PIL paths crop and scale it in its own mode),
    a numpy one (the shapes and value ranges preprocess_image / preprocess_mask take) in `mode` ("RGB", or "L"
    for a mask), rounded to 8 bits as diffusers' numpy_to_pil rounds."""
    from PIL import Image

    if _is_pil(image):
        return image
    if not isinstance(image, np.ndarray):
        raise PipelineError(f"{name} must be a PIL image or a numpy array, got {type(image).__name__}")
    channels = 3 if mode == "RGB" else 1
    array = image[..., None] if image.ndim == 2 and channels == 1 else image
    if array.ndim != 3 or array.shape[-1] != channels:
        shapes = "[H, W, 3]" if channels == 3 else "[H, W] or [H, W, 1]"
        raise PipelineError(f"{name}: a numpy image must be {shapes}, got shape {list(image.shape)}")
    if array.dtype != np.uint8:
        array = np.round(_as_float(array, name) * 255).astype(np.uint8)
    return Image.fromarray(array[..., 0] if channels == 1 else array)

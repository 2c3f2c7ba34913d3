"""Reading a generated picture back: background colour, shape colour and shape class, from pixels alone.

No learned model: every pixel is named by its nearest palette colour (training/shapes.PALETTE); the
background is the colour most of the image border has; the shape's colour is the most common other one.
The shape is then the pixels nearer its colour than the background's (a soft edge splits at its midpoint,
whatever colours the blend passes through), and its class comes from two measures of that mask: an upright
triangle is narrow at the top (its width at 30 % of its height is 3/7 of its width at 70 %; a disc or a
square is as wide at both), and a square fills its bounding box where a disc fills pi/4 (0.785). The
thresholds sit between; tests/training/test_shape_score.py checks them on every rendered scene, sharp and
blurred.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshserve.training.shapes import PALETTE

_NAMES = tuple(PALETTE)
_RGB = np.asarray([PALETTE[n] for n in _NAMES], np.float32)
# Width at 30 % of the height over width at 70 %: below TRIANGLE_TAPER a triangle (3/7 = 0.43 sharp).
TRIANGLE_TAPER = 0.7
# Fill of the bounding box: at or above SQUARE_FILL a square (1.0 sharp), below it a disc (0.785).
SQUARE_FILL = 0.89
# The shape must cover at least this share of the image (a small shape, 0.3 of the side, covers 7 % as a
# triangle): less is stray pixels, not a shape.
MIN_SHAPE_SHARE = 0.02


@dataclass(frozen=True)
class Reading:
    background: str
    colour: str | None  # None: no shape found
    shape: str | None
    fill: float | None = None
    taper: float | None = None


def squared_distance(pixels: np.ndarray, rgb: np.ndarray) -> np.ndarray:
    """Squared RGB distance, the channels added one by one: the same sums as `.sum(-1)` over the 3 channels
    (numpy's reduction over so short an axis is slow), and read_picture twice as fast with them: the 6,552
    rendered scenes of tests/training/test_shape_score.py in 5.3 s against 11.7 s (2026-11-29, Zen 5)."""
    diff = pixels - rgb
    return diff[..., 0] ** 2 + diff[..., 1] ** 2 + diff[..., 2] ** 2


def nearest_colours(image: np.ndarray) -> np.ndarray:
    """uint8 or float [H, W, 3] in 0..255 -> [H, W] palette indices."""
    pixels = np.asarray(image, np.float32)[..., None, :]
    return np.argmin(squared_distance(pixels, _RGB), axis=-1)


def read_picture(image: np.ndarray) -> Reading:
    labels = nearest_colours(image)
    h, w = labels.shape
    border = np.concatenate([labels[0], labels[-1], labels[:, 0], labels[:, -1]])
    background = int(np.bincount(border, minlength=len(_NAMES)).argmax())
    # The shape's colour: the commonest label but the background's (a blended edge is a thin minority).
    counts = np.bincount(labels.ravel(), minlength=len(_NAMES))
    counts[background] = 0
    colour = int(counts.argmax())
    if counts[colour] < MIN_SHAPE_SHARE * h * w:
        return Reading(_NAMES[background], None, None)
    pixels = np.asarray(image, np.float32)
    to_shape = squared_distance(pixels, _RGB[colour])
    to_background = squared_distance(pixels, _RGB[background])
    mask = to_shape < to_background
    ys, xs = np.nonzero(mask)
    # The bounding box from the 1st to the 99th percentile: a few stray pixels do not stretch it.
    y0, y1 = (int(round(v)) for v in np.percentile(ys, [1, 99]))
    x0, x1 = (int(round(v)) for v in np.percentile(xs, [1, 99]))
    box = mask[y0 : y1 + 1, x0 : x1 + 1]
    fill = float(box.mean())
    widths = box.sum(axis=1)
    height = len(widths)
    upper, lower = widths[int(0.3 * height)], widths[min(int(0.7 * height), height - 1)]
    taper = float(upper / max(lower, 1))
    if taper < TRIANGLE_TAPER:
        shape = "triangle"
    else:
        shape = "square" if fill >= SQUARE_FILL else "circle"
    return Reading(_NAMES[background], _NAMES[colour], shape, fill, taper)


@dataclass(frozen=True)
class Adherence:
    """Shares of pictures whose reading matches their prompt's colour, background and shape."""

    colour: float
    background: float
    shape: float
    n: int


def adherence(images, wanted: list[tuple[str, str, str]]) -> Adherence:
    """images: uint8 [N, H, W, 3] (or a list of such arrays); wanted: (colour, shape, background) per image."""
    readings = [read_picture(im) for im in images]
    n = len(readings)
    return Adherence(
        colour=sum(r.colour == c for r, (c, _, _) in zip(readings, wanted, strict=True)) / n,
        background=sum(r.background == b for r, (_, _, b) in zip(readings, wanted, strict=True)) / n,
        shape=sum(r.shape == s for r, (_, s, _) in zip(readings, wanted, strict=True)) / n,
        n=n,
    )

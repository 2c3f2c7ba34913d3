"""Reading a generated clip back: background, shape colour, shape class and direction of motion, from pixels.

No learned model, as training/shape_score.py reads a picture: the background is the colour most of the
border has (here the border of every frame, as a moving shape may touch it in some), the shape's colour the
commonest other colour of the middle frame. The shape in the first and in the last frame is the pixels nearer
its colour than the background's, and the move is the displacement of that mask's centroid, last minus first,
in units of the image side: below STILL_SHIFT the clip is still, otherwise the larger axis names the
direction (x to the right, y down, as the image is stored). The colours and the shape class of a clip are
shape_score.read_picture's reading of its middle frame. tests/training/test_clips.py checks every held-out
clip, in every direction and still, sharp, blurred and noisy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshserve.training.shape_score import MIN_SHAPE_SHARE, nearest_colours, read_picture, squared_distance
from meshserve.training.shapes import PALETTE

# In nearest_colours' order (the palette's).
_NAMES = tuple(PALETTE)
_RGB = np.asarray([PALETTE[n] for n in _NAMES], np.float32)
# Centroid displacement, first to last frame as a fraction of the image side, below which a clip is still.
# A training clip moves TRAVEL (0.375, training/clips.py) and a still one not at all (its jitter moves every
# frame alike); a model that redraws a still shape with the training jitter in each frame shifts it by at
# most 4 pixels per axis at 64, 0.09 of the side diagonally, and blur or noise move a centroid by well under
# a pixel. A third of the travel sits between: a shape moved a third as far as in training still reads as
# moving, and a still one's wobble does not.
STILL_SHIFT = 0.125


@dataclass(frozen=True)
class MotionReading:
    direction: str | None  # "left", "right", "up", "down", "still"; None: no shape found
    dx: float | None = None  # centroid displacement, last frame minus first, in units of the image side
    dy: float | None = None


def _shape_mask(frame: np.ndarray, colour: int, background: int) -> np.ndarray:
    pixels = np.asarray(frame, np.float32)
    return squared_distance(pixels, _RGB[colour]) < squared_distance(pixels, _RGB[background])


def read_motion(frames: np.ndarray) -> MotionReading:
    """frames: uint8 or float [F, H, W, 3] in 0..255."""
    frames = np.asarray(frames)
    _, h, w, _ = frames.shape
    # shape_score's border rule over every frame's border (only the border pixels are named: it is cheaper).
    border = nearest_colours(
        np.concatenate([frames[:, 0], frames[:, -1], frames[:, :, 0], frames[:, :, -1]], axis=1)
    )
    background = int(np.bincount(border.ravel(), minlength=len(_NAMES)).argmax())
    counts = np.bincount(nearest_colours(frames[len(frames) // 2]).ravel(), minlength=len(_NAMES))
    counts[background] = 0
    colour = int(counts.argmax())
    if counts[colour] < MIN_SHAPE_SHARE * h * w:
        return MotionReading(None)
    centroids = []
    for frame in (frames[0], frames[-1]):
        mask = _shape_mask(frame, colour, background)
        if mask.sum() < MIN_SHAPE_SHARE * h * w:
            return MotionReading(None)
        ys, xs = np.nonzero(mask)
        centroids.append((xs.mean() / w, ys.mean() / h))
    dx, dy = (float(b - a) for a, b in zip(*centroids, strict=True))
    if np.hypot(dx, dy) < STILL_SHIFT:
        direction = "still"
    elif abs(dx) >= abs(dy):
        direction = "right" if dx > 0 else "left"
    else:
        direction = "down" if dy > 0 else "up"
    return MotionReading(direction, dx, dy)


@dataclass(frozen=True)
class ClipAdherence:
    """Shares of clips whose reading matches their prompt's colour, background, shape and direction."""

    colour: float
    background: float
    shape: float
    direction: float
    n: int


def clip_adherence(clips, wanted: Sequence[tuple[str, str, str, str]]) -> ClipAdherence:
    """clips: uint8 [N, F, H, W, 3] (or a list of such arrays); wanted: (colour, shape, background, direction
    or "still") per clip, as clips.held_out_clip_prompts returns them."""
    pictures = [read_picture(clip[len(clip) // 2]) for clip in clips]
    motions = [read_motion(clip) for clip in clips]
    n = len(pictures)
    return ClipAdherence(
        colour=sum(p.colour == c for p, (c, _, _, _) in zip(pictures, wanted, strict=True)) / n,
        background=sum(p.background == b for p, (_, _, b, _) in zip(pictures, wanted, strict=True)) / n,
        shape=sum(p.shape == s for p, (_, s, _, _) in zip(pictures, wanted, strict=True)) / n,
        direction=sum(m.direction == d for m, (_, _, _, d) in zip(motions, wanted, strict=True)) / n,
        n=n,
    )

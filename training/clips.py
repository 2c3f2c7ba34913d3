"""Procedural training clips for a tiny text-to-video model: one flat-coloured shape moving across a flat background.

The pictures are training/shapes.py's, drawn frame by frame: a clip scene is (colour, shape, background,
direction, size), and the shape's centre travels in a straight line through the image centre, TRAVEL of the
image side from the first frame to the last, left, right, up or down; or it stays in the centre (direction
None, "still"). Captions add the motion to shapes.py's plain form: "a red circle moving left on a blue
background"; a still clip's caption is the plain one ("a red circle on a blue background"), so the image
model's captions and the video model's agree where the pictures do.

The held-out (colour, shape, background) combinations of shapes.HELD_OUT stay out of training in every
motion, and `held_out_clip_prompts` prompts with each of them in every direction and still: a pass
(training/motion_score.py) means the model composed a motion with a combination it never saw move.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshserve.training.shapes import DEFAULT_SIZE, HELD_OUT, SIZES, TRAINING, Scene, render

DIRECTIONS = ("left", "right", "up", "down")
# Unit steps in image coordinates (x to the right, y down), so "up" is negative y.
_STEPS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
# The centre's travel from the first frame to the last, as a fraction of the image side, centred on the image
# centre: from 0.5 - TRAVEL/2 to 0.5 + TRAVEL/2. shapes.render clips the centre so the shape stays inside
# (at least half its extent from the edge), which would stop a shape short of its path; TRAVEL/2 + extent/2
# <= 0.5 keeps every size's path unclipped: a large shape (0.62) allows up to 0.38, and 0.375 (24 pixels at
# 64) leaves it 0.16 pixel to spare; medium (0.45) has 5.6 pixels, small (0.3) 10.4 (at 64).
TRAVEL = 0.375
# Sizes a training clip draws: a large shape's path already touches the edge, so the jitter of `clip_batch`
# (up to 2 pixels at 64) would clip it, and the shape would stop short; medium keeps 5.6 pixels to spare.
CLIP_SIZES = ("small", "medium")
STILL = "still"
# Caption words the image captions lack (shapes' position words already have "left" and "right"): a
# tokenizer built from caption_tokenizer.WORDS + CLIP_WORDS makes each one token.
CLIP_WORDS = ("moving", "left", "right", "up", "down")


@dataclass(frozen=True)
class ClipScene:
    colour: str
    shape: str
    background: str
    direction: str | None = None  # None: still, in the centre
    size: str = DEFAULT_SIZE

    @property
    def caption(self) -> str:
        if self.direction is None:
            return Scene(self.colour, self.shape, self.background, self.size).caption
        # As shapes.Scene.caption words it: the size before the colour unless medium, "an" before a vowel.
        size = "" if self.size == DEFAULT_SIZE else f"{self.size} "
        words = f"{size}{self.colour} {self.shape}"
        article = "an" if words[0] in "aeiou" else "a"
        return f"{article} {words} moving {self.direction} on a {self.background} background"

    @property
    def motion(self) -> str:
        """The direction, or "still": the form motion_score reads back."""
        return STILL if self.direction is None else self.direction


def centre_path(scene: ClipScene, frames: int, size: int) -> np.ndarray:
    """The centre's displacement from the image centre per frame, float [frames, 2] pixels (x, y)."""
    if scene.direction is None:
        return np.zeros((frames, 2))
    if scene.direction not in _STEPS:
        raise ValueError(f"unknown direction {scene.direction!r}; the directions are {DIRECTIONS}")
    fraction = np.arange(frames) / (frames - 1) - 0.5  # -0.5 at the first frame, 0.5 at the last
    return fraction[:, None] * TRAVEL * size * np.asarray(_STEPS[scene.direction])


def render_clip(
    scene: ClipScene, frames: int = 9, size: int = 64, offset: tuple[float, float] = (0.0, 0.0)
) -> np.ndarray:
    """The clip as uint8 [frames, size, size, 3]; `offset` moves the whole path by that many pixels (x, y)."""
    if frames < 2:
        raise ValueError(f"a clip needs at least 2 frames to show motion, not {frames}")
    centres = centre_path(scene, frames, size) + np.asarray(offset, np.float64)
    # shapes.render would silently clip a centre that leaves the shape partly outside: the shape would stop
    # while its caption says it moves, so refuse instead (only a large shape with an offset gets here).
    half = SIZES[scene.size] * size / 2
    if np.any(np.abs(centres) > size / 2 - half + 1e-6):
        raise ValueError(f"a {scene.size} shape's path with offset {offset} leaves the {size}-pixel frame")
    picture = Scene(scene.colour, scene.shape, scene.background, scene.size)
    return np.stack([render(picture, size, (float(x), float(y))) for x, y in centres])


def random_clip_scene(
    rng: np.random.Generator,
    combinations: Sequence[tuple[str, str, str]] = TRAINING,
    p_still: float = 0.2,
    sizes: Sequence[str] = CLIP_SIZES,
) -> ClipScene:
    """A training clip scene: a combination drawn uniformly; still with probability p_still, else a direction
    drawn uniformly; a size drawn uniformly from `sizes`."""
    colour, shape, background = combinations[rng.integers(len(combinations))]
    direction = None if rng.random() < p_still else DIRECTIONS[rng.integers(len(DIRECTIONS))]
    return ClipScene(colour, shape, background, direction, sizes[rng.integers(len(sizes))])


def still_caption(caption: str) -> str:
    """The caption of the clip's scene standing still: a moving clip's caption without "moving <direction>"."""
    for direction in DIRECTIONS:
        caption = caption.replace(f" moving {direction} ", " ")
    return caption


def clip_batch(
    rng: np.random.Generator,
    batch: int,
    frames: int = 9,
    size: int = 64,
    jitter: float = 2.0,
    anywhere: bool = False,
    sizes: Sequence[str] = CLIP_SIZES,
) -> tuple[np.ndarray, list[str]]:
    """Clips float32 [batch, frames, size, size, 3] in [-1, 1] and their captions. Each clip's whole path
    moves by up to `jitter` pixels (scaled with the image), as shapes.training_batch moves a picture; with
    `anywhere`, by any offset that keeps the shape inside the frame all along its path, drawn uniformly; each
    clip's size is drawn from `sizes`."""
    scenes = [random_clip_scene(rng, sizes=sizes) for _ in range(batch)]
    if anywhere:
        offsets = np.stack([rng.uniform(-1.0, 1.0, 2) * _slack(scene, frames, size) for scene in scenes])
    else:
        scale = size / 64
        offsets = rng.uniform(-jitter * scale, jitter * scale, size=(batch, 2))
    clips = np.stack([render_clip(s, frames, size, tuple(o)) for s, o in zip(scenes, offsets, strict=True)])
    return clips.astype(np.float32) / 127.5 - 1.0, [s.caption for s in scenes]


def _slack(scene: ClipScene, frames: int, size: int) -> np.ndarray:
    """How far (x, y) pixels the scene's whole path can move and keep the shape inside the frame."""
    reach = np.abs(centre_path(scene, frames, size)).max(axis=0)
    return np.maximum(size / 2 - SIZES[scene.size] * size / 2 - reach - 1e-3, 0.0)


def held_out_clip_prompts(
    seeds: Sequence[int] = (0,),
) -> tuple[list[str], list[int], list[tuple[str, str, str, str]]]:
    """(prompts, seeds, wanted) for every held-out combination in every direction and still, with every
    seed; wanted is (colour, shape, background, direction or "still"), as motion_score.clip_adherence takes."""
    rows = [
        (ClipScene(*combo, direction), seed)
        for seed in seeds
        for combo in HELD_OUT
        for direction in (*DIRECTIONS, None)
    ]
    return (
        [scene.caption for scene, _ in rows],
        [seed for _, seed in rows],
        [(scene.colour, scene.shape, scene.background, scene.motion) for scene, _ in rows],
    )

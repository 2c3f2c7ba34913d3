"""Procedural training data: one flat-coloured shape on a flat-coloured background, and its caption.

A scene is (shape, colour, background, size, position). Captions name the shape, its colour and the
background always, and its size and position when they are not the default (medium, in the center), so the
plain form "a red circle on a blue background" is a medium shape in the center, as most of the training
captions say ("a small red circle at the top left on a blue background" otherwise).

Some (colour, shape, background) combinations never appear in training (`HELD_OUT`): the adherence tests
prompt with exactly those, so a pass means the model composes words it learned apart, not that it recalls a
picture it saw.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

# Named colours, far apart in RGB (the closest pair, orange and yellow, is 98 apart) so the pixel scorer can
# name a colour by its nearest neighbour.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (255, 140, 0),
    "yellow": (250, 230, 40),
    "green": (30, 170, 60),
    "blue": (30, 70, 230),
    "purple": (140, 40, 180),
    "white": (250, 250, 250),
    "black": (10, 10, 10),
}
COLOURS = tuple(PALETTE)
SHAPES = ("circle", "square", "triangle")
# Shape extent (a circle's diameter, a square's or triangle's side) as a fraction of the image side.
SIZES = {"small": 0.3, "medium": 0.45, "large": 0.62}
# Where the shape's centre sits, as fractions (x, y) of the image side; clipped so the shape stays inside.
POSITIONS = {
    "at the top left": (0.25, 0.25),
    "at the top": (0.5, 0.25),
    "at the top right": (0.75, 0.25),
    "on the left": (0.25, 0.5),
    "in the center": (0.5, 0.5),
    "on the right": (0.75, 0.5),
    "at the bottom left": (0.25, 0.75),
    "at the bottom": (0.5, 0.75),
    "at the bottom right": (0.75, 0.75),
}
DEFAULT_SIZE, DEFAULT_POSITION = "medium", "in the center"

# Every (shape colour, shape, background colour) with two different colours: 8 * 7 * 3 = 168 combinations.
COMBINATIONS = tuple(
    (colour, shape, background)
    for colour, shape, background in itertools.product(COLOURS, SHAPES, COLOURS)
    if colour != background
)
# 24 of them (1 in 7) held out of training, drawn once by a fixed generator: every colour still appears as a
# shape and as a background, and with every shape, in training.
HELD_OUT = tuple(
    sorted(COMBINATIONS[i] for i in np.random.default_rng(20261122).permutation(len(COMBINATIONS))[:24])
)
TRAINING = tuple(c for c in COMBINATIONS if c not in set(HELD_OUT))


@dataclass(frozen=True)
class Scene:
    colour: str
    shape: str
    background: str
    size: str = DEFAULT_SIZE
    position: str = DEFAULT_POSITION

    @property
    def caption(self) -> str:
        size = "" if self.size == DEFAULT_SIZE else f"{self.size} "
        words = f"{size}{self.colour} {self.shape}"
        article = "an" if words[0] in "aeiou" else "a"
        where = "" if self.position == DEFAULT_POSITION else f" {self.position}"
        return f"{article} {words}{where} on a {self.background} background"


def plain_caption(colour: str, shape: str, background: str) -> str:
    return Scene(colour, shape, background).caption


def render(scene: Scene, size: int = 64, offset: tuple[float, float] = (0.0, 0.0)) -> np.ndarray:
    """The scene as uint8 [size, size, 3]; `offset` moves the centre by that many pixels (x, y)."""
    extent = SIZES[scene.size] * size
    half = extent / 2
    cx, cy = (
        np.clip(f * size + o, half, size - half)
        for f, o in zip(POSITIONS[scene.position], offset, strict=True)
    )
    # Pixel centres.
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    if scene.shape == "circle":
        mask = (x - cx) ** 2 + (y - cy) ** 2 <= half**2
    elif scene.shape == "square":
        mask = (np.abs(x - cx) <= half) & (np.abs(y - cy) <= half)
    elif scene.shape == "triangle":
        # Upright, base `extent` wide at the bottom, apex at the top, `extent` tall.
        top, bottom = cy - half, cy + half
        rows = np.clip((y - top) / extent, 0.0, 1.0)  # 0 at the apex, 1 at the base
        mask = (y >= top) & (y <= bottom) & (np.abs(x - cx) <= rows * half)
    else:
        raise ValueError(f"unknown shape {scene.shape!r}; the shapes are {SHAPES}")
    image = np.empty((size, size, 3), np.uint8)
    image[...] = PALETTE[scene.background]
    image[mask] = PALETTE[scene.colour]
    return image


def random_scene(rng: np.random.Generator, combinations=TRAINING, p_plain: float = 0.5) -> Scene:
    """A training scene: a combination drawn uniformly; with probability p_plain the default size and position
    (the plain caption form), else each drawn uniformly."""
    colour, shape, background = combinations[rng.integers(len(combinations))]
    if rng.random() < p_plain:
        return Scene(colour, shape, background)
    return Scene(
        colour,
        shape,
        background,
        size=list(SIZES)[rng.integers(len(SIZES))],
        position=list(POSITIONS)[rng.integers(len(POSITIONS))],
    )


def training_batch(
    rng: np.random.Generator, batch: int, size: int = 64, jitter: float = 2.0
) -> tuple[np.ndarray, list[str]]:
    """Images float32 [batch, size, size, 3] in [-1, 1] and their captions. Each centre moves by up to
    `jitter` pixels (scaled with the image), so the model sees a little of every placement."""
    scenes = [random_scene(rng) for _ in range(batch)]
    scale = size / 64
    offsets = rng.uniform(-jitter * scale, jitter * scale, size=(batch, 2))
    images = np.stack([render(s, size, tuple(o)) for s, o in zip(scenes, offsets, strict=True)])
    return images.astype(np.float32) / 127.5 - 1.0, [s.caption for s in scenes]

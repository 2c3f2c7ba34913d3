"""The pixel scorer reads every rendered scene right, and does not find a shape in noise."""

import numpy as np

from meshserve.training.shape_score import adherence, read_picture
from meshserve.training.shapes import COMBINATIONS, DEFAULT_POSITION, POSITIONS, SIZES, Scene, render


def test_every_rendered_scene_reads_back():
    """Every scene at 64x64 (the embedded model's size); at 128x128 every combination at every size in the
    centre and at every position when small (4x the pixels each: all 4,536 there took 36 s of the suite)."""
    scenes = [(c, size, position, 64) for c in COMBINATIONS for size in SIZES for position in POSITIONS]
    scenes += [(c, size, DEFAULT_POSITION, 128) for c in COMBINATIONS for size in SIZES]
    scenes += [(c, "small", position, 128) for c in COMBINATIONS for position in POSITIONS]
    wrong = []
    for (colour, shape, background), size, position, side in scenes:
        r = read_picture(render(Scene(colour, shape, background, size, position), side))
        if (r.colour, r.shape, r.background) != (colour, shape, background):
            wrong.append((colour, shape, background, size, position, side, r))
    assert not wrong, wrong[:5]


def test_noise_and_flat_pictures_match_nothing_by_design():
    rng = np.random.default_rng(0)
    flat = np.full((64, 64, 3), (30, 70, 230), np.uint8)
    assert read_picture(flat).shape is None and read_picture(flat).background == "blue"
    noise = rng.integers(0, 256, (16, 64, 64, 3), dtype=np.uint8)
    score = adherence(noise, [("red", "circle", "blue")] * 16)
    # Noise names some colour everywhere, but rarely the wanted ones together.
    assert score.colour < 0.5 and score.background < 0.5


def _box_blur(image: np.ndarray, width: int) -> np.ndarray:
    out = image.astype(np.float32)
    kernel = np.ones(width) / width
    for axis in (0, 1):
        padded = np.pad(out, [(width, width) if a == axis else (0, 0) for a in range(3)], mode="edge")
        out = np.apply_along_axis(lambda v: np.convolve(v, kernel, mode="same"), axis, padded)
        out = out[width:-width] if axis == 0 else out[:, width:-width]
    return out


def test_blurred_shapes_still_read():
    # Generated pictures have soft edges: every plain scene blurred (3 pixels at 64, 5 at 128) reads the same.
    wrong = []
    for colour, shape, background in COMBINATIONS:
        for side, width in ((64, 3), (128, 5)):
            r = read_picture(_box_blur(render(Scene(colour, shape, background), side), width))
            if (r.colour, r.shape, r.background) != (colour, shape, background):
                wrong.append((colour, shape, background, side, r))
    assert not wrong, wrong[:5]

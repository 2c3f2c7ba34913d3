"""The procedural data: captions in the plain form, a held-out split that training never shows."""

import numpy as np

from meshserve.training.shapes import (
    COLOURS,
    HELD_OUT,
    PALETTE,
    SHAPES,
    TRAINING,
    Scene,
    plain_caption,
    random_scene,
    render,
    training_batch,
)


def test_captions_read_as_the_issue_writes_them():
    assert plain_caption("red", "circle", "blue") == "a red circle on a blue background"
    assert plain_caption("orange", "square", "white") == "an orange square on a white background"
    scene = Scene("red", "circle", "blue", size="small", position="at the top left")
    assert scene.caption == "a small red circle at the top left on a blue background"


def test_the_issues_colours_and_shapes_are_all_there():
    assert {"red", "green", "blue", "yellow", "orange", "purple", "white", "black"} <= set(COLOURS)
    assert {"circle", "square", "triangle"} <= set(SHAPES)


def test_held_out_combinations_never_reach_training():
    assert HELD_OUT and not set(HELD_OUT) & set(TRAINING)
    rng = np.random.default_rng(0)
    seen = {(s.colour, s.shape, s.background) for s in (random_scene(rng) for _ in range(5000))}
    assert not seen & set(HELD_OUT)
    # ...while every colour, as a shape and as a background, and every shape still are trained on.
    assert {c for c, _, _ in TRAINING} == set(COLOURS) == {b for _, _, b in TRAINING}
    assert {(c, s) for c, s, _ in TRAINING} == {(c, s) for c in COLOURS for s in SHAPES}


def test_render_draws_the_scene():
    image = render(Scene("red", "square", "blue"), 64)
    assert image.shape == (64, 64, 3) and image.dtype == np.uint8
    assert tuple(image[0, 0]) == PALETTE["blue"] and tuple(image[32, 32]) == PALETTE["red"]
    # A medium square is 0.45 of the side: about 29 x 29 pixels.
    assert abs((image == PALETTE["red"]).all(-1).sum() - 29 * 29) < 60


def test_training_batch_is_a_function_of_the_generator():
    a, captions_a = training_batch(np.random.default_rng(3), 8)
    b, captions_b = training_batch(np.random.default_rng(3), 8)
    assert np.array_equal(a, b) and captions_a == captions_b
    assert a.dtype == np.float32 and a.min() >= -1 and a.max() <= 1

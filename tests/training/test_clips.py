"""The procedural clips: captions with motion, paths that move TRAVEL unclipped, a held-out split training never
shows in any motion, and a pixel scorer that reads every held-out clip's direction back."""

from __future__ import annotations

import numpy as np
import pytest

from meshserve.training.caption_tokenizer import WORDS
from meshserve.training.clips import (
    CLIP_SIZES,
    CLIP_WORDS,
    DIRECTIONS,
    TRAVEL,
    ClipScene,
    clip_batch,
    held_out_clip_prompts,
    random_clip_scene,
    render_clip,
    still_caption,
)
from meshserve.training.motion_score import STILL_SHIFT, clip_adherence, read_motion
from meshserve.training.shapes import HELD_OUT, PALETTE, SHAPES, SIZES, Scene, plain_caption

_MOTIONS = (*DIRECTIONS, "still")


def _scene(colour: str, shape: str, background: str, motion: str, size: str = "medium") -> ClipScene:
    return ClipScene(colour, shape, background, None if motion == "still" else motion, size)


def test_captions_add_the_motion_to_the_plain_form():
    assert (
        ClipScene("red", "circle", "blue", "left").caption == "a red circle moving left on a blue background"
    )
    assert (
        ClipScene("orange", "square", "white", "up").caption
        == "an orange square moving up on a white background"
    )
    assert (
        ClipScene("red", "triangle", "black", "down", "small").caption
        == "a small red triangle moving down on a black background"
    )
    # Still: the image model's captions, word for word.
    assert ClipScene("red", "circle", "blue").caption == plain_caption("red", "circle", "blue")
    assert (
        ClipScene("green", "square", "red", None, "small").caption
        == Scene("green", "square", "red", "small").caption
    )
    # Every caption word is one of the tokenizer's words or of CLIP_WORDS.
    words = {
        w for d in (*DIRECTIONS, None) for w in ClipScene("red", "circle", "blue", d, "small").caption.split()
    }
    assert words <= set(WORDS) | set(CLIP_WORDS)


def test_a_moving_caption_without_its_motion_is_its_scene_standing_still():
    for size in CLIP_SIZES:
        still = ClipScene("orange", "triangle", "white", None, size)
        for direction in (*DIRECTIONS, None):
            moving = ClipScene("orange", "triangle", "white", direction, size)
            assert still_caption(moving.caption) == still.caption
    assert (
        still_caption("a red circle moving left on a blue background") == "a red circle on a blue background"
    )


def test_clips_draw_only_the_sizes_asked_for():
    _, captions = clip_batch(np.random.default_rng(0), 32, frames=5, size=32, sizes=("medium",))
    assert not any("small" in c for c in captions)
    _, captions = clip_batch(np.random.default_rng(0), 32, frames=5, size=32)
    assert any("small" in c for c in captions)


def test_held_out_combinations_never_reach_training_in_any_motion():
    rng = np.random.default_rng(0)
    scenes = [random_clip_scene(rng) for _ in range(5000)]
    assert not {(s.colour, s.shape, s.background) for s in scenes} & set(HELD_OUT)
    assert {s.direction for s in scenes} == {*DIRECTIONS, None}
    assert {s.size for s in scenes} == set(CLIP_SIZES)
    assert abs(sum(s.direction is None for s in scenes) / len(scenes) - 0.2) < 0.03
    prompts, seeds, wanted = held_out_clip_prompts(seeds=(0, 1))
    assert len(prompts) == len(seeds) == len(wanted) == 2 * len(HELD_OUT) * len(_MOTIONS)
    assert {w for w, s in zip(wanted, seeds, strict=True) if s == 1} == {
        (*combo, m) for combo in HELD_OUT for m in _MOTIONS
    }
    assert prompts == [_scene(*w).caption for w in wanted]


def _centroids(clip: np.ndarray, colour: str) -> np.ndarray:
    """float [frames, 2] (x, y) in pixels of the pixels of exactly `colour`."""
    out = []
    for frame in clip:
        ys, xs = np.nonzero((frame == PALETTE[colour]).all(-1))
        out.append((xs.mean(), ys.mean()))
    return np.asarray(out)


@pytest.mark.parametrize("side", [64, 128])
def test_every_size_travels_the_whole_path_unclipped(side):
    steps = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
    for size in SIZES:
        for shape in SHAPES:
            for direction, step in steps.items():
                clip = render_clip(ClipScene("red", shape, "blue", direction, size), 9, side)
                assert clip.shape == (9, side, side, 3) and clip.dtype == np.uint8
                moves = _centroids(clip, "red") - _centroids(clip, "red")[0]
                # Every frame an equal step along the direction: TRAVEL in all, within a pixel of rasterizing.
                expected = np.linspace(0, TRAVEL * side, 9)[:, None] * np.asarray(step)
                assert np.abs(moves - expected).max() < 1.0, (size, shape, direction, moves)
            still = render_clip(ClipScene("red", shape, "blue", None, size), 5, side)
            assert still.shape == (5, side, side, 3) and (still == still[0]).all()


def test_jittered_training_clips_stay_unclipped():
    # The largest jitter moves a CLIP_SIZES path without clipping it; a large shape has no room, and says so.
    for size in CLIP_SIZES:
        for offset in ((2.0, 2.0), (-2.0, -2.0)):
            for direction in ("right", "down"):
                clip = render_clip(ClipScene("red", "square", "blue", direction, size), 9, 64, offset)
                moves = _centroids(clip, "red")[-1] - _centroids(clip, "red")[0]
                assert abs(np.abs(moves).max() - TRAVEL * 64) < 1.0
    with pytest.raises(ValueError, match="leaves"):
        render_clip(ClipScene("red", "square", "blue", "right", "large"), 9, 64, (2.0, 0.0))


def test_clip_batch_is_a_function_of_the_generator():
    a, captions_a = clip_batch(np.random.default_rng(3), 6, frames=5)
    b, captions_b = clip_batch(np.random.default_rng(3), 6, frames=5)
    assert np.array_equal(a, b) and captions_a == captions_b
    assert a.shape == (6, 5, 64, 64, 3) and a.dtype == np.float32 and a.min() >= -1 and a.max() <= 1


def test_clips_placed_anywhere_keep_the_whole_path_inside_and_cover_the_frame():
    """`anywhere` moves each path by any offset that keeps the shape inside on every frame: the shape is on
    every frame, its path keeps its whole length (render_clip refuses a path that would leave the frame),
    and the middle frames' centres spread far from the centre (a jittered batch stays within 2 pixels)."""
    pixels, captions = clip_batch(np.random.default_rng(5), 64, frames=9, anywhere=True)
    clips = np.round((pixels + 1) * 127.5).astype(np.uint8)
    middles = []
    for clip, caption in zip(clips, captions, strict=True):
        colour = caption.split(" ")[2] if caption.split(" ")[1] in SIZES else caption.split(" ")[1]
        centres = _centroids(clip, colour)
        assert np.isfinite(centres).all(), caption  # the shape is on every frame
        travel = np.abs(centres[-1] - centres[0]).max()
        assert abs(travel - (0 if "moving" not in caption else TRAVEL * 64)) < 1.0, caption
        middles.append(centres[4])
    middles = np.asarray(middles) - 32
    assert np.abs(middles).max() > 12  # centred within 2 pixels without `anywhere`
    jittered = clip_batch(np.random.default_rng(5), 8, frames=9)[0]
    assert not np.array_equal(jittered, pixels[:8])


def _box_blur(clips: np.ndarray) -> np.ndarray:
    """A 3x3 box blur of every frame of float or uint8 [..., H, W, 3] (edges repeated), vectorized: the loop of
    test_shape_score's blur over 120 clips of 9 frames would take most of this file's time."""
    x = clips.astype(np.float32)
    pad = [(0, 0)] * (x.ndim - 3) + [(1, 1), (1, 1), (0, 0)]
    p = np.pad(x, pad, mode="edge")
    h, w = x.shape[-3:-1]
    return sum(p[..., i : i + h, j : j + w, :] for i in range(3) for j in range(3)) / 9


def test_every_held_out_clip_reads_back_sharp_and_blurred_with_noise():
    # Generated clips have soft edges and grain: blurred and then noisy (sd 8 of 255) at once, which is harder
    # than either alone, and cheaper to test than both apart.
    _, _, wanted = held_out_clip_prompts()
    rng = np.random.default_rng(0)
    for size in CLIP_SIZES:
        clips = np.stack([render_clip(_scene(*w, size=size)) for w in wanted])
        noise = 8 * rng.standard_normal(clips.shape, np.float32)
        soft = np.clip(_box_blur(clips) + noise, 0, 255).astype(np.uint8)
        for name, variant in (("sharp", clips), ("blurred and noisy", soft)):
            score = clip_adherence(variant, wanted)
            assert (score.colour, score.background, score.shape, score.direction) == (1, 1, 1, 1), (
                size,
                name,
                score,
            )
            assert score.n == len(HELD_OUT) * len(_MOTIONS)
    # Still clips' centroids stay put, moving ones move TRAVEL: far from STILL_SHIFT either side.
    still = read_motion(_box_blur(render_clip(ClipScene("red", "triangle", "blue", None, "small"))))
    moving = read_motion(render_clip(ClipScene("red", "triangle", "blue", "up", "small")))
    assert np.hypot(still.dx, still.dy) < 0.01 and STILL_SHIFT < TRAVEL / 2
    assert abs(moving.dy + TRAVEL) < 0.02 and abs(moving.dx) < 0.01


def test_a_flat_clip_has_no_shape_and_a_wrong_way_clip_scores_zero():
    flat = np.full((9, 64, 64, 3), PALETTE["blue"], np.uint8)
    assert read_motion(flat).direction is None
    assert clip_adherence([flat], [("red", "circle", "blue", "still")]).direction == 0
    # The right colours and shape, moving the opposite way (and still where motion was asked): all wrong.
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up", "still": "left"}
    _, _, wanted = held_out_clip_prompts()
    clips = [render_clip(_scene(c, s, b, opposite[m])) for c, s, b, m in wanted]
    score = clip_adherence(clips, wanted)
    assert (score.colour, score.background, score.shape, score.direction) == (1, 1, 1, 0)

"""The synthetic Wan probes' square counter (it must find every square the probe's data draws, and none in noise)
and the held-out clips the VAE round trip reads."""

import numpy as np

from meshserve.training import wan_probes


def test_counts_every_drawn_square_and_none_in_noise():
    rng = np.random.default_rng(0)
    assert wan_probes.count_squares(wan_probes._squares(rng, 16)) == 16
    assert wan_probes.count_squares(rng.normal(size=(16, *wan_probes.GRID, 16))) == 0
    # A square twice the size (12 x 12 = 144 pixels) is not "about a square's size".
    big = np.full((1, *wan_probes.GRID, 16), -0.5, np.float32)
    big[:, :, 2:14, 2:14, :4] = 1.5
    assert wan_probes.count_squares(big) == 0


def test_held_out_clips_read_back_as_prompted_and_a_frozen_clip_does_not_move():
    from meshserve.training.motion_score import clip_adherence

    clips, wanted = wan_probes.held_out_clips()
    assert clips.shape == (120, 9, 64, 64, 3) and len(wanted) == 120
    assert {w[3] for w in wanted} == {"left", "right", "up", "down", "still"}
    pixels = ((clips + 1.0) * 127.5).round().astype(np.uint8)
    exact = clip_adherence(pixels, wanted)
    assert (exact.colour, exact.background, exact.shape, exact.direction) == (1.0, 1.0, 1.0, 1.0)
    # Every frame replaced by the middle one: the pictures still read right, the 96 moving clips do not.
    frozen = clip_adherence(np.repeat(pixels[:, 4:5], 9, axis=1), wanted)
    assert (frozen.colour, frozen.shape, frozen.direction) == (1.0, 1.0, 24 / 120)


def test_moving_squares_read_back_their_direction_and_reversed_ones_the_opposite():
    rng = np.random.default_rng(0)
    opposite = {0: 1, 1: 0, 2: 3, 3: 2, 4: 4}
    for anywhere in (False, True):
        latents, labels = wan_probes._moving_squares(rng, 64, 2, anywhere)
        assert set(labels) == set(range(len(wan_probes.DIRECTIONS)))
        assert wan_probes.read_direction(latents, 2) == list(labels)
        reversed_time = wan_probes.read_direction(latents[:, ::-1], 2)
        assert reversed_time == [opposite[int(k)] for k in labels]
    # Centred paths: the middle frame's square is where a still one is, whatever the direction.
    latents, _ = wan_probes._moving_squares(rng, 16, 2, anywhere=False)
    assert (latents[:, 1] == latents[0, 1]).all()
    # A frozen square is still; pure noise holds no square.
    frozen = np.repeat(latents[:, 1:2], wan_probes.GRID[0], axis=1)
    assert wan_probes.read_direction(frozen, 2) == [4] * 16
    assert wan_probes.read_direction(rng.normal(size=(4, *wan_probes.GRID, 16)) * 0.1, 2) == [None] * 4


def test_the_probe_transformer_takes_a_temporal_patch():
    """`--patch 3,2,2`: the probe's transformer on three latent frames a token (8 x 8 tokens) maps the probe's
    latents to their own shape, with RoPE tables for that grid."""
    import jax.numpy as jnp

    trainee, rope = wan_probes._transformer(1, patch=(3, 2, 2), width=48, heads=2)
    assert rope[0].shape == (64, 24)
    x = jnp.zeros((1, *wan_probes.GRID, 16))
    out = trainee.module(trainee.params)(x, jnp.full((1,), 500.0), jnp.zeros((1, 16, 32)), rope)
    assert out.shape == x.shape

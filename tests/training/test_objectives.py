"""The training objectives' noise levels: flow matching draws sigma as its scheduler shifts it, or from a
logit-normal share, and the noisy latents and targets are the straight path's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshserve.training import objectives
from meshserve.training.objectives import flow_matching

ROWS = 20_000


def _sigmas(objective):
    latents = jnp.zeros((ROWS, 1))
    _, sigma, _ = objective(latents, jax.random.key(0))
    return np.asarray(sigma)


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_flow_matching_draws_the_shifted_uniform_sigmas(shift):
    sigma = _sigmas(flow_matching(shift))
    # P(sigma <= s) = u(s), the inverse of the shift: s / (shift - (shift - 1) s).
    for s in (0.25, 0.5, 0.75):
        assert abs(np.mean(sigma <= s) - s / (shift - (shift - 1.0) * s)) < 0.015


def test_a_logit_normal_share_concentrates_the_middle_noise_levels():
    middle = {
        p: np.mean(np.abs(_sigmas(flow_matching(1.0, logit_normal=p)) - 0.5) <= 0.23) for p in (0, 0.5, 1)
    }
    # sigmoid(N(0, 1)) is within 0.23 of 0.5 with probability 2 Phi(1) - 1 = 0.68; uniform: 0.46.
    assert abs(middle[0] - 0.46) < 0.015 and abs(middle[0.5] - 0.57) < 0.015 and abs(middle[1] - 0.68) < 0.015


def test_the_noisy_latents_lie_on_the_straight_path():
    latents = jax.random.normal(jax.random.key(1), (64, 3, 4))
    noisy, sigma, target = flow_matching(1.0, logit_normal=0.5)(latents, jax.random.key(2))
    noise = target + latents  # the target is the velocity noise - latents
    s = sigma[:, None, None]
    assert float(jnp.abs(noisy - ((1 - s) * latents + s * noise)).max()) < 1e-5
    assert float(noise.std()) == pytest.approx(1.0, abs=0.05)


def test_the_frame_difference_error_ignores_what_the_frames_share():
    """objectives.frame_difference_error: an error the same in every frame costs nothing; one that moves does."""
    rng = np.random.default_rng(0)
    shared = np.broadcast_to(rng.standard_normal((2, 1, 4, 4, 3)), (2, 5, 4, 4, 3))
    assert float(objectives.frame_difference_error(jnp.asarray(shared))) == 0.0
    moving = rng.standard_normal((2, 5, 4, 4, 3)).astype(np.float32)
    expected = np.mean((moving[:, 1:] - moving[:, :-1]) ** 2)
    np.testing.assert_allclose(
        float(objectives.frame_difference_error(jnp.asarray(moving))), expected, rtol=1e-6
    )
    assert float(objectives.frame_difference_error(jnp.asarray(moving[:, :1]))) == 0.0  # one frame


def test_a_led_first_frame_lies_nearer_the_clean_latents_on_the_same_path():
    """objectives.lead_first_frame: in the led rows only the first frame moves, toward the clean latents along
    its own straight path (same noise, a lower sigma); the other rows and frames are untouched."""
    latents = jax.random.normal(jax.random.key(3), (4000, 3, 2, 2, 1))
    noisy, sigma, target = flow_matching(3.0)(latents, jax.random.key(4))
    led = objectives.lead_first_frame(noisy, sigma, target, jax.random.key(5), share=0.5)
    np.testing.assert_array_equal(np.asarray(led[:, 1:]), np.asarray(noisy[:, 1:]))
    noise = np.asarray(target + latents)
    # Each row's first frame is x0 + s' (noise - x0) for one s' in [0, sigma]: s' by least squares per row.
    first, x0 = np.asarray(led[:, 0]).reshape(len(led), -1), np.asarray(latents[:, 0]).reshape(len(led), -1)
    path = noise[:, 0].reshape(len(led), -1) - x0
    lead = ((first - x0) * path).sum(1) / (path**2).sum(1)
    residual = first - (x0 + lead[:, None] * path)
    assert np.abs(residual).max() < 1e-4
    changed = np.abs(lead - np.asarray(sigma)) > 1e-5
    assert abs(changed.mean() - 0.5) < 0.03  # the share
    assert np.all(lead[changed] < np.asarray(sigma)[changed]) and np.all(lead >= -1e-5)

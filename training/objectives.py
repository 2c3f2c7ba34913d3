"""What the denoiser learns to predict: a noised batch of latents, the timestep it is at, and the target.

Each family trains on the objective its scheduler samples with: SDXL's v-prediction over the DDPM schedule
(the scheduler's own alpha_bar), Flux's and Wan's flow matching (the velocity noise - latents along the
straight path, at sigmas drawn uniformly and shifted as their schedulers shift them).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

# (latents, key) -> (noisy latents, t: the family's timestep per row, target)
Objective = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]


def _per_row(x, like):
    return x.reshape(x.shape + (1,) * (like.ndim - 1))


def v_prediction(alphas_cumprod) -> Objective:
    """t: an integer training step, uniform over the schedule; target v = sqrt(a) noise - sqrt(1 - a) x0."""
    alphas_cumprod = jnp.asarray(alphas_cumprod, jnp.float32)

    def noised(latents, key):
        k_t, k_noise = jax.random.split(key)
        t = jax.random.randint(k_t, (latents.shape[0],), 0, alphas_cumprod.shape[0])
        noise = jax.random.normal(k_noise, latents.shape)
        a = _per_row(alphas_cumprod[t], latents)
        noisy = jnp.sqrt(a) * latents + jnp.sqrt(1.0 - a) * noise
        return noisy, t, jnp.sqrt(a) * noise - jnp.sqrt(1.0 - a) * latents

    return noised


def flow_matching(shift: float, logit_normal: float = 0.0) -> Objective:
    """t: sigma in [0, 1], u uniform shifted as the flow schedulers shift theirs (shift u / (1 + (shift - 1) u),
    diffusers' time_shift with exp(mu) = shift), so training sees the sigmas sampling visits; the noisy
    latents are (1 - sigma) x0 + sigma noise and the target the velocity noise - x0. A `logit_normal` share
    of the rows draws u from SD3's logit-normal (mean 0, std 1) instead, which concentrates on the middle
    noise levels."""

    def noised(latents, key):
        k_u, k_noise = jax.random.split(key)
        rows = (latents.shape[0],)
        u = jax.random.uniform(k_u, rows)
        if logit_normal:  # its keys from k_u's, so the uniform draws (and tiny-flux's run) stay as they were
            k_pick, k_ln = jax.random.split(jax.random.fold_in(k_u, 1))
            from_normal = jax.nn.sigmoid(jax.random.normal(k_ln, rows))
            u = jnp.where(jax.random.uniform(k_pick, rows) < logit_normal, from_normal, u)
        sigma = shift * u / (1.0 + (shift - 1.0) * u)
        noise = jax.random.normal(k_noise, latents.shape)
        s = _per_row(sigma, latents)
        return (1.0 - s) * latents + s * noise, sigma, noise - latents

    return noised


def frame_difference_error(error: jax.Array) -> jax.Array:
    """The mean square of a video prediction's error [B, F, H, W, C] differenced between consecutive frames:
    what the frames' errors share cancels, what differs from frame to frame (the motion) stays. A loss term
    for Wan's trials (training/wan_probes.py motion --frame-weight); 0 for a single frame."""
    if error.shape[1] < 2:
        return jnp.zeros((), error.dtype)
    return jnp.mean((error[:, 1:] - error[:, :-1]) ** 2)


def lead_first_frame(noisy, sigma, target, key, share: float):
    """A `share` of the rows get their first latent frame less noised than the rest (its sigma scaled by a
    uniform draw), the timestep still the rest's: a trial for Wan (training/wan_probes.py motion
    --first-frame-lead). With the first frame showing through, the later frames are predicted best by moving
    what it shows the way the caption says, which asks the DiT for the coupling between frames that the
    direction word needs. The target, the velocity noise - x0, does not depend on sigma, so only the input
    changes: x_s = x0 + s (noise - x0)."""
    k_pick, k_scale = jax.random.split(key)
    rows = (noisy.shape[0],)
    lead = jnp.where(jax.random.uniform(k_pick, rows) < share, jax.random.uniform(k_scale, rows), 1.0)
    first = noisy[:, :1] - _per_row(sigma * (1.0 - lead), noisy[:, :1]) * target[:, :1]
    return noisy.at[:, :1].set(first)

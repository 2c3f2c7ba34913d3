"""The denoising loop every family runs: one `lax.while_loop` over the steps, traced inside a pipeline's
denoise program, with classifier-free guidance, per-row step noise and a host callback after every step.

    latents = denoise_loop(model, scheduler, schedule, latents, keys, guidance, do_cfg=..., ...)

- `model(x, t, i)`: the family's denoiser on the model batch x (latents [B, ...], or [2B, ...] with CFG) at the
  schedule's timestep t (a [] scalar), step i of the schedule ([] int32: what a per-step setting such as a
  ControlNet's control_guidance_start/end reads, where t would be ambiguous: a second-order scheduler's
  timesteps repeat); it closes over its own conditioning (text embeddings, pooled vectors,
  Flux's guidance embedding...) and returns the prediction the scheduler expects, shaped like x.
- CFG: the model batch is interleaved per sample, [u0, c0, u1, c1, ...], so with the batch split over
  (data, cfg) each sample's unconditional and conditional halves sit on the two sides of the `cfg` axis and
  the combine is one exchange. Conditioning passed to `model` must be interleaved the same way (`interleave`).
- The trip count is `schedule.num_steps`: traced for a padded schedule (`pad_schedule`), so one program
  serves every step count.
- `keys` [B]: one PRNG key per row; a stochastic scheduler's noise for row b at step i comes from keys[b] and
  i alone (`seeds.step_keys`), never from the batch around it.
- `on_step(step, _) -> bool` runs on the host after every step (an io_callback): progress, and False
  stops the loop (cancel). Always compiled in, so a call with and one without a callback share one program;
  it costs one host round trip per step.
- `start` (traced, default 0): the first step to run, for a loop that starts mid-schedule from a noised
  image (img2img, inpaint: models/engine/image_inputs.py); steps are then reported as i + 1 - start.
- `stop` (traced, default: the schedule's end): the step to stop before, for a loop that leaves the last
  steps to another model (diffusers' `denoising_end`: SDXL's base hands its latents to the refiner).
- `after_step(latents, i) -> latents` (optional, traced): a per-step hook after the scheduler's step and
  before the callback (4-channel inpainting puts the known region back here).
- `preview(steps_done, latents) -> bool` (optional, traced): live previews, models/engine/previews.py.
- `step_end(latents, i, t) -> (latents, go)` (optional, traced): diffusers' callback_on_step_end, after
  `after_step` (models/engine/step_end.py); go False stops the loop (its interrupt, or an error).
- `step_cache` (optional): a step cache's slot (models/engine/step_cache.py); its state rides in the carry and
  the loop also returns how many steps it skipped.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from meshserve.models.engine.seeds import step_keys
from meshserve.models.engine.step_cache import skipped_steps


def interleave(a, b):
    """[B, ...] x 2 -> [2B, ...] as a0, b0, a1, b1, ... (CFG: a = unconditional, b = conditional)."""
    return jnp.stack([a, b], axis=1).reshape(-1, *a.shape[1:])


def guide(out, guidance, rescale=None):
    """Classifier-free guidance on an interleaved model output [2B, ...] -> [B, ...]; guidance [B]. `rescale`
    [B]: diffusers' guidance_rescale (rescale_noise_cfg, "Common Diffusion Noise Schedules and Sample Steps are
    Flawed" section 3.4), applied to the rows whose value is > 0 (the others are the plain combine, exactly)."""
    out = out.reshape(-1, 2, *out.shape[1:])
    uncond, cond = out[:, 0], out[:, 1]
    per_row = (-1, *([1] * (uncond.ndim - 1)))
    guided = uncond + guidance.astype(out.dtype).reshape(per_row) * (cond - uncond)
    if rescale is None:
        return guided
    r = rescale.astype(jnp.float32).reshape(per_row)
    return jnp.where(r > 0, rescale_noise_cfg(guided, cond, r), guided)


def rescale_noise_cfg(guided, cond, rescale):
    """diffusers' rescale_noise_cfg: the guided prediction scaled to the conditional one's standard deviation
    (torch's unbiased std over all but the batch axis, a layout-free statistic), mixed in by `rescale` [B, 1...]."""
    axes = tuple(range(1, guided.ndim))
    g32 = guided.astype(jnp.float32)
    ratio = jnp.std(cond.astype(jnp.float32), axis=axes, keepdims=True, ddof=1) / jnp.std(
        g32, axis=axes, keepdims=True, ddof=1
    )
    return (rescale * (g32 * ratio) + (1 - rescale) * g32).astype(guided.dtype)


def denoise_loop(
    model: Callable,
    scheduler,
    schedule,
    latents,
    keys,
    guidance,
    *,
    do_cfg: bool,
    rescale=None,
    on_step: Callable[[int, jax.Array], np.bool_],
    constrain: Callable = lambda x: x,
    preview: Callable | None = None,
    start=0,
    stop=None,
    after_step: Callable | None = None,
    step_cache=None,
    step_end: Callable | None = None,
    step_noise=None,
):
    """latents [B, ...] (already scaled by the scheduler's init_noise_sigma, or noised to step `start`); keys
    [B]; guidance [B], or a function of the step's timestep -> [B]; rescale [B] or None (`guide`); step_noise
    [B, calls, ...] or None: a stochastic step's noise at each call, given (diffusers' generator draws,
    replayed) instead of drawn from the keys. Returns (latents, steps_done): steps_done <
    min(schedule.num_steps, stop) - start when on_step stopped the loop; with `step_cache`, (latents,
    steps_done, steps_skipped)."""
    num_steps = schedule.num_steps

    def model_input(latents, i):
        x = interleave(latents, latents) if do_cfg else latents
        return constrain(scheduler.scale_model_input(schedule, x, i)), jnp.asarray(schedule.timesteps)[i], i

    def body(carry):
        i, _, latents, sched_state, cache_state = carry
        x, t, _ = model_input(latents, i)
        if step_cache is None:
            out = model(x, t, i)
        else:
            out, cache_state = step_cache.step(model, x, t, i, cache_state)
        if do_cfg:
            out = guide(out, guidance(t) if callable(guidance) else guidance, rescale)
        key = step_keys(keys, i) if scheduler.stochastic else None
        noise = None if step_noise is None else jax.lax.dynamic_index_in_dim(step_noise, i, 1, keepdims=False)
        latents, sched_state = scheduler.step(schedule, sched_state, out, latents, i, key, noise=noise)
        if after_step is not None:
            latents = after_step(latents, i)
        more = True
        if step_end is not None:
            latents, more = step_end(latents, i, jnp.asarray(schedule.timesteps)[i])
        latents = constrain(latents)
        # The callback takes one element of the new latents so it runs after the step, not beside it; the
        # loop condition waits for its answer, so steps report in order without an ordered effect (whose
        # runtime token is one more host-to-device transfer per call, staged on the default device).
        go = io_callback(
            on_step, jax.ShapeDtypeStruct((), jnp.bool_), i + 1 - start, latents.ravel()[0], ordered=False
        )
        go = go & more
        if preview is not None:  # live previews (models/engine/previews.py): pixels leave only when due
            go = go & preview(i + 1 - start, latents)
        return i + 1, go, latents, sched_state, cache_state

    start = jnp.asarray(start, jnp.int32)
    cache_state = None if step_cache is None else step_cache.init_state(model, *model_input(latents, start))
    carry = (start, jnp.bool_(True), latents, scheduler.init_state(latents), cache_state)
    end = num_steps if stop is None else jnp.minimum(num_steps, stop)
    i, _, latents, _, cache_state = jax.lax.while_loop(lambda c: (c[0] < end) & c[1], body, carry)
    if step_cache is None:
        return latents, i - start
    return latents, i - start, skipped_steps(cache_state)


class StepReporter:
    """The host end of the loop's io_callback: forwards (step, total) to the current call's listener."""

    def __init__(self):
        self.listener: Callable[[int, int], bool | None] | None = None
        self.total = 0

    def __call__(self, step, _after=None) -> np.bool_:
        listener = self.listener
        if listener is None:
            return np.bool_(True)
        return np.bool_(listener(int(step), self.total) is not False)

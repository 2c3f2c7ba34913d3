"""diffusers' `denoising_end` and `denoising_start`: a schedule split between two models.

SDXL's "ensemble of expert denoisers": the base model runs the noisy part of the schedule and returns its
latents (output_type "latent"); the refiner (an image-to-image call given those latents as `image=`) runs the
rest. diffusers (StableDiffusionXLPipeline, its img2img and inpaint pipelines) cuts at the timestep
round(T - fraction x T), T the scheduler's num_train_timesteps:

    steps = end_steps(denoising_end, timesteps_to_run, config)     # the leading steps with t >= cut-off
    start = start_step(denoising_start, timesteps, config)         # the first step with t < cut-off

A start and a stop are traced inputs of the loop (denoise_loop's `start` and `stop`): no value compiles.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from meshserve.models.engine.common import PipelineError


def _check_fraction(name: str, fraction) -> None:
    """PipelineError unless `fraction` is a number strictly between 0 and 1 (diffusers ignores other values
    silently; a call that asked for a cut is told it made none)."""
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        raise PipelineError(f"{name} must be a number in (0, 1), got {fraction!r}")
    if not (math.isfinite(fraction) and 0.0 < fraction < 1.0):
        raise PipelineError(f"{name} must be in (0, 1), got {fraction}")


def _cutoff(name: str, fraction, scheduler_config: Mapping) -> int:
    """diffusers' discrete_timestep_cutoff for a checked fraction."""
    _check_fraction(name, fraction)
    train_steps = int(scheduler_config.get("num_train_timesteps", 1000))
    return int(round(train_steps - fraction * train_steps))


def check_order(denoising_start, denoising_end) -> None:
    """Both given: each a number in (0, 1), the end above the start (diffusers raises the same)."""
    if denoising_start is None or denoising_end is None:
        return
    _check_fraction("denoising_start", denoising_start)
    _check_fraction("denoising_end", denoising_end)
    if denoising_end <= denoising_start:
        raise PipelineError(
            f"denoising_end ({denoising_end}) must be above denoising_start ({denoising_start})"
        )


def end_steps(denoising_end, timesteps: np.ndarray, scheduler_config: Mapping) -> int:
    """How many of `timesteps` (the call's, in the order it runs them, after a strength's cut) a
    `denoising_end` keeps: diffusers' `len(list(filter(lambda ts: ts >= discrete_timestep_cutoff, timesteps)))`.
    PipelineError when that is none."""
    cutoff = _cutoff("denoising_end", denoising_end, scheduler_config)
    kept = int(np.sum(np.asarray(timesteps, np.float64) >= cutoff))
    if kept == 0:
        raise PipelineError(
            f"denoising_end {denoising_end} keeps no step: its cut-off timestep {cutoff} is above the first one "
            f"this call runs ({float(timesteps[0]):g}); raise denoising_end"
        )
    return kept


def start_step(denoising_start, timesteps: np.ndarray, scheduler_config: Mapping, order: int = 1) -> int:
    """The first of `timesteps` (the whole schedule, one per model call) a `denoising_start` runs: diffusers'
    img2img `get_timesteps` keeps the last `(timesteps < discrete_timestep_cutoff).sum()` of them, one more when
    that is even for a second-order scheduler (`order` 2: Heun, DPM2, DPM2 a, DPM++ SDE), so that the run
    starts on a step's first call. PipelineError when that is none."""
    cutoff = _cutoff("denoising_start", denoising_start, scheduler_config)
    kept = int(np.sum(np.asarray(timesteps, np.float64) < cutoff))
    if order == 2 and kept % 2 == 0 and kept:
        kept += 1
    if kept == 0:
        raise PipelineError(
            f"denoising_start {denoising_start} leaves no step: its cut-off timestep {cutoff} is at or below the "
            f"last one ({float(timesteps[-1]):g}); lower denoising_start"
        )
    return len(timesteps) - kept

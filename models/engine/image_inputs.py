"""Image inputs in the engine: where an image enters a call (image-to-image, inpainting, image-to-video).

    start = start_step(steps, strength, rule)            # host: the first step a strength runs (get_timesteps)
    x = noise_to(scheduler, schedule, image_latents, noise, index)   # traced: the image noised to step `index`
    latents = blend_known(scheduler, schedule, latents, inputs, noise, i, stop)   # traced: 4-channel inpainting

The image's latents come from the family's `encode_image` (the VAE posterior's mode, scaled and shifted as
the family's VAE wants, in the loop's layout) in the pipeline's `image_encode` program. The denoise program
then starts at step `start` (a traced value: a new strength compiles nothing) from the image noised to that
step, as diffusers' img2img and inpaint pipelines do with `scheduler.add_noise` (Flux: `scale_noise`) at
`timesteps[t_start]`; with a mask, after every step the known region is put back, noised to the next step
(`blend_known`); a 9-channel inpainting UNet or an image-to-video model instead takes a `condition`
concatenated to its input every step.

What `image_encode` returns (a dict, each entry [B, ...] in the loop's layout, B = output rows):

    image_latents   the image to noise and start from (absent: the loop starts from pure noise, as Wan i2v)
    mask            1 where the model repaints, 0 where the image is kept (the 4-channel inpaint blend)
    condition       concatenated after the latents on the last (channel) axis of every model input
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from meshserve.limits import min_strength
from meshserve.models.engine.common import PipelineError
from meshserve.models.schedulers import (
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    DPMSolverSDEScheduler,
    EDMDPMSolverMultistepScheduler,
    EDMEulerScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    HeunDiscreteScheduler,
    KDPM2AncestralDiscreteScheduler,
    KDPM2DiscreteScheduler,
    LCMScheduler,
    LMSDiscreteScheduler,
    PNDMScheduler,
    UniPCMultistepScheduler,
)
from meshserve.models.schedulers.common import at, vp_alpha_sigma

TASKS = ("text-to-image", "image-to-image", "inpaint", "text-to-video", "image-to-video")


def start_step(steps: int, strength: float, rule: str) -> int:
    """The first step of a `steps`-step schedule that a `strength` runs (diffusers' `get_timesteps`, order 1):

    "int":   SDXL's   t_start = steps - min(int(steps * strength), steps)
    "float": Flux's   t_start = int(max(steps - steps * strength, 0))   (steps * strength not truncated first)

    so 4 steps at strength 0.6 run 2 steps on SDXL and 3 on Flux, as in diffusers."""
    if rule == "int":
        return max(steps - min(int(steps * strength), steps), 0)
    return int(max(steps - min(steps * strength, steps), 0))


def check_strength(
    strength, steps: int, rule: str, length: int | None = None, steps_from: str = "num_inference_steps"
) -> int:
    """PipelineError unless strength is a number in (0, 1] that leaves at least one step; the start step.

    The start comes from the requested `steps`, as diffusers' get_timesteps computes it, and indexes the
    schedule as made: `length` steps, fewer than requested where DPM-Solver's lambda_min_clipped drops some (10
    trailing steps of squaredcos_cap_v2 at lambda_min_clipped -1 are 8: strength 0.5 starts at 5 and runs 3).
    `steps_from`: the argument that set the steps, named in the error (a custom schedule's sigmas/timesteps)."""
    if isinstance(strength, bool) or not isinstance(strength, int | float) or not math.isfinite(strength):
        raise PipelineError(f"strength must be a number in (0, 1], got {strength!r}")
    if not 0.0 < strength <= 1.0:
        raise PipelineError(f"strength must be in (0, 1], got {strength}")
    start = start_step(steps, float(strength), rule)
    length = steps if length is None else length
    if start >= length:
        raise PipelineError(
            f"strength {strength} of {steps} steps runs no step; raise strength or the steps of {steps_from} "
            f"(at least {min_strength(steps):g} for {steps} steps)"
            + (f" (the scheduler makes {length} of the {steps} steps)" if length < steps else "")
        )
    return start


# The schedulers whose add_noise is x + noise x sigmas[index] (index: the model call; the second-order ones'
# sigmas hold one entry per call, as diffusers'). EDM's DPM-Solver is one, though a DPM-Solver subclass.
SIGMA_NOISED = (
    EDMDPMSolverMultistepScheduler,
    EDMEulerScheduler,
    EulerDiscreteScheduler,
    EulerAncestralDiscreteScheduler,
    LMSDiscreteScheduler,
    HeunDiscreteScheduler,
    KDPM2DiscreteScheduler,
    KDPM2AncestralDiscreteScheduler,
    DPMSolverSDEScheduler,
)


def noise_to(scheduler, schedule, x, noise, index):
    """x noised to the level of step `index` (traced), as the scheduler's diffusers `add_noise` /
    `scale_noise` does at `timesteps[index]`; float32."""
    x, noise = x.astype(jnp.float32), noise.astype(jnp.float32)
    # UniPC's and DPM-Solver's flow forms noise as flow-matching Euler does (their alpha is 1 - sigma).
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler) or getattr(scheduler, "use_flow_sigmas", False):
        sigma = at(schedule.sigmas, index)
        return sigma * noise + (1.0 - sigma) * x
    if isinstance(scheduler, SIGMA_NOISED):
        return x + noise * at(schedule.sigmas, index)
    if isinstance(scheduler, DPMSolverMultistepScheduler | UniPCMultistepScheduler):
        alpha_t, sigma_t = vp_alpha_sigma(at(schedule.sigmas, index))
        return alpha_t * x + sigma_t * noise
    if isinstance(scheduler, DDIMScheduler | DDPMScheduler | LCMScheduler | PNDMScheduler):  # by alpha_bar
        alpha_prod = at(schedule.alpha_prod_t, index)
        return alpha_prod**0.5 * x + (1.0 - alpha_prod) ** 0.5 * noise
    raise PipelineError(f"{type(scheduler).__name__} cannot start from an image (no add_noise here)")


def check_scheduler(scheduler) -> None:
    """Fail on the host, before tracing, for a scheduler that cannot start from an image."""
    # LMS starts with no slopes from before the start step, as diffusers' (begin index > 0) does; the second-order
    # ones on a step's first call (start x order), with nothing carried from before; PNDM with its counter at 0.
    supported = (
        FlowMatchEulerDiscreteScheduler,
        DPMSolverMultistepScheduler,
        UniPCMultistepScheduler,
        DDIMScheduler,
        DDPMScheduler,
        LCMScheduler,
        PNDMScheduler,
        *SIGMA_NOISED,
    )
    if not isinstance(scheduler, supported):
        raise PipelineError(f"{type(scheduler).__name__} cannot start from an image (no add_noise here)")


def blend_known(scheduler, schedule, latents, inputs, noise, i, stop):
    """diffusers' 4-channel inpainting after step i: the known region (mask 0) is the image noised to the
    next step's level, the clean image after the call's last step (`stop`, traced: the schedule's end, or where
    denoising_end cuts it, as diffusers' `i < len(timesteps) - 1` over the cut timesteps); the masked region
    keeps the denoised latents."""
    image = inputs["image_latents"]
    next_i = i + 1
    noised = noise_to(scheduler, schedule, image, noise, jnp.minimum(next_i, schedule.num_steps - 1))
    known = jnp.where(next_i < stop, noised, image.astype(jnp.float32))
    mask = inputs["mask"].astype(jnp.float32)
    return ((1.0 - mask) * known + mask * latents.astype(jnp.float32)).astype(latents.dtype)

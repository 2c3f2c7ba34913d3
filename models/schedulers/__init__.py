"""Diffusion schedulers as pure functions, equal to their diffusers counterparts (tests/models/test_schedulers.py).

    sched = make_scheduler("euler", config)            # config: the folder's scheduler_config.json as a dict
    schedule = sched.schedule(num_inference_steps)     # host numpy arrays (a pytree): timesteps [N], sigmas, ...
    sample = latents * sched.init_noise_sigma(schedule)
    state = sched.init_state(sample)                   # pytree carried through the loop
    for i in range(schedule.num_steps):                # or lax.fori_loop / while_loop: i may be traced
        x_in = sched.scale_model_input(schedule, sample, i)
        model_output = unet(x_in, schedule.timesteps[i], ...)
        sample, state = sched.step(schedule, state, model_output, sample, i, key_i)

A scheduler is a frozen, hashable dataclass (a static argument of jit); a schedule's arrays are traced inputs,
so a new step index or new schedule values of the same length reuse the compiled program. Stochastic
schedulers (`sched.stochastic`) take a fresh PRNG key per step, or explicit standard-normal `noise=`.
Loop over `schedule.num_steps`, not the requested count: DPM-Solver's clipped schedules can be shorter, Heun's
and DPM2's longer (two model calls a step but the last), PNDM's too (its first step twice, or a Runge-Kutta start):
`sched.model_calls(n)`.
`pad_schedule(schedule, max_steps)` pads the arrays to a fixed length and makes `num_steps` a traced count, so
one compiled loop serves every step count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshserve.models.schedulers.common import NoiseScheduler, SigmaSchedule, pad_schedule
from meshserve.models.schedulers.ddim import DDIMSchedule, DDIMScheduler
from meshserve.models.schedulers.ddpm import DDPMSchedule, DDPMScheduler
from meshserve.models.schedulers.deis_multistep import DEISMultistepScheduler
from meshserve.models.schedulers.dpm_solver import DPMSolverMultistepScheduler
from meshserve.models.schedulers.dpm_solver_sde import DPMSolverSDEScheduler
from meshserve.models.schedulers.dpm_solver_singlestep import DPMSolverSinglestepScheduler, SinglestepSchedule
from meshserve.models.schedulers.edm_dpm_solver import EDMDPMSolverMultistepScheduler
from meshserve.models.schedulers.edm_euler import EDMEulerScheduler
from meshserve.models.schedulers.euler import EulerDiscreteScheduler
from meshserve.models.schedulers.euler_ancestral import EulerAncestralDiscreteScheduler
from meshserve.models.schedulers.flow_match_euler import FlowMatchEulerDiscreteScheduler, flux_mu
from meshserve.models.schedulers.heun import HeunDiscreteScheduler
from meshserve.models.schedulers.k_dpm_2 import KDPM2DiscreteScheduler, KDPM2Schedule
from meshserve.models.schedulers.k_dpm_2_ancestral import (
    KDPM2AncestralDiscreteScheduler,
    KDPM2AncestralSchedule,
)
from meshserve.models.schedulers.lcm import LCMSchedule, LCMScheduler
from meshserve.models.schedulers.lms import LMSDiscreteScheduler, LMSSchedule
from meshserve.models.schedulers.pndm import PNDMSchedule, PNDMScheduler
from meshserve.models.schedulers.tcd import TCDSchedule, TCDScheduler
from meshserve.models.schedulers.unipc_multistep import UniPCMultistepScheduler

# What a name of both families means on a flow-matching model's config (FLOW_SCHEDULER_NAMES).
_FLOW_FORM = {"use_flow_sigmas": True, "prediction_type": "flow_prediction"}
_OTHER_SIGMAS_OFF = {"use_exponential_sigmas": False, "use_beta_sigmas": False}

# The names the API offers, each with its class and the settings the name implies (over the model's config).
_BY_NAME: dict[str, tuple[type[NoiseScheduler], dict[str, Any]]] = {
    "euler": (EulerDiscreteScheduler, {}),
    "euler_ancestral": (EulerAncestralDiscreteScheduler, {}),
    "ddim": (DDIMScheduler, {}),
    "ddpm": (DDPMScheduler, {}),
    # PNDM as the folder's config says (SDXL's and SD 1.x's set skip_prk_steps: PLMS, A1111's "PLMS"; N + 1
    # model calls for N steps, the first step taken twice).
    "pndm": (PNDMScheduler, {}),
    "dpmpp_2m": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "dpmpp_2m_sde": (DPMSolverMultistepScheduler, {"algorithm_type": "sde-dpmsolver++", "solver_order": 2}),
    # The Karras-sigma variants under the names A1111 and ComfyUI users know ("DPM++ 2M Karras"): diffusers'
    # use_karras_sigmas=True on the same class, as its docs map them. The name is the
    # whole sigma choice: a folder's other respacing (exponential, beta) is turned off, where diffusers'
    # from_config(..., use_karras_sigmas=True) raises on the pair (an audit, 2026-11-29: every call of a listed
    # scheduler failed on such a folder); Lu's lambdas yield to Karras sigmas in DPM-Solver's own order.
    "euler_karras": (EulerDiscreteScheduler, {"use_karras_sigmas": True, **_OTHER_SIGMAS_OFF}),
    "dpmpp_2m_karras": (
        DPMSolverMultistepScheduler,
        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True, **_OTHER_SIGMAS_OFF},
    ),
    "dpmpp_2m_sde_karras": (
        DPMSolverMultistepScheduler,
        {
            "algorithm_type": "sde-dpmsolver++",
            "solver_order": 2,
            "use_karras_sigmas": True,
            **_OTHER_SIGMAS_OFF,
        },
    ),
    # DPM-Solver++(2S) (the paper's name for its second-order singlestep solver): diffusers'
    # DPMSolverSinglestepScheduler, order 2. Not A1111's "DPM++ 2S a", which adds ancestral noise.
    "dpmpp_2s": (DPMSolverSinglestepScheduler, {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    # DEIS (ComfyUI's "deis"): DPM-Solver's multistep loop over noise predictions, order 2 as diffusers' default.
    "deis": (DEISMultistepScheduler, {}),
    # diffusers' k-diffusion ports under A1111's names; "heun" and "dpm2" call the model twice a step but the last.
    "heun": (HeunDiscreteScheduler, {}),
    "dpm2": (KDPM2DiscreteScheduler, {}),
    "dpm2_karras": (KDPM2DiscreteScheduler, {"use_karras_sigmas": True, **_OTHER_SIGMAS_OFF}),
    "dpm2_ancestral": (KDPM2AncestralDiscreteScheduler, {}),
    "dpm2_ancestral_karras": (
        KDPM2AncestralDiscreteScheduler,
        {"use_karras_sigmas": True, **_OTHER_SIGMAS_OFF},
    ),
    "lms": (LMSDiscreteScheduler, {}),
    "lms_karras": (LMSDiscreteScheduler, {"use_karras_sigmas": True, **_OTHER_SIGMAS_OFF}),
    # DPM++ SDE: two calls a step as Heun, with Brownian noise from each row's seed (dpm_solver_sde.py).
    "dpmpp_sde": (DPMSolverSDEScheduler, {}),
    "dpmpp_sde_karras": (DPMSolverSDEScheduler, {"use_karras_sigmas": True, **_OTHER_SIGMAS_OFF}),
    # LCM-distilled UNets' and LCM-LoRA's sampler (diffusers' LCMScheduler.from_config(the model's config)).
    "lcm": (LCMScheduler, {}),
    # TCD-distilled adapters' sampler (TCD-SDXL-LoRA, Hyper-SD); its gamma is the request's eta.
    "tcd": (TCDScheduler, {}),
    "flow_match_euler": (FlowMatchEulerDiscreteScheduler, {}),
    # Wan 2.1's scheduler, in its flow-matching form on a flow model's config; on a beta-schedule model's
    # config (SDXL), its VP form.
    "unipc": (UniPCMultistepScheduler, {}),
}
# Flow-matching models (Flux, Wan) predict a velocity, the others noise: the two are never interchangeable, so
# SCHEDULER_NAMES (what SDXL-type families offer) leaves flow-matching Euler out; Wan offers these. UniPC,
# DPM-Solver++ and DEIS have both forms (Wan 2.1's own sample solvers are "unipc" and "dpm++": DPM-Solver++ 2M
# on flow sigmas), so both lists have them; on a flow config they take flow sigmas and velocity predictions.
FLOW_SCHEDULER_NAMES: tuple[str, ...] = ("flow_match_euler", "unipc", "dpmpp_2m", "dpmpp_2s", "deis")
SCHEDULER_NAMES: tuple[str, ...] = tuple(n for n in _BY_NAME if n != "flow_match_euler")
# diffusers class names are accepted too; they take every setting from the config.
_BY_CLASS: dict[str, type[NoiseScheduler]] = {
    cls.__name__: cls
    for cls in (
        EulerDiscreteScheduler,
        EulerAncestralDiscreteScheduler,
        DDIMScheduler,
        DDPMScheduler,
        PNDMScheduler,
        DPMSolverMultistepScheduler,
        DPMSolverSinglestepScheduler,
        DEISMultistepScheduler,
        FlowMatchEulerDiscreteScheduler,
        UniPCMultistepScheduler,
        LCMScheduler,
        TCDScheduler,
        HeunDiscreteScheduler,
        KDPM2DiscreteScheduler,
        KDPM2AncestralDiscreteScheduler,
        LMSDiscreteScheduler,
        DPMSolverSDEScheduler,
        # EDM-trained folders' own (Playground v2.5): by class only, since no beta-schedule model runs on them.
        EDMDPMSolverMultistepScheduler,
        EDMEulerScheduler,
    )
}


def is_flow_config(config: Mapping[str, Any]) -> bool:
    """Whether a folder's scheduler config is a flow-matching model's (Flux's flow-matching Euler, Wan's
    flow UniPC) rather than a beta-schedule one (SDXL's)."""
    return (
        config.get("_class_name") == "FlowMatchEulerDiscreteScheduler"
        or bool(config.get("use_flow_sigmas"))
        or config.get("prediction_type") == "flow_prediction"
    )


def make_scheduler(name: str | None, config: Mapping[str, Any], **overrides) -> NoiseScheduler:
    """The scheduler `name` (one of SCHEDULER_NAMES or a diffusers class name; None: the config's own
    `_class_name`) built from a diffusers scheduler config, as diffusers' `Class.from_config(config)` would.

    overrides: settings over the config, e.g. use_karras_sigmas=True, or eta=0.5 for DDIM.
    Raises ValueError for an unknown name or a setting this port does not implement.
    """
    key = config.get("_class_name") if name is None else name
    if key in _BY_NAME:
        cls, implied = _BY_NAME[key]
        if key in FLOW_SCHEDULER_NAMES and key != "flow_match_euler" and is_flow_config(config):
            implied = {**implied, **_FLOW_FORM}
    elif key in _BY_CLASS:
        cls, implied = _BY_CLASS[key], {}
    else:
        what = (
            f"the folder's scheduler {key!r} is not implemented"
            if name is None
            else f"unknown scheduler {key!r}"
        )
        raise ValueError(f"{what}; expected one of {list(_BY_NAME)} or {sorted(_BY_CLASS)}")
    return cls.from_config(config, **{**implied, **overrides})


__all__ = [
    "SCHEDULER_NAMES",
    "FLOW_SCHEDULER_NAMES",
    "make_scheduler",
    "pad_schedule",
    "NoiseScheduler",
    "SigmaSchedule",
    "DDIMSchedule",
    "DDPMSchedule",
    "LCMSchedule",
    "TCDSchedule",
    "KDPM2Schedule",
    "KDPM2AncestralSchedule",
    "LMSSchedule",
    "PNDMSchedule",
    "SinglestepSchedule",
    "EulerDiscreteScheduler",
    "EulerAncestralDiscreteScheduler",
    "DDIMScheduler",
    "DDPMScheduler",
    "DEISMultistepScheduler",
    "PNDMScheduler",
    "DPMSolverMultistepScheduler",
    "DPMSolverSinglestepScheduler",
    "FlowMatchEulerDiscreteScheduler",
    "UniPCMultistepScheduler",
    "LCMScheduler",
    "TCDScheduler",
    "HeunDiscreteScheduler",
    "KDPM2DiscreteScheduler",
    "KDPM2AncestralDiscreteScheduler",
    "LMSDiscreteScheduler",
    "DPMSolverSDEScheduler",
    "EDMDPMSolverMultistepScheduler",
    "EDMEulerScheduler",
    "flux_mu",
]

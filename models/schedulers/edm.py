"""EDM's parameterisation (Karras et al. 2022, https://huggingface.co/papers/2206.00364), shared by diffusers'
EDMEulerScheduler and EDMDPMSolverMultistepScheduler: the schedulers of EDM-trained SDXL-architecture models
such as Playground v2.5.

The sample lives at noise level sigma; the UNet sees c_in x sample, c_in = 1 / sqrt(sigma^2 + sigma_data^2), at
timestep c_noise = log(sigma) / 4, and its output becomes x0 = c_skip x sample + c_out x output. The sigmas are
EDM's own (Karras' rho ramp, or exponential, between sigma_min and sigma_max), not a beta schedule's.
"""

from __future__ import annotations

import math

import numpy as np

from meshserve.models.schedulers.common import check_choice


def check_edm_settings(scheduler) -> None:
    """ValueError unless the EDM settings are usable (diffusers fails later, in a TypeError or NaNs)."""
    check_choice("sigma_schedule", scheduler.sigma_schedule, ("karras", "exponential"))
    check_choice("prediction_type", scheduler.prediction_type, ("epsilon", "v_prediction"))
    for name in ("sigma_min", "sigma_max", "sigma_data", "rho"):
        value = getattr(scheduler, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{type(scheduler).__name__}: {name} must be a positive number, got {value!r}")
    if scheduler.sigma_min >= scheduler.sigma_max:
        raise ValueError(f"sigma_min ({scheduler.sigma_min}) must be below sigma_max ({scheduler.sigma_max})")


def edm_sigmas(scheduler, n: int, dtype) -> np.ndarray:
    """[n] descending sigmas from sigma_max to sigma_min, computed in `dtype` as diffusers' class does (its
    DPM-Solver on a float32 ramp, its Euler on a float64 one), float32 out."""
    if n < 1:
        raise ValueError(f"num_inference_steps must be at least 1, got {n}")
    ramp = np.linspace(0, 1, n, dtype=dtype)
    if scheduler.sigma_schedule == "karras":
        rho = scheduler.rho
        min_inv_rho, max_inv_rho = scheduler.sigma_min ** (1 / rho), scheduler.sigma_max ** (1 / rho)
        sigmas = (dtype(max_inv_rho) + ramp * dtype(min_inv_rho - max_inv_rho)) ** dtype(rho)
    else:
        logs = np.linspace(math.log(scheduler.sigma_min), math.log(scheduler.sigma_max), n, dtype=np.float32)
        sigmas = np.exp(logs)[::-1]
    return np.asarray(sigmas, np.float32)


def c_noise(sigmas: np.ndarray) -> np.ndarray:
    """The UNet's timesteps: log(sigma) / 4, float32."""
    return np.asarray(0.25 * np.log(np.asarray(sigmas, np.float32)), np.float32)


def precondition_inputs(sample, sigma, sigma_data: float):
    """c_in x sample, c_in = 1 / sqrt(sigma^2 + sigma_data^2)."""
    return sample / (sigma**2 + sigma_data**2) ** 0.5


def precondition_outputs(prediction_type: str, sigma_data: float, sigma, sample, model_output):
    """x0 = c_skip x sample + c_out x model_output (c_out negated for v_prediction)."""
    c_skip = sigma_data**2 / (sigma**2 + sigma_data**2)
    c_out = sigma * sigma_data / (sigma**2 + sigma_data**2) ** 0.5
    if prediction_type == "v_prediction":
        c_out = -c_out
    return c_skip * sample + c_out * model_output

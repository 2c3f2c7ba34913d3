"""What diffusers' k-diffusion ports (Heun, DPM2, DPM2 ancestral, LMS, DPM++ SDE) share: their inference
sigmas, made one way in those classes' `set_timesteps`, their settings, and DPM2's per-call array layout.

The timesteps are spaced as Euler's, but cast to float32 before the sigmas are interpolated at them (their
`np.linspace(..., dtype=np.float32)`; Euler interpolates at the float64 ones); with a Karras / exponential / beta
setting the sigmas are then respaced between the inference sigmas' own ends (these classes have no sigma_min /
sigma_max settings), the timesteps following by interpolation in log sigma.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from meshserve.models.schedulers.common import RespacedSigmas, respacing, sigma_to_t, spaced_timesteps
from meshserve.models.schedulers.euler import training_sigmas


@dataclass(frozen=True)
class KDiffusionScheduler(RespacedSigmas):
    """Settings the classes share (defaults equal diffusers'): the respacing ones (RespacedSigmas), between the
    inference sigmas' own ends."""

    IGNORED = ("rescale_betas_zero_snr",)
    # Whether the class takes prediction_type "sample" (DPM2, DPM2 a and DPM++ SDE refuse it, as diffusers' steps).
    takes_sample_prediction: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        self.check_one_spacing()
        if self.prediction_type == "sample" and not self.takes_sample_prediction:
            raise ValueError(f"{type(self).__name__}: prediction_type='sample' is not supported")

    def inference_sigmas(self, n: int, *, round_karras: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(timesteps [n], sigmas [n]) before the caller's cast (float32 spaced timesteps, or float64 ones of
        respaced sigmas); `round_karras`: DPM2 rounds the timesteps of Karras sigmas, the others do not."""
        self.check_steps(n)
        timesteps = spaced_timesteps(
            self.timestep_spacing, self.num_train_timesteps, n, self.steps_offset, round_linspace=False
        ).astype(np.float32)
        train_sigmas = training_sigmas(self)
        sigmas = np.interp(timesteps, np.arange(len(train_sigmas)), train_sigmas)
        convert = respacing(self)
        if convert is None:
            return timesteps.astype(np.float64), sigmas
        sigmas = convert(sigmas[-1], sigmas[0], n)
        timesteps = sigma_to_t(sigmas, np.log(train_sigmas))
        if self.use_karras_sigmas and round_karras:
            timesteps = timesteps.round()
        return timesteps, sigmas

    def scheduler_arguments(self) -> dict:
        # No custom schedules: diffusers' DPM2 and LMS take none; Heun's custom timesteps are not offered here.
        return {}


def doubled(values: np.ndarray) -> np.ndarray:
    """diffusers' per-call layout of DPM2's arrays (plain and ancestral): the first value, every later one twice
    (a step's two calls), the last once more: [a0, a1, a1, ..., aN, aN, aN]."""
    return np.concatenate([values[:1], np.repeat(values[1:], 2), values[-1:]])


def heun_layout(timesteps: np.ndarray, sigmas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """diffusers' per-call arrays of Heun and DPM++ SDE from N timesteps and N sigmas: timesteps [2N - 1] (every
    one but the first twice: a step's two calls), sigmas [2N] (likewise, then 0), float32."""
    timesteps, sigmas = np.asarray(timesteps, np.float32), np.concatenate([sigmas, [0.0]]).astype(np.float32)
    return (
        np.concatenate([timesteps[:1], np.repeat(timesteps[1:], 2)]),
        np.concatenate([sigmas[:1], np.repeat(sigmas[1:-1], 2), sigmas[-1:]]),
    )

"""What diffusers' k-diffusion ports (Heun, DPM2, LMS) share: their inference sigmas, made one way in the three
classes' `set_timesteps`, and their settings.

The timesteps are spaced in float32 (`np.linspace(..., dtype=np.float32)`, where Euler spaces them in float64),
the sigmas interpolated from the training ones at them, then, with a Karras / exponential / beta setting, respaced
between the inference sigmas' own ends (these classes have no sigma_min / sigma_max settings), the timesteps
following by interpolation in log sigma.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshserve.models.schedulers.common import (
    NoiseScheduler,
    beta_sigmas,
    exponential_sigmas,
    karras_sigmas,
    sigma_to_t,
    trailing_timesteps,
)
from meshserve.models.schedulers.euler import training_sigmas


@dataclass(frozen=True)
class KDiffusionScheduler(NoiseScheduler):
    """Settings the three classes share (defaults equal diffusers'): at most one of use_karras_sigmas,
    use_exponential_sigmas, use_beta_sigmas respaces the sigmas."""

    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False

    @classmethod
    def from_config(cls, config, **overrides):
        # The three diffusers classes have no rescale_betas_zero_snr setting: their from_config ignores the key (a
        # zero-terminal-SNR folder's config samples with its plain betas there), and so does this port.
        config = {k: v for k, v in config.items() if k != "rescale_betas_zero_snr"}
        return super().from_config(config, **overrides)

    def __post_init__(self):
        super().__post_init__()
        if self.use_karras_sigmas + self.use_exponential_sigmas + self.use_beta_sigmas > 1:
            raise ValueError(
                "only one of use_karras_sigmas, use_exponential_sigmas, use_beta_sigmas can be set"
            )

    def inference_sigmas(self, n: int, *, round_karras: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(timesteps [n], sigmas [n]) in float64 before the caller's cast; `round_karras`: DPM2 rounds the
        timesteps of Karras sigmas, Heun and LMS do not."""
        self.check_steps(n)
        num_train = self.num_train_timesteps
        if self.timestep_spacing == "linspace":
            timesteps = np.linspace(0, num_train - 1, n, dtype=np.float32)[::-1]
        elif self.timestep_spacing == "leading":
            timesteps = (np.arange(0, n) * (num_train // n)).round()[::-1].astype(np.float32)
            timesteps += self.steps_offset
        else:
            timesteps = trailing_timesteps(num_train, num_train, n).astype(np.float32)
        train_sigmas = training_sigmas(self)
        sigmas = np.interp(timesteps, np.arange(len(train_sigmas)), train_sigmas)
        convert = (
            karras_sigmas if self.use_karras_sigmas
            else exponential_sigmas if self.use_exponential_sigmas
            else beta_sigmas if self.use_beta_sigmas
            else None
        )  # fmt: skip
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

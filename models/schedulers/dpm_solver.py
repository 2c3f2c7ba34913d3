"""DPM-Solver++ multistep (Lu et al. 2022, https://huggingface.co/papers/2211.01095) = diffusers'
DPMSolverMultistepScheduler with algorithm_type "dpmsolver++" ("DPM++ 2M" at solver_order 2) or
"sde-dpmsolver++" ("DPM++ 2M SDE"), on a beta schedule's sigmas (SDXL) or on flow matching's (Wan 2.1's "dpm++"
solver: `use_flow_sigmas`, `prediction_type="flow_prediction"`, `flow_shift`; alpha = 1 - sigma).

It integrates the data-prediction ODE in lambda = log(alpha / sigma): each step converts the model output to
x0, then extrapolates with the last `solver_order` x0 predictions (a linear multistep method). The history and
the count of steps taken so far (the first steps, and with lower_order_final the last ones, use lower orders)
are the state carried through the loop. Which order a step uses depends on traced values (step index, count),
so the three updates are branches of a `lax.switch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from meshserve.models.schedulers.common import (
    TIMESTEP_SPACINGS,
    RespacedSigmasInRange,
    SigmaSchedule,
    check_choice,
    f32,
    multistep_timesteps,
    respaced_sigmas,
    schedule_length,
    sigma_to_t,
    step_noise,
    threshold_sample,
    vp_alpha_sigma,
    vp_data_prediction,
)
from meshserve.models.schedulers.euler import capped_alphas_cumprod, training_sigmas


@dataclass(frozen=True)
class DPMSolverMultistepScheduler(RespacedSigmasInRange):
    """Settings: diffusers' DPMSolverMultistepScheduler config (defaults equal). Supported: solver_order 1-3,
    algorithm_type dpmsolver++ / sde-dpmsolver++, solver_type midpoint / heun, lower_order_final,
    euler_at_final, karras / exponential / beta / lu-lambda sigmas, final_sigmas_type, lambda_min_clipped,
    thresholding, flow sigmas (shifted by flow_shift; not respaced). sigma_min / sigma_max are read when the
    config has them (diffusers honours them when a config of another class, e.g. Euler's, carries them)."""

    solver_order: int = 2
    thresholding: bool = False
    dynamic_thresholding_ratio: float = 0.995
    sample_max_value: float = 1.0
    algorithm_type: str = "dpmsolver++"
    solver_type: str = "midpoint"
    lower_order_final: bool = True
    euler_at_final: bool = False
    use_lu_lambdas: bool = False
    final_sigmas_type: str = "zero"
    lambda_min_clipped: float = -float("inf")
    use_flow_sigmas: bool = False
    flow_shift: float = 1.0

    # The noise-prediction variants ("dpmsolver", "sde-dpmsolver") are deprecated in diffusers; learned variance
    # belongs to DeepFloyd-style UNets; a dynamic shift (a mu per call) to no pipeline that offers this solver.
    UNSUPPORTED = {"variance_type": None, "use_dynamic_shifting": False}
    ALGORITHM_TYPES: ClassVar[tuple[str, ...]] = ("dpmsolver++", "sde-dpmsolver++")
    SOLVER_TYPES: ClassVar[tuple[str, ...]] = ("midpoint", "heun")
    # As diffusers' __init__: a DEIS or UniPC folder's config asked for as DPM-Solver ("dpmpp_2m").
    # A variance_type other than the learned ones changes nothing in diffusers' step (a DDPM folder's
    # "fixed_small"), so it reads as None.
    CONFIG_ALIASES = {
        "algorithm_type": {"deis": "dpmsolver++"},
        "solver_type": {"logrho": "midpoint", "bh1": "midpoint", "bh2": "midpoint"},
        "variance_type": {
            v: None for v in ("fixed_small", "fixed_small_log", "fixed_large", "fixed_large_log")
        },
    }

    def __post_init__(self):
        if self.use_flow_sigmas != (self.prediction_type == "flow_prediction"):
            raise ValueError(
                f"{type(self).__name__}: flow sigmas go with prediction_type 'flow_prediction' and the "
                "beta-schedule sigmas with 'epsilon', 'v_prediction' or 'sample'; got use_flow_sigmas="
                f"{self.use_flow_sigmas!r}, prediction_type={self.prediction_type!r}"
            )
        if self.use_flow_sigmas:
            # Not NoiseScheduler's checks: "flow_prediction" is no prediction type of the beta-schedule family.
            check_choice("timestep_spacing", self.timestep_spacing, TIMESTEP_SPACINGS)
            if self.respaced or self.use_lu_lambdas:
                raise ValueError(
                    f"{type(self).__name__}: respaced sigmas with flow sigmas are not implemented"
                )
        else:
            super().__post_init__()
        check_choice("algorithm_type", self.algorithm_type, self.ALGORITHM_TYPES)
        check_choice("solver_type", self.solver_type, self.SOLVER_TYPES)
        check_choice("solver_order", self.solver_order, (1, 2, 3))
        check_choice("final_sigmas_type", self.final_sigmas_type, ("zero", "sigma_min"))
        self.check_one_spacing()

    @property
    def stochastic(self) -> bool:
        return self.algorithm_type == "sde-dpmsolver++"

    # ---------------------------------------------------------------------------------------------
    # Host: the schedule

    def scheduler_arguments(self) -> dict:
        # diffusers takes custom timesteps (not sigmas), but not with respaced sigmas or lu lambdas.
        # (diffusers' flow sigmas ignore custom timesteps: refused rather than ignored)
        return self.argument_rules(
            sigmas=False,
            timesteps=not (self.respaced or self.use_lu_lambdas or self.use_flow_sigmas),
            sigmas_end=False,
        )

    def schedule(self, num_inference_steps: int, *, timesteps=None) -> SigmaSchedule:
        """Note: "trailing" with lambda_min_clipped can give fewer than num_inference_steps steps, as in
        diffusers; the pipeline loops over schedule.timesteps.shape[0]. `timesteps`: diffusers' custom ones
        (N integers) in place of the spaced ones."""
        n = int(num_inference_steps)
        self.check_steps(n)
        if timesteps is not None:
            if not self.scheduler_arguments()["timesteps"]:
                raise ValueError("custom timesteps are not supported with respaced, lu-lambda or flow sigmas")
            if len(timesteps) != n:
                raise ValueError(f"{n} steps take {n} timesteps, got {len(timesteps)}")
        train_sigmas = training_sigmas(self)
        log_sigmas = np.log(train_sigmas)
        # lambda_min_clipped drops the noisiest training timesteps (cosine schedules' lambda blows up there).
        alphas_cumprod = capped_alphas_cumprod(self)
        lambdas = np.log(np.sqrt(alphas_cumprod)) - np.log(np.sqrt(1 - alphas_cumprod))
        clipped_idx = np.searchsorted(lambdas[::-1], self.lambda_min_clipped)
        last_timestep = self.num_train_timesteps - int(clipped_idx)

        if timesteps is not None:
            timesteps = np.asarray(timesteps).astype(np.int64)
        else:
            timesteps = multistep_timesteps(
                self.timestep_spacing, last_timestep, self.num_train_timesteps, n, self.steps_offset
            )

        # diffusers' order: Karras sigmas, then lu lambdas, then exponential or beta sigmas (its __init__
        # refuses two of the three respacings together, but not lu lambdas beside one).
        lu_lambdas = self.use_lu_lambdas and not self.use_karras_sigmas
        if self.respaced and not lu_lambdas:
            sigmas, timesteps = respaced_sigmas(self, train_sigmas, n, round_karras=self._rounds_karras())
        elif lu_lambdas:
            # Uniform in log sigma between its training ends (diffusers' _convert_to_lu with rho = 1).
            sigmas = np.exp(np.linspace(float(log_sigmas[-1]), float(log_sigmas[0]), n))
            timesteps = sigma_to_t(sigmas, log_sigmas)
            if self.beta_schedule != "squaredcos_cap_v2":
                timesteps = timesteps.round()
        elif self.use_flow_sigmas:
            sigmas = self._flow_sigmas(n)
            timesteps = sigmas * self.num_train_timesteps
        else:
            sigmas = np.interp(timesteps, np.arange(len(train_sigmas)), train_sigmas)

        # (diffusers' sigma_min is the beta schedule's smallest sigma, with flow sigmas too)
        sigma_last = train_sigmas[0] if self.final_sigmas_type == "sigma_min" else 0.0
        sigmas = np.concatenate([sigmas, [sigma_last]])
        # diffusers stores int64 timesteps: fractional ones (exponential / beta sigmas) are truncated.
        timesteps = np.asarray(timesteps).astype(np.int64)
        return SigmaSchedule(timesteps=f32(timesteps), sigmas=f32(sigmas), init_noise_sigma=f32(1.0))

    def _flow_sigmas(self, n: int) -> np.ndarray:
        """[n] float64 flow sigmas: n + 1 points from 1 to 1/T, shifted by flow_shift, the last (0) dropped:
        all below 1, so lambda is finite."""
        unshifted = 1.0 - np.linspace(1, 1 / self.num_train_timesteps, n + 1)
        return np.flip(self.flow_shift * unshifted / (1 + (self.flow_shift - 1) * unshifted))[:-1]

    def _rounds_karras(self) -> bool:
        """Whether Karras sigmas' timesteps are rounded to integers (diffusers' multistep set_timesteps: not
        on the cosine schedule)."""
        return self.beta_schedule != "squaredcos_cap_v2"

    # ---------------------------------------------------------------------------------------------
    # Traced: the step

    def init_state(self, sample):
        """model_outputs: the last solver_order converted model outputs (x0 predictions), oldest first,
        float32 [order, *sample.shape];
        lower_order_nums: how many steps have run (capped at solver_order), which bounds the usable order."""
        return {
            "model_outputs": jnp.zeros((self.solver_order, *sample.shape), jnp.float32),
            "lower_order_nums": jnp.zeros((), jnp.int32),
        }

    def step(self, schedule: SigmaSchedule, state, model_output, sample, i, key=None, *, noise=None):
        """One multistep update from sigmas[i] to sigmas[i + 1]; returns (prev_sample in sample's dtype, state).
        For sde-dpmsolver++ the noise is `noise` when given, else jax.random.normal(key, sample.shape)."""
        # Traced for a padded schedule (one program for every step count), a Python int otherwise.
        num_steps = schedule_length(schedule)
        sigmas = jnp.asarray(schedule.sigmas)
        x = sample.astype(jnp.float32)
        converted = self._convert_model_output(sigmas[i], model_output, x)
        history = jnp.concatenate([state["model_outputs"][1:], converted[None]])
        lower_order_nums = state["lower_order_nums"]

        # The order of this step, as diffusers decides it: i (the position in the schedule) lowers the last
        # steps, lower_order_nums (steps this loop has taken) the first ones, also when a loop starts
        # mid-schedule (img2img).
        # jnp logic throughout: num_steps may be traced, so no Python `and`/`or` on it.
        small = jnp.asarray(num_steps) < 15
        is_last, is_second_last = i == num_steps - 1, i == num_steps - 2
        lower_final_if_small = jnp.logical_and(self.lower_order_final, small)
        lower_order_final = is_last & (
            jnp.logical_or(self.euler_at_final or self.final_sigmas_type == "zero", lower_final_if_small)
        )
        lower_order_second = is_second_last & lower_final_if_small
        first = (self.solver_order == 1) | (lower_order_nums < 1) | lower_order_final
        second = (self.solver_order == 2) | (lower_order_nums < 2) | lower_order_second
        order = jnp.where(first, 1, jnp.where(second, 2, 3))

        noise = step_noise(key, noise, x) if self.stochastic else jnp.zeros_like(x)
        updates = (self._first_order, self._second_order, self._third_order)[: self.solver_order]
        branch = jnp.minimum(order, self.solver_order) - 1
        prev_sample = jax.lax.switch(branch, updates, sigmas, i, history, x, noise)
        state = {
            "model_outputs": history,
            "lower_order_nums": jnp.minimum(lower_order_nums + 1, self.solver_order),
        }
        return prev_sample.astype(sample.dtype), state

    def _convert_model_output(self, sigma, model_output, sample):
        """diffusers' convert_model_output: what the history keeps of a model output (DPM-Solver++: x0), in
        float32 from the model's output in its own dtype and the float32 sample."""
        return self._data_prediction(sigma, model_output, sample)

    def _data_prediction(self, sigma, model_output, sample):
        """x0 from the model output at noise level sigma, thresholded where the config says. On flow sigmas a
        bf16 velocity enters as diffusers' 0-d float32 sigma times a bf16 tensor does: sigma rounded to bf16,
        the product in bf16, then subtracted from the float32 sample (as UniPC's port)."""
        if self.use_flow_sigmas:
            x0 = sample - (sigma.astype(model_output.dtype) * model_output).astype(jnp.float32)
        else:
            x0 = vp_data_prediction(self.prediction_type, sigma, model_output.astype(jnp.float32), sample)
        if self.thresholding:
            x0 = threshold_sample(x0, self.dynamic_thresholding_ratio, self.sample_max_value)
        return x0

    def _alpha_sigma(self, sigma):
        """(alpha_t, sigma_t) of the noise level sigma: the variance-preserving pair, or flow matching's."""
        return (1 - sigma, sigma) if self.use_flow_sigmas else vp_alpha_sigma(sigma)

    def _lambdas(self, sigmas, i, k: int):
        """(alpha, sigma, lambda) at sigmas[i + 1] (the target t) and at sigmas[i], sigmas[i-1], ...
        (s0, s1, ..., k of them). Indices below 0 are clamped: such branches are never taken there."""
        out = []
        for idx in [i + 1] + [jnp.maximum(i - j, 0) for j in range(k)]:
            alpha, sigma = self._alpha_sigma(sigmas[idx])
            out.append((alpha, sigma, jnp.log(alpha) - jnp.log(sigma)))
        return out

    def _first_order(self, sigmas, i, history, sample, noise):
        (alpha_t, sigma_t, lambda_t), (_, sigma_s, lambda_s) = self._lambdas(sigmas, i, 1)
        h = lambda_t - lambda_s
        x0 = history[-1]
        if self.algorithm_type == "dpmsolver++":
            return (sigma_t / sigma_s) * sample - (alpha_t * (jnp.exp(-h) - 1.0)) * x0
        return (
            (sigma_t / sigma_s * jnp.exp(-h)) * sample
            + (alpha_t * (1 - jnp.exp(-2.0 * h))) * x0
            + sigma_t * jnp.sqrt(1.0 - jnp.exp(-2 * h)) * noise
        )

    def _second_order(self, sigmas, i, history, sample, noise):
        (alpha_t, sigma_t, lambda_t), (_, sigma_s0, lambda_s0), (_, _, lambda_s1) = self._lambdas(
            sigmas, i, 2
        )
        m0, m1 = history[-1], history[-2]
        h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
        r0 = h_0 / h
        return self._second_order_update(
            alpha_t, sigma_t, sigma_s0, h, sample, m0, (1.0 / r0) * (m0 - m1), noise
        )

    def _second_order_update(self, alpha_t, sigma_t, sigma_s, h, sample, d0, d1, noise):
        """x_t from `sample` at sigma_s over the step h in lambda with the second-order terms D0, D1 (the
        multistep and singlestep solvers share it; they differ in where the step starts and in D0, D1)."""
        if self.algorithm_type == "dpmsolver++":
            if self.solver_type == "midpoint":
                return (
                    (sigma_t / sigma_s) * sample
                    - (alpha_t * (jnp.exp(-h) - 1.0)) * d0
                    - 0.5 * (alpha_t * (jnp.exp(-h) - 1.0)) * d1
                )
            return (
                (sigma_t / sigma_s) * sample
                - (alpha_t * (jnp.exp(-h) - 1.0)) * d0
                + (alpha_t * ((jnp.exp(-h) - 1.0) / h + 1.0)) * d1
            )
        if self.solver_type == "midpoint":
            d1_term = 0.5 * (alpha_t * (1 - jnp.exp(-2.0 * h))) * d1
        else:
            d1_term = (alpha_t * ((1.0 - jnp.exp(-2.0 * h)) / (-2.0 * h) + 1.0)) * d1
        return (
            (sigma_t / sigma_s * jnp.exp(-h)) * sample
            + (alpha_t * (1 - jnp.exp(-2.0 * h))) * d0
            + d1_term
            + sigma_t * jnp.sqrt(1.0 - jnp.exp(-2 * h)) * noise
        )

    def _third_order(self, sigmas, i, history, sample, noise):
        lams = self._lambdas(sigmas, i, 3)
        (alpha_t, sigma_t, lambda_t), (_, sigma_s0, lambda_s0) = lams[0], lams[1]
        lambda_s1, lambda_s2 = lams[2][2], lams[3][2]
        m0, m1, m2 = history[-1], history[-2], history[-3]
        h, h_0, h_1 = lambda_t - lambda_s0, lambda_s0 - lambda_s1, lambda_s1 - lambda_s2
        r0, r1 = h_0 / h, h_1 / h
        d1_0, d1_1 = (1.0 / r0) * (m0 - m1), (1.0 / r1) * (m1 - m2)
        d1 = d1_0 + (r0 / (r0 + r1)) * (d1_0 - d1_1)
        d2 = (1.0 / (r0 + r1)) * (d1_0 - d1_1)
        return self._third_order_update(alpha_t, sigma_t, sigma_s0, h, sample, m0, d1, d2, noise)

    def _third_order_update(self, alpha_t, sigma_t, sigma_s, h, sample, d0, d1, d2, noise):
        """x_t from `sample` at sigma_s over the step h with the third-order terms D0, D1, D2 (also the
        singlestep solver's with solver_type "heun")."""
        if self.algorithm_type == "dpmsolver++":
            return (
                (sigma_t / sigma_s) * sample
                - (alpha_t * (jnp.exp(-h) - 1.0)) * d0
                + (alpha_t * ((jnp.exp(-h) - 1.0) / h + 1.0)) * d1
                - (alpha_t * ((jnp.exp(-h) - 1.0 + h) / h**2 - 0.5)) * d2
            )
        return (
            (sigma_t / sigma_s * jnp.exp(-h)) * sample
            + (alpha_t * (1.0 - jnp.exp(-2.0 * h))) * d0
            + (alpha_t * ((1.0 - jnp.exp(-2.0 * h)) / (-2.0 * h) + 1.0)) * d1
            + (alpha_t * ((1.0 - jnp.exp(-2.0 * h) - 2.0 * h) / (2.0 * h) ** 2 - 0.5)) * d2
            + sigma_t * jnp.sqrt(1.0 - jnp.exp(-2 * h)) * noise
        )

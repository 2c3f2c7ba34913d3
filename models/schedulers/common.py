"""What the schedulers share: the training noise schedule, inference timestep spacing, sigma conversions,
config reading, and the pytree plumbing that lets a schedule enter a compiled program as traced arrays.

Split of work. Everything that depends only on (config, num_inference_steps) is computed on the host in numpy
when a schedule is made, and handed over as float32 arrays: timesteps, sigmas, alphas. The per-step update
(`step`, `scale_model_input`) is pure jnp on float32 with the step index `i` traced, so one compiled denoise loop
serves every request of a shape whatever its steps' values are. The formulas mirror diffusers (0.42) line by
line, so a reader can check one against the other.

Precision follows diffusers, not float64 throughout: the training tables (betas, alpha_bar, the training
sigmas and their logs) are float32 as diffusers' torch tensors are, and the inference arrays derived from them
are float64 numpy until the final cast, as in diffusers. This is deliberate: some timesteps are rounded or
truncated to integers (DPM-Solver's Karras / exponential sigmas), and with float64 tables the first
exponential-sigma timestep came out 999 where diffusers says 998, and the cosine schedule's sigma at t=0
moved by 2.6e-4 relative. With float32 tables the schedules agree with diffusers to ~1e-6.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
TIMESTEP_SPACINGS = ("linspace", "leading", "trailing")
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")


def schedule_length(schedule):
    """The steps a schedule runs: a Python int for an exact schedule, a traced [] int32 for a padded one."""
    return schedule.timesteps.shape[0] if schedule.steps is None else schedule.steps


def schedule_dataclass(cls):
    """A schedule: a frozen dataclass whose fields are all pytree leaves (arrays), so it can be a traced jit
    argument, with `num_steps` (`schedule_length`); its `steps` field is None until `pad_schedule` sets it."""
    cls = dataclass(frozen=True)(cls)
    cls.num_steps = property(schedule_length)
    names = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])


@schedule_dataclass
class SigmaSchedule:
    """The schedule of the sigma-parameterised schedulers (Euler, Euler ancestral, DPM-Solver, UniPC, Heun).

    timesteps: [N] float32, what the UNet receives at step i (diffusers' `scheduler.timesteps`).
    sigmas: [N + 1] float32 (N + 2 for Euler's "log_linear" interpolation, as diffusers), sigmas[i] is the noise
        level of the sample entering step i, sigmas[i + 1] the level it leaves with. (Heun: timesteps [2N - 1]
        and sigmas [2N], one entry per model call as diffusers' arrays: heun.py.)
    init_noise_sigma: [] float32, the scale of the initial Gaussian latents.
    steps: None, or [] int32 when the arrays are padded past the schedule's end (`pad_schedule`).
    """

    timesteps: Any
    sigmas: Any
    init_noise_sigma: Any
    steps: Any = None


def pad_schedule(schedule, max_steps: int):
    """The schedule with every per-step array padded to `max_steps` steps and its true length in `steps`.

    A compiled loop then takes any step count up to max_steps with one program: its trip count is the traced
    `steps`, and the arrays it indexes keep one shape. Arrays with extra entries (sigmas [N + 1]) keep them
    (padded to max_steps + 1). Padding repeats the last entry, so nothing read past the end is 0 or NaN; the
    loop never runs those steps.
    """
    n = int(schedule.timesteps.shape[0])
    if n > max_steps:
        raise ValueError(f"a schedule of {n} steps does not fit {max_steps}")
    padded = {}
    for f in dataclasses.fields(schedule):
        value = getattr(schedule, f.name)
        if f.name == "steps" or value is None or np.ndim(value) == 0:
            continue
        value = np.asarray(value)
        if value.shape[0] >= n:  # a per-step array ([N], or [N + k] with k trailing entries)
            padded[f.name] = np.pad(value, [(0, max_steps - n)] + [(0, 0)] * (value.ndim - 1), mode="edge")
    return dataclasses.replace(schedule, **padded, steps=np.int32(n))


# -------------------------------------------------------------------------------------------------
# Config reading


@dataclass(frozen=True)
class NoiseScheduler:
    """Base of the schedulers: the training noise schedule fields every diffusers scheduler here has.

    Subclasses are frozen (hashable) dataclasses, so a scheduler can be a static argument of `jax.jit`: the
    fields are Python constants of the compiled program, the schedule arrays are its traced inputs. Field
    defaults equal the defaults of the diffusers class of the same name, so a config that omits a key means
    what it means to diffusers.
    """

    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    trained_betas: tuple[float, ...] | None = None
    prediction_type: str = "epsilon"
    timestep_spacing: str = "linspace"
    steps_offset: int = 0
    rescale_betas_zero_snr: bool = False

    # Config keys of the diffusers class this port does not implement, with the only value accepted for each
    # (the diffusers default, which turns the feature off). Anything else raises instead of silently
    # sampling differently from diffusers.
    UNSUPPORTED: ClassVar[Mapping[str, Any]] = {}
    # Settings a field of this port's base (or parent port) holds but the diffusers class has not: its from_config
    # ignores them in a config (a zero-terminal-SNR folder's samples with its plain betas there), so this does.
    IGNORED: ClassVar[tuple[str, ...]] = ()
    # Values of a setting that the diffusers class's __init__ registers as another (DPM-Solver reads DEIS's
    # "logrho" and UniPC's "bh2" as "midpoint"): a folder's config of one class, asked for by another's name,
    # reads as diffusers' from_config reads it. {setting: {value: what it reads as}}.
    CONFIG_ALIASES: ClassVar[Mapping[str, Mapping[Any, Any]]] = {}
    # Whether `step` consumes random noise (needs `key` or `noise`).
    stochastic: ClassVar[bool] = False
    # diffusers' `order`: model calls a step makes (2 for Heun, DPM2, DPM2 a, DPM++ SDE: all steps but the
    # last). An image-to-image call starting at step k starts at call k x order, as diffusers' get_timesteps.
    order: ClassVar[int] = 1

    @classmethod
    def from_config(cls, config: Mapping[str, Any], **overrides):
        """Builds the scheduler from a diffusers scheduler config dict (scheduler_config.json).

        Keys are read as diffusers' `from_config` reads them: keys listed in `_use_default_values` count as
        absent, keys of other scheduler classes are ignored. `overrides` (e.g. use_karras_sigmas=True, or
        DDIM's eta) must name fields of this class.
        """
        config = dict(config)
        for key in (*(config.pop("_use_default_values", None) or ()), *cls.IGNORED):
            config.pop(key, None)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"{cls.__name__} has no setting {unknown}; settings: {sorted(fields)}")
        config.update(overrides)
        for key, aliases in cls.CONFIG_ALIASES.items():
            if key in config and isinstance(config[key], Hashable) and config[key] in aliases:
                config[key] = aliases[config[key]]
        for key, allowed in cls.UNSUPPORTED.items():
            if key in config and config[key] != allowed:
                raise ValueError(f"{cls.__name__}: {key}={config[key]!r} is not supported (only {allowed!r})")
        kwargs = {k: v for k, v in config.items() if k in fields}
        if kwargs.get("trained_betas") is not None:
            kwargs["trained_betas"] = tuple(float(b) for b in kwargs["trained_betas"])
        return cls(**kwargs)

    def __post_init__(self):
        # Fail when the scheduler is made (model load), not in the middle of a request's trace.
        check_choice("beta_schedule", self.beta_schedule, BETA_SCHEDULES)
        check_choice("timestep_spacing", self.timestep_spacing, TIMESTEP_SPACINGS)
        check_choice("prediction_type", self.prediction_type, PREDICTION_TYPES)

    def alphas_cumprod(self) -> np.ndarray:
        """[num_train_timesteps] float32 alpha_bar: the product of (1 - beta) up to each training timestep."""
        return cumprod32(np.float32(1.0) - self._betas())

    def _betas(self) -> np.ndarray:
        n = self.num_train_timesteps
        if self.trained_betas is not None:
            betas = np.asarray(self.trained_betas, np.float32)
        elif self.beta_schedule == "linear":
            betas = np.linspace(self.beta_start, self.beta_end, n).astype(np.float32)
        elif self.beta_schedule == "scaled_linear":  # the Stable Diffusion schedule
            betas = np.linspace(self.beta_start**0.5, self.beta_end**0.5, n).astype(np.float32) ** 2
        else:
            betas = betas_for_alpha_bar(n).astype(np.float32)
        return rescale_zero_terminal_snr(betas) if self.rescale_betas_zero_snr else betas

    def check_steps(self, num_inference_steps: int) -> None:
        if not 1 <= num_inference_steps <= self.num_train_timesteps:
            raise ValueError(
                f"num_inference_steps must be in [1, {self.num_train_timesteps}], got {num_inference_steps}"
            )

    def model_calls(self, num_inference_steps: int) -> int:
        """How many times a loop over the schedule calls the model for `num_inference_steps` steps (its
        timesteps' length; the second-order methods call it twice for all steps but the last)."""
        return self.order * num_inference_steps - (self.order - 1)

    def generator_draws(self, schedule, start: int, stop: int, total: int, eta: float) -> list[int]:
        """The model calls among start..stop - 1 (of `total` in the schedule; `eta`: the call's, where the
        scheduler takes one) at which diffusers' `step` draws its noise from the pipeline's generator, in order
        (a call given diffusers' `generator=` replays those draws: models/engine/torch_generator.py): every
        call of a stochastic scheduler, unless it says otherwise."""
        return list(range(start, stop)) if self.stochastic else []

    def max_steps_within(self, calls: int) -> int:
        """The most steps whose model calls fit `calls` trips of a loop (the inverse of `model_calls`)."""
        return (calls + self.order - 1) // self.order

    def scheduler_arguments(self) -> dict:
        """What `schedule` takes of diffusers' custom schedules (set_timesteps' `sigmas` / `timesteps`) and of
        its step's `eta` (DDIM), and the most steps it makes when fewer than the model's (LCM: `max_steps`), as
        a model's limits["scheduler_arguments"] publish it (meshserve/limits.py,
        `check_scheduler_arguments`): {} for none, as diffusers' Euler ancestral and UniPC."""
        return {}

    def argument_rules(self, *, sigmas: bool, timesteps: bool, sigmas_end: bool, max_sigma=None) -> dict:
        return {
            "sigmas": sigmas,
            "timesteps": timesteps,
            "sigmas_end": sigmas_end,
            "max_sigma": max_sigma,
            "max_timestep": self.num_train_timesteps - 1,
            "eta": False,
            "max_steps": None,
            "min_steps": None,
        }

    def init_noise_sigma(self, schedule) -> Any:
        """The scale of the initial latents: `sample = latents * init_noise_sigma(schedule)`."""
        return schedule.init_noise_sigma

    def init_state(self, sample) -> Any:
        """The pytree carried from step to step (nothing for the one-step methods)."""
        return ()

    def scale_model_input(self, schedule, sample, i):
        return sample


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; expected one of {choices}")


# -------------------------------------------------------------------------------------------------
# Training noise schedules (diffusers' module-level helpers, in float64)


def betas_for_alpha_bar(num_diffusion_timesteps: int, max_beta: float = 0.999) -> np.ndarray:
    """The cosine schedule ("squaredcos_cap_v2", Nichol & Dhariwal 2021)."""

    def alpha_bar(t):
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    n = num_diffusion_timesteps
    return np.array([min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), max_beta) for i in range(n)])


def rescale_zero_terminal_snr(betas: np.ndarray) -> np.ndarray:
    """Rescales float32 betas to zero terminal SNR (https://huggingface.co/papers/2305.08891, Algorithm 1).

    numpy's float32 sqrt is correctly rounded, torch's CPU one is not (218 of the cosine schedule's 1,000
    values one ulp off, measured on AVX2): near t = 0, where alpha_bar ~ 1 - 4e-5, that ulp is 0.3 % of
    1 - alpha_bar, so with "squaredcos_cap_v2" diffusers' first sigma differs from ours by 1.5e-3 relative
    (ours rounds each square root correctly). Other beta schedules meet the 1e-4 budget
    (tests/models/test_schedulers.py)."""
    alphas_bar_sqrt = np.sqrt(cumprod32(np.float32(1.0) - betas))
    first, last = alphas_bar_sqrt[0], alphas_bar_sqrt[-1]
    alphas_bar_sqrt = (alphas_bar_sqrt - last) * (first / (first - last))
    alphas_bar = alphas_bar_sqrt**2
    alphas = np.concatenate([alphas_bar[:1], alphas_bar[1:] / alphas_bar[:-1]])
    return np.float32(1.0) - alphas


def cumprod32(x: np.ndarray) -> np.ndarray:
    """Cumulative product of a float32 array as torch's CPU kernel computes it: accumulated in float64,
    each output rounded to float32 (measured: 2e-7 relative to torch, where a float32 numpy cumprod is 1e-6)."""
    return np.cumprod(x.astype(np.float64)).astype(np.float32)


# -------------------------------------------------------------------------------------------------
# Inference timesteps and sigmas


def spaced_timesteps(
    spacing: str, num_train: int, n: int, steps_offset: int, *, round_linspace: bool
) -> np.ndarray:
    """[n] float64 descending training timesteps (Table 2 of https://huggingface.co/papers/2305.08891).

    round_linspace: DDIM rounds "linspace" timesteps to integers, the Euler schedulers keep them fractional.
    """
    if spacing == "linspace":
        timesteps = np.linspace(0, num_train - 1, n)[::-1]
        return timesteps.round() if round_linspace else timesteps
    if spacing == "leading":
        step_ratio = num_train // n
        return (np.arange(0, n) * step_ratio).round()[::-1] + steps_offset
    return trailing_timesteps(num_train, num_train, n)


def vp_alpha_sigma(sigma):
    """The variance-preserving pair of a VE sigma: alpha_t = 1 / sqrt(sigma^2 + 1), sigma_t = sigma * alpha_t
    (diffusers' _sigma_to_alpha_sigma_t of the multistep solvers); x_t = alpha_t * x0 + sigma_t * noise."""
    alpha_t = 1 / ((sigma**2 + 1) ** 0.5)
    return alpha_t, sigma * alpha_t


def vp_data_prediction(prediction_type: str, sigma, model_output, sample):
    """x0 from a model output at VE sigma on the VP path (diffusers' convert_model_output of the multistep
    solvers, data-prediction form): epsilon, v_prediction or sample."""
    alpha_t, sigma_t = vp_alpha_sigma(sigma)
    if prediction_type == "epsilon":
        return (sample - sigma_t * model_output) / alpha_t
    if prediction_type == "v_prediction":
        return alpha_t * sample - sigma_t * model_output
    return model_output


def multistep_timesteps(
    spacing: str, last_timestep: int, num_train: int, n: int, steps_offset: int
) -> np.ndarray:
    """[n] int64 descending timesteps of the multistep solvers (diffusers' DPM-Solver and UniPC set_timesteps):
    n + 1 points with the last dropped, so the final step does not start at t = 0. `last_timestep`: the
    number of training timesteps in use (DPM-Solver's lambda_min_clipped drops the noisiest)."""
    if spacing == "linspace":
        return np.linspace(0, last_timestep - 1, n + 1).round()[::-1][:-1].astype(np.int64)
    if spacing == "leading":
        step_ratio = last_timestep // (n + 1)
        return (np.arange(0, n + 1) * step_ratio).round()[::-1][:-1].astype(np.int64) + steps_offset
    return trailing_timesteps(last_timestep, num_train, n).astype(np.int64)


def trailing_timesteps(start: int, num_train: int, n: int) -> np.ndarray:
    """diffusers' "trailing" spacing: arange(start, 0, -num_train / n).round() - 1.

    Deliberate deviation: for 62 step counts in [1, 1000] (61, 103, 121, ...) float rounding makes diffusers'
    arange one element longer, ending in timestep -1 (the UNet then sees t=-1, DDIM reads alphas_cumprod[-1]).
    We keep the first n timesteps, so a request for n steps runs n steps.
    """
    timesteps = np.arange(start, 0, -num_train / n).round() - 1
    return timesteps[:n]


def karras_sigmas(sigma_min: float, sigma_max: float, n: int, rho: float = 7.0) -> np.ndarray:
    """Karras et al. 2022 (https://huggingface.co/papers/2206.00364), rho = 7 as in the paper."""
    sigma_min, sigma_max = float(sigma_min), float(sigma_max)  # float64 arithmetic, as diffusers' .item()
    ramp = np.linspace(0, 1, n)
    min_inv_rho, max_inv_rho = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho


def exponential_sigmas(sigma_min: float, sigma_max: float, n: int) -> np.ndarray:
    return np.exp(np.linspace(math.log(float(sigma_max)), math.log(float(sigma_min)), n))


def beta_sigmas(
    sigma_min: float, sigma_max: float, n: int, alpha: float = 0.6, beta: float = 0.6
) -> np.ndarray:
    """Beta-distributed sigmas (https://huggingface.co/papers/2407.12173)."""
    import scipy.stats  # a dependency of jax; imported here because only this option needs it

    sigma_min, sigma_max = float(sigma_min), float(sigma_max)
    ppf = scipy.stats.beta.ppf(1 - np.linspace(0, 1, n), alpha, beta)
    return sigma_min + ppf * (sigma_max - sigma_min)


# The settings of which at most one may be on (DPM-Solver's lu lambdas are not among them: see its schedule).
RESPACINGS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")


@dataclass(frozen=True)
class RespacedSigmas(NoiseScheduler):
    """The settings of diffusers' classes whose sigmas can be respaced: Karras' rho ramp, exponential or beta
    spacing (at most one of them). The classes that read them: Euler, the k-diffusion ones (Heun, DPM2, DPM2 a,
    LMS, DPM++ SDE), DPM-Solver (and DEIS, singlestep), UniPC and flow-matching Euler."""

    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False

    @property
    def respaced(self) -> bool:
        return bool(self.use_karras_sigmas or self.use_exponential_sigmas or self.use_beta_sigmas)

    def check_one_spacing(self) -> None:
        """Raises when more than one of RESPACINGS is on (diffusers' __init__ does too). Called by each class's
        __post_init__, since the flow forms of DPM-Solver and UniPC skip the base's beta checks."""
        if sum(bool(getattr(self, name)) for name in RESPACINGS) > 1:
            raise ValueError(f"only one of {', '.join(RESPACINGS)} can be set")


@dataclass(frozen=True)
class RespacedSigmasInRange(RespacedSigmas):
    """Respaced sigmas between the config's sigma_min / sigma_max where it sets them (diffusers' Euler,
    DPM-Solver, UniPC and flow-matching Euler read these keys; the k-diffusion classes do not have them)."""

    sigma_min: float | None = None
    sigma_max: float | None = None

    def respaced_between(self, low: float, high: float, n: int) -> np.ndarray:
        """[n] respaced sigmas from the config's sigma_max (else `high`) down to its sigma_min (else `low`)."""
        sigma_min = self.sigma_min if self.sigma_min is not None else low
        sigma_max = self.sigma_max if self.sigma_max is not None else high
        return respacing(self)(sigma_min, sigma_max, n)


def respacing(scheduler: RespacedSigmas):
    """The respacing of the sigmas a config asks for: karras_sigmas, exponential_sigmas or beta_sigmas (by its
    use_karras_sigmas / use_exponential_sigmas / use_beta_sigmas), or None."""
    return (
        karras_sigmas if scheduler.use_karras_sigmas
        else exponential_sigmas if scheduler.use_exponential_sigmas
        else beta_sigmas if scheduler.use_beta_sigmas
        else None
    )  # fmt: skip


def respaced_sigmas(
    scheduler: RespacedSigmasInRange, train_sigmas: np.ndarray, n: int, *, round_karras: bool
):
    """(sigmas [n], fractional timesteps [n]) of the multistep solvers' Karras / exponential / beta sigmas:
    respaced between the ends of the *training* sigmas (Euler uses the inference ones), or the config's
    sigma_min / sigma_max where it has them; Karras timesteps rounded when `round_karras`."""
    sigmas = scheduler.respaced_between(train_sigmas[0], train_sigmas[-1], n)
    timesteps = sigma_to_t(sigmas, np.log(train_sigmas))
    if scheduler.use_karras_sigmas and round_karras:
        timesteps = timesteps.round()
    return sigmas, timesteps


def stretch_to_terminal(sigmas: np.ndarray, shift_terminal: float) -> np.ndarray:
    """Flow sigmas stretched so the last one is `shift_terminal` (diffusers' stretch_shift_to_terminal, from
    LTX-Video); a last sigma of 1 divides 0 by 0."""
    one_minus_z = 1 - sigmas
    return 1 - one_minus_z / (one_minus_z[-1] / (1 - shift_terminal))


def sigma_to_t(sigmas: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """Fractional training timesteps of `sigmas` by linear interpolation in log sigma (k-diffusion)."""
    sigmas = np.asarray(sigmas, np.float64)  # log_sigmas: diffusers' float32 table, kept float32
    log_sigma = np.log(np.maximum(sigmas, 1e-10))
    dists = log_sigma - log_sigmas[:, None]
    low_idx = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=log_sigmas.shape[0] - 2)
    high_idx = low_idx + 1
    low, high = log_sigmas[low_idx], log_sigmas[high_idx]
    w = np.clip((low - log_sigma) / (low - high), 0, 1)
    return ((1 - w) * low_idx + w * high_idx).reshape(sigmas.shape)


def f32(x) -> np.ndarray:
    return np.asarray(x, np.float32)


# -------------------------------------------------------------------------------------------------
# Traced helpers used by the steps


def at(table, i):
    """table[i] with a traced i; works whether the schedule holds numpy arrays or traced ones."""
    return jnp.asarray(table)[i]


def step_noise(key, noise, like):
    """The standard normal noise of a stochastic step: `noise` when given (tests feed diffusers' draws),
    else drawn from `key`. float32 like diffusers' draws.

    `key` is one PRNG key for the whole sample, or a [B] array of keys, one per row of `like` [B, ...]: row b's
    noise then depends on key[b] alone, so a sample's result does not depend on what it is batched with.
    """
    if noise is not None:
        return jnp.asarray(noise, jnp.float32)
    if key is None:
        raise ValueError("this scheduler adds noise at every step: pass a PRNG `key` (or explicit `noise`)")
    if key.ndim == 1:
        if key.shape[0] != like.shape[0]:
            raise ValueError(f"{key.shape[0]} row keys for a batch of {like.shape[0]}")
        return jax.vmap(lambda k: jax.random.normal(k, like.shape[1:], jnp.float32))(key)
    return jax.random.normal(key, like.shape, jnp.float32)


def alpha_bar_prediction(prediction_type: str, alpha_prod_t, sample, model_output):
    """(x0, eps) from a model output at alpha_bar (the steps of diffusers' DDIM, DDPM, LCM and TCD): epsilon,
    sample or v_prediction; float32 in, float32 out."""
    beta_prod_t = 1 - alpha_prod_t
    if prediction_type == "epsilon":
        return (sample - beta_prod_t**0.5 * model_output) / alpha_prod_t**0.5, model_output
    if prediction_type == "sample":
        return model_output, (sample - alpha_prod_t**0.5 * model_output) / beta_prod_t**0.5
    return (
        alpha_prod_t**0.5 * sample - beta_prod_t**0.5 * model_output,
        alpha_prod_t**0.5 * model_output + beta_prod_t**0.5 * sample,
    )


def clip_or_threshold(scheduler, x0):
    """x0 dynamically thresholded, or clipped to +-clip_sample_range, as the scheduler's settings say (diffusers'
    DDIM, DDPM, LCM)."""
    if scheduler.thresholding:
        return threshold_sample(x0, scheduler.dynamic_thresholding_ratio, scheduler.sample_max_value)
    if scheduler.clip_sample:
        return jnp.clip(x0, -scheduler.clip_sample_range, scheduler.clip_sample_range)
    return x0


def threshold_sample(x0, ratio: float, max_value: float):
    """Dynamic thresholding (Imagen, https://huggingface.co/papers/2205.11487): per sample, clip x0 to the
    `ratio` quantile s of |x0| (s clamped to [1, max_value]) and divide by s. Layout-agnostic: a sample's
    elements are flattened as diffusers' reshape(B, C * H * W) does."""
    flat = x0.reshape(x0.shape[0], -1)
    s = jnp.quantile(jnp.abs(flat), ratio, axis=1, method="linear")  # torch.quantile's default interpolation
    s = jnp.clip(s, 1.0, max_value)[:, None]
    return (jnp.clip(flat, -s, s) / s).reshape(x0.shape)

"""Flow-matching Euler: ours (numpy schedule + jnp step) against diffusers' FlowMatchEulerDiscreteScheduler.

Schedules are built as diffusers' Flux pipeline builds them (sigmas linspace(1, 1/N, N), mu from
`calculate_shift`) and as the scheduler alone builds them (no sigmas passed), for static and dynamic shifts.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler as Reference
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from meshserve.models.schedulers import FLOW_SCHEDULER_NAMES, SCHEDULER_NAMES, make_scheduler, pad_schedule
from meshserve.models.schedulers.flow_match_euler import FlowMatchEulerDiscreteScheduler, flux_mu

log = logging.getLogger(__name__)

STEPS = (1, 4, 28, 50)
# FLUX.1-dev's scheduler_config.json; schnell's is the same with use_dynamic_shifting false and shift 1.0.
FLUX_DEV = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
STATIC = [{"shift": 1.0}, {"shift": 3.0}]
SEQ_LENS = (256, 1024, 4096, 6400)  # 256^2, 512^2, 1024^2 and 1280^2 images, packed 2x2 from /8 latents
SHAPE = (2, 16, 4, 4)


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def reference(config, steps, *, mu=None, pipeline_sigmas=True):
    ref = Reference.from_config(config)
    sigmas = np.linspace(1.0, 1 / steps, steps) if pipeline_sigmas else None
    ref.set_timesteps(steps, sigmas=sigmas, mu=mu)
    return ref


def assert_schedule_equal(ours, ref):
    assert ours.timesteps.dtype == np.float32 and ours.sigmas.dtype == np.float32
    # Both are float32 from the same float32 arithmetic: equal, or within one float32 rounding.
    np.testing.assert_allclose(ours.sigmas, ref.sigmas.numpy(), rtol=2e-7, atol=0)
    np.testing.assert_allclose(ours.timesteps, ref.timesteps.numpy(), rtol=2e-7, atol=0)
    assert ours.sigmas[-1] == 0.0 and float(ours.init_noise_sigma) == 1.0


@pytest.mark.parametrize("pipeline_sigmas", [True, False], ids=["pipeline_sigmas", "config_sigmas"])
@pytest.mark.parametrize("config", STATIC, ids=lambda c: f"shift{c['shift']}")
@pytest.mark.parametrize("steps", STEPS)
def test_static_shift_schedule_equals_diffusers(config, steps, pipeline_sigmas):
    ours = make_scheduler("flow_match_euler", config).schedule(steps, pipeline_sigmas=pipeline_sigmas)
    assert_schedule_equal(ours, reference(config, steps, pipeline_sigmas=pipeline_sigmas))


@pytest.mark.parametrize("pipeline_sigmas", [True, False], ids=["pipeline_sigmas", "config_sigmas"])
@pytest.mark.parametrize("seq_len", SEQ_LENS)
@pytest.mark.parametrize("steps", STEPS)
def test_dynamic_shift_schedule_equals_diffusers(seq_len, steps, pipeline_sigmas):
    mu = flux_mu(seq_len, FLUX_DEV)
    assert mu == calculate_shift(seq_len, 256, 4096, 0.5, 1.15)
    ours = make_scheduler(None, FLUX_DEV).schedule(steps, mu=mu, pipeline_sigmas=pipeline_sigmas)
    assert_schedule_equal(ours, reference(FLUX_DEV, steps, mu=mu, pipeline_sigmas=pipeline_sigmas))


# After the shift: LTX-Video's terminal stretch, and the respaced sigmas diffusers offers on flow matching too
# (between the shifted sigmas' ends, or the config's sigma_min / sigma_max, which diffusers keeps as hidden keys).
RESPACED = [
    {"shift": 3.0, "shift_terminal": 0.1},
    {"shift": 3.0, "use_karras_sigmas": True},
    {"shift": 1.0, "use_exponential_sigmas": True},
    {"shift": 3.0, "use_beta_sigmas": True},
    {"shift": 3.0, "use_karras_sigmas": True, "sigma_min": 0.01, "sigma_max": 0.9},
    {**FLUX_DEV, "use_karras_sigmas": True},
    {**FLUX_DEV, "shift_terminal": 0.05, "use_exponential_sigmas": True},
]


@pytest.mark.parametrize("pipeline_sigmas", [True, False], ids=["pipeline_sigmas", "config_sigmas"])
@pytest.mark.parametrize(
    "config", RESPACED, ids=lambda c: "-".join(k for k in c if k not in FLUX_DEV) or "flux"
)
@pytest.mark.parametrize("steps", (1, 4, 28))
def test_terminal_and_respaced_sigmas_equal_diffusers(config, steps, pipeline_sigmas):
    mu = flux_mu(1024, FLUX_DEV) if config.get("use_dynamic_shifting") else None
    sched = make_scheduler("flow_match_euler", config)
    if config.get("shift_terminal") and steps == 1:  # its one sigma is 1: diffusers' stretch is 0 / 0, NaN
        assert np.isnan(reference(config, steps, mu=mu, pipeline_sigmas=pipeline_sigmas).sigmas[0])
        with pytest.raises(ValueError, match="shift_terminal"):
            sched.schedule(steps, mu=mu, pipeline_sigmas=pipeline_sigmas)
        return
    ours = sched.schedule(steps, mu=mu, pipeline_sigmas=pipeline_sigmas)
    ref = reference(config, steps, mu=mu, pipeline_sigmas=pipeline_sigmas)
    assert rel_err(ours.sigmas, ref.sigmas.numpy()) <= 1e-6
    assert rel_err(ours.timesteps, ref.timesteps.numpy()) <= 1e-6


def test_linear_time_shift_equals_diffusers():
    config = {**FLUX_DEV, "time_shift_type": "linear"}
    ours = make_scheduler("FlowMatchEulerDiscreteScheduler", config).schedule(28, mu=1.15)
    assert_schedule_equal(ours, reference(config, 28, mu=1.15))


def test_mu_is_a_per_request_value():
    sched = make_scheduler(None, FLUX_DEV)
    small, large = (
        sched.schedule(28, mu=flux_mu(256, FLUX_DEV)),
        sched.schedule(28, mu=flux_mu(4096, FLUX_DEV)),
    )
    assert flux_mu(4096, FLUX_DEV) == pytest.approx(1.15) and flux_mu(256, FLUX_DEV) == pytest.approx(0.5)
    assert np.all(large.sigmas[1:-1] > small.sigmas[1:-1])  # a larger image spends more steps at high noise
    with pytest.raises(ValueError, match="mu"):
        sched.schedule(28)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_jitted_loop_equals_diffusers_step_loop(dtype):
    """A whole loop with a fake velocity v(x, t) (nonlinear in both, so a wrong sigma or t shows), jitted over a
    padded schedule with a traced step count, against diffusers' step() loop."""
    steps, mu = 28, flux_mu(4096, FLUX_DEV)
    jdtype = jnp.float32 if dtype == torch.float32 else jnp.bfloat16
    x0 = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)

    def velocity_np(x, t):
        return np.tanh(x) * (t / 1000) + 0.1 * np.cos(t / 100)

    ref = reference(FLUX_DEV, steps, mu=mu)
    x = torch.from_numpy(x0).to(dtype)
    for t in ref.timesteps:
        v = torch.from_numpy(velocity_np(x.float().numpy(), t.numpy())).to(dtype)
        x = ref.step(v, t, x).prev_sample
    want = x.float().numpy()

    sched = make_scheduler(None, FLUX_DEV)
    schedule = jax.tree.map(jnp.asarray, pad_schedule(sched.schedule(steps, mu=mu), 64))

    @jax.jit
    def loop(schedule, x):
        def body(i, x):
            t = schedule.timesteps[i]
            v = (jnp.tanh(x.astype(jnp.float32)) * (t / 1000) + 0.1 * jnp.cos(t / 100)).astype(x.dtype)
            return sched.step(schedule, (), v, x, i)[0]

        return jax.lax.fori_loop(0, schedule.num_steps, body, x)

    got = np.asarray(loop(schedule, jnp.asarray(x0, jdtype)), np.float32)
    err = rel_err(got, want)
    log.info("flow_match_euler 28-step loop %s rel err %.2e", dtype, err)
    # fp32: the same float32 operations; bf16: diffusers' rounding reproduced (dt * v in bf16, see `step`), so
    # only tanh/cos differences between numpy and XLA remain, each rounded to bf16.
    assert err <= (1e-5 if dtype == torch.float32 else 1e-2), err
    assert rel_err(np.asarray(x0), want) > 1e-2  # the loop moved the sample: the check can fail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_stochastic_sampling_loop_equals_diffusers_on_its_draws(dtype):
    """stochastic_sampling: each step noises the x0 its velocity implies afresh to the next sigma. A jitted
    loop fed diffusers' own draws (its generator's randn per step, replayed) against diffusers' step loop; then
    the engine's way (a key per step): a function of the keys, the step-to-step noise its own."""
    config, steps, mu = {**FLUX_DEV, "stochastic_sampling": True}, 12, flux_mu(1024, FLUX_DEV)
    jdtype = jnp.float32 if dtype == torch.float32 else jnp.bfloat16
    x0 = np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32)
    ref = reference(config, steps, mu=mu)
    generator, x = torch.Generator().manual_seed(5), torch.from_numpy(x0).to(dtype)
    for t in ref.timesteps:
        v = (torch.tanh(x.float()) * (t / 1000) + 0.1).to(dtype)
        x = ref.step(v, t, x, generator=generator).prev_sample
    want = x.float().numpy()
    replay = torch.Generator().manual_seed(5)
    noises = np.stack([torch.randn(SHAPE, generator=replay).numpy() for _ in range(steps)])

    sched = make_scheduler(None, config)
    assert sched.stochastic
    schedule = jax.tree.map(jnp.asarray, pad_schedule(sched.schedule(steps, mu=mu), 32))

    @jax.jit
    def loop(schedule, x, noises=None, key=None):
        def body(i, x):
            v = (jnp.tanh(x.astype(jnp.float32)) * (schedule.timesteps[i] / 1000) + 0.1).astype(x.dtype)
            if noises is not None:
                return sched.step(schedule, (), v, x, i, noise=noises[i])[0]
            return sched.step(schedule, (), v, x, i, jax.random.fold_in(key, i))[0]

        return jax.lax.fori_loop(0, schedule.num_steps, body, x)

    got = np.asarray(loop(schedule, jnp.asarray(x0, jdtype), jnp.asarray(noises)), np.float32)
    assert rel_err(got, want) <= (1e-5 if dtype == torch.float32 else 1e-2)
    plain = reference(FLUX_DEV, steps, mu=mu)  # the same loop without the fresh noise ends elsewhere
    y = torch.from_numpy(x0).to(dtype)
    for t in plain.timesteps:
        y = plain.step((torch.tanh(y.float()) * (t / 1000) + 0.1).to(dtype), t, y).prev_sample
    assert rel_err(y.float().numpy(), want) > 0.1
    seeded = [loop(schedule, jnp.asarray(x0, jdtype), key=jax.random.key(k)) for k in (0, 0, 1)]
    assert np.array_equal(seeded[0], seeded[1]) and not np.allclose(seeded[0], seeded[2])


def test_bf16_step_rounds_as_diffusers():
    """One step on bf16 inputs is bit-equal to diffusers (dt rounded to bf16 before the product)."""
    ref = reference(FLUX_DEV, 28, mu=1.15)
    ref._step_index = 3
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((4096,)).astype(np.float32)).bfloat16()
    v = torch.from_numpy(rng.standard_normal((4096,)).astype(np.float32)).bfloat16()
    want = ref.step(v, ref.timesteps[3], x).prev_sample.float().numpy()
    sched = make_scheduler(None, FLUX_DEV)
    schedule = sched.schedule(28, mu=1.15)
    to_jax = lambda a: jnp.asarray(a.float().numpy(), jnp.bfloat16)  # noqa: E731
    got, _ = sched.step(schedule, (), to_jax(v), to_jax(x), 3)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)


@pytest.mark.parametrize("steps", STEPS)
def test_padded_schedule_equals_exact(steps):
    sched = make_scheduler(None, FLUX_DEV)
    exact = sched.schedule(steps, mu=0.8)
    padded = pad_schedule(exact, 200)
    assert (
        int(padded.num_steps) == steps and padded.timesteps.shape == (200,) and padded.sigmas.shape == (201,)
    )
    np.testing.assert_array_equal(padded.timesteps[:steps], exact.timesteps)
    np.testing.assert_array_equal(padded.sigmas[: steps + 1], exact.sigmas)
    rng = np.random.default_rng(2)
    x, v = rng.standard_normal(SHAPE).astype(np.float32), rng.standard_normal(SHAPE).astype(np.float32)
    for i in range(steps):
        a, _ = sched.step(exact, (), v, x, i)
        b, _ = sched.step(padded, (), v, x, jnp.int32(i))
        np.testing.assert_array_equal(a, b)


def test_names_and_unsupported_options():
    assert "flow_match_euler" in FLOW_SCHEDULER_NAMES and "flow_match_euler" not in SCHEDULER_NAMES
    assert isinstance(make_scheduler("flow_match_euler", {}), FlowMatchEulerDiscreteScheduler)
    assert isinstance(make_scheduler(None, FLUX_DEV), FlowMatchEulerDiscreteScheduler)
    with pytest.raises(ValueError, match="invert_sigmas"):
        make_scheduler(None, {**FLUX_DEV, "invert_sigmas": True})
    with pytest.raises(ValueError, match="only one of"):
        make_scheduler(None, {**FLUX_DEV, "use_karras_sigmas": True, "use_beta_sigmas": True})
    with pytest.raises(ValueError, match="time_shift_type"):
        make_scheduler(None, {**FLUX_DEV, "time_shift_type": "cubic"})

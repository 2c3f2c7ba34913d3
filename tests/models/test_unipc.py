"""UniPC (flow matching, as Wan 2.1 runs it): ours (numpy schedule + jnp step) against diffusers'
UniPCMultistepScheduler, built from the same config dict.

The "model" of the loop tests is a fixed deterministic velocity v(x, t), nonlinear in both, so a wrong sigma,
timestep, order or corrector shows in the result. The measured errors are logged (--log-cli-level=INFO).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import UniPCMultistepScheduler as Reference

from meshserve.models.schedulers import FLOW_SCHEDULER_NAMES, SCHEDULER_NAMES, make_scheduler, pad_schedule
from meshserve.models.schedulers.unipc_multistep import UniPCMultistepScheduler

log = logging.getLogger(__name__)

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler/scheduler_config.json (the keys that matter; the beta keys are
# ignored by the flow form, in diffusers as here).
WAN = {
    "_class_name": "UniPCMultistepScheduler",
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995,
    "final_sigmas_type": "zero",
    "flow_shift": 3.0,
    "lower_order_final": True,
    "num_train_timesteps": 1000,
    "predict_x0": True,
    "prediction_type": "flow_prediction",
    "rescale_betas_zero_snr": False,
    "sample_max_value": 1.0,
    "solver_order": 2,
    "solver_p": None,
    "solver_type": "bh2",
    "steps_offset": 0,
    "thresholding": False,
    "timestep_spacing": "linspace",
    "trained_betas": None,
    "use_beta_sigmas": False,
    "use_exponential_sigmas": False,
    "use_flow_sigmas": True,
    "use_karras_sigmas": False,
}
STEPS = (1, 2, 3, 10, 50)
SHIFTS = (1.0, 3.0, 5.0)
SHAPE = (2, 3, 4, 6, 16)  # [B, T, H, W, C]: the scheduler is elementwise, any layout


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def reference(config, steps, mu=None):
    ref = Reference.from_config(config)
    ref.set_timesteps(steps, mu=mu)
    return ref


def velocity_np(x, t):
    return np.tanh(x) * (t / 1000) - 0.3 * x + 0.1 * np.cos(t / 100)


def velocity_jnp(x, t):
    return jnp.tanh(x) * (t / 1000) - 0.3 * x + 0.1 * jnp.cos(t / 100)


def diffusers_loop(config, steps, x0, *, mu=None, record=False):
    ref = reference(config, steps, mu)
    ref.set_begin_index(0)  # as Wan's pipeline
    x = torch.from_numpy(x0)
    trail = []
    for t in ref.timesteps:
        v = torch.from_numpy(velocity_np(x.numpy(), t.numpy().astype(np.float32)).astype(np.float32))
        x = ref.step(v, t, x).prev_sample
        trail.append(x.numpy().copy())
    return trail if record else x.numpy()


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("steps", STEPS + (7, 28, 1000))
def test_schedule_equals_diffusers(steps, shift):
    config = {**WAN, "flow_shift": shift}
    ours = make_scheduler("unipc", config).schedule(steps)
    ref = reference(config, steps)
    assert ref.timesteps.dtype == torch.int64
    # The same float64 arithmetic, truncated to the same integers.
    np.testing.assert_array_equal(ours.timesteps, ref.timesteps.numpy().astype(np.float32))
    assert ours.timesteps.dtype == np.float32 and ours.sigmas.dtype == np.float32
    np.testing.assert_array_equal(ours.sigmas, ref.sigmas.numpy())
    assert ours.sigmas[-1] == 0.0 and float(ours.init_noise_sigma) == 1.0


def test_wan_first_timesteps():
    """The numbers the facts page quotes: sigma 1 nudged to 1 - 1e-6 (t = 999), then truncated sigma * 1000."""
    schedule = make_scheduler("unipc", WAN).schedule(50)
    assert schedule.timesteps[0] == 999 and schedule.sigmas[0] == np.float32(1 - 1e-6)
    # shift 3: sigma_1 = 3 s / (1 + 2 s), s = 1 - 0.999 / 50
    s = 1 - 0.999 / 50
    assert schedule.timesteps[1] == int(3 * s / (1 + 2 * s) * 1000)


@pytest.mark.parametrize(
    "changes",
    [
        {"use_dynamic_shifting": True},
        {"use_dynamic_shifting": True, "time_shift_type": "linear"},
        {"shift_terminal": 0.1},
        {"final_sigmas_type": "sigma_min"},
    ],
    ids=["dynamic", "dynamic_linear", "shift_terminal", "sigma_min"],
)
def test_schedule_options_equal_diffusers(changes):
    config = {**WAN, **changes}
    mu = 0.8 if config.get("use_dynamic_shifting") else None
    ours = make_scheduler("unipc", config).schedule(20, mu=mu)
    ref = reference(config, 20, mu)
    np.testing.assert_array_equal(ours.timesteps, ref.timesteps.numpy().astype(np.float32))
    np.testing.assert_array_equal(ours.sigmas, ref.sigmas.numpy())


def run_ours(config, steps, x0, *, mu=None, max_steps=None):
    """Our loop, jitted; with max_steps the schedule is padded and the trip count is traced, as the engine's."""
    sched = make_scheduler("unipc", config)
    schedule = sched.schedule(steps, mu=mu)
    if max_steps is not None:
        schedule = pad_schedule(schedule, max_steps)
    schedule = jax.tree.map(jnp.asarray, schedule)

    @jax.jit
    def loop(schedule, x):
        def body(i, carry):
            x, state = carry
            v = velocity_jnp(x, schedule.timesteps[i])
            return sched.step(schedule, state, v, x, i)

        return jax.lax.fori_loop(0, schedule.num_steps, body, (x, sched.init_state(x)))[0]

    return np.asarray(loop(schedule, jnp.asarray(x0)))


X0 = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)

LOOP_CASES = [
    (WAN, 50),
    ({**WAN, "flow_shift": 5.0}, 50),
    (WAN, 2),
    (WAN, 3),
    (WAN, 10),
    ({**WAN, "solver_order": 1}, 10),
    ({**WAN, "solver_order": 3}, 12),
    # bh1 with a final sigma of 0 is NaN in diffusers (see test_bh1_final_step_is_finite): sigma_min here.
    ({**WAN, "solver_type": "bh1", "final_sigmas_type": "sigma_min"}, 12),
    ({**WAN, "lower_order_final": False, "final_sigmas_type": "sigma_min"}, 12),
    ({**WAN, "disable_corrector": [0, 3]}, 8),
    ({**WAN, "thresholding": True, "sample_max_value": 1.2}, 8),
]


@pytest.mark.parametrize(
    "config,steps",
    LOOP_CASES,
    ids=[
        "wan50",
        "shift5",
        "2steps",
        "3steps",
        "10steps",
        "order1",
        "order3",
        "bh1",
        "no_lof",
        "no_corr",
        "thresh",
    ],
)
def test_jitted_padded_loop_equals_diffusers(config, steps):
    want = diffusers_loop(config, steps, X0)
    got = run_ours(config, steps, X0, max_steps=64)
    err = rel_err(got, want)
    log.info(
        "unipc %d steps %s: rel err %.2e",
        steps,
        {k: config[k] for k in config if config[k] != WAN.get(k)},
        err,
    )
    assert err <= 1e-5, err
    assert rel_err(X0, want) > 1e-2  # the loop moved the sample: the check can fail


def test_bh1_final_step_is_finite():
    """Deliberate deviation: with bh1, B(h) = -h is -inf at sigma 0 and diffusers' first-order update computes
    -inf * 0 = NaN for the final sample; ours leaves the zero term out, so all steps before agree and the last
    one is the plain first-order (x0) update."""
    config = {**WAN, "solver_type": "bh1"}
    trail = diffusers_loop(config, 12, X0, record=True)
    assert np.isnan(trail[-1]).all() and not np.isnan(trail[-2]).any()
    ours = eager_trail(config, 12, X0)
    for i in range(11):
        assert rel_err(ours[i], trail[i]) <= 1e-5, i
    assert np.isfinite(ours[-1]).all()
    np.testing.assert_allclose(run_ours(config, 12, X0), ours[-1], rtol=1e-6, atol=1e-6)


def eager_trail(config, steps, x0):
    """Our steps one by one, eagerly on an exact-length schedule: every intermediate sample."""
    sched = make_scheduler("unipc", config)
    schedule = sched.schedule(steps)
    x = jnp.asarray(x0)
    state, trail = sched.init_state(x), []
    for i in range(steps):
        x, state = sched.step(schedule, state, velocity_jnp(x, jnp.asarray(schedule.timesteps)[i]), x, i)
        trail.append(np.asarray(x))
    return trail


def test_every_step_equals_diffusers():
    """Step by step (eager, exact-length schedule): each intermediate sample, not only the end."""
    steps = 12
    trail = diffusers_loop(WAN, steps, X0, record=True)
    for i, (ours, want) in enumerate(zip(eager_trail(WAN, steps, X0), trail, strict=True)):
        err = rel_err(ours, want)
        assert err <= 1e-5, (i, err)


def test_dynamic_shift_loop_equals_diffusers():
    config = {**WAN, "use_dynamic_shifting": True}
    want = diffusers_loop(config, 20, X0, mu=0.9)
    assert rel_err(run_ours(config, 20, X0, mu=0.9), want) <= 1e-5


def test_corrector_matters():
    """A loop with every corrector disabled differs from the default: the corrector is really applied."""
    full = run_ours(WAN, 10, X0)
    no_corrector = run_ours({**WAN, "disable_corrector": list(range(10))}, 10, X0)
    assert rel_err(no_corrector, full) > 1e-3
    assert (
        rel_err(no_corrector, diffusers_loop({**WAN, "disable_corrector": list(range(10))}, 10, X0)) <= 1e-5
    )


def test_bf16_model_output_rounds_as_diffusers():
    """Wan's transformer returns bf16 into fp32 latents: x0 = x - sigma * v with the product in bf16."""
    steps = 10
    ref = reference(WAN, steps)
    ref.set_begin_index(0)
    sched = make_scheduler("unipc", WAN)
    schedule = sched.schedule(steps)
    x_t, x_j = torch.from_numpy(X0), jnp.asarray(X0)
    state = sched.init_state(x_j)
    for i, t in enumerate(ref.timesteps):
        v = torch.from_numpy(velocity_np(x_t.numpy(), np.float32(t))).bfloat16()
        x_t = ref.step(v, t, x_t).prev_sample
        x_j, state = sched.step(schedule, state, jnp.asarray(v.float().numpy(), jnp.bfloat16), x_j, i)
    assert x_j.dtype == jnp.float32
    assert rel_err(x_j, x_t.numpy()) <= 1e-5


@pytest.mark.parametrize("steps", (1, 10, 50))
def test_padded_schedule_equals_exact(steps):
    sched = make_scheduler("unipc", WAN)
    exact = sched.schedule(steps)
    padded = pad_schedule(exact, 200)
    assert (
        int(padded.num_steps) == steps and padded.timesteps.shape == (200,) and padded.sigmas.shape == (201,)
    )
    np.testing.assert_array_equal(padded.sigmas[: steps + 1], exact.sigmas)


def test_names_and_unsupported_options():
    # Both forms under one name: the flow form on a flow-matching config, the VP form (test_schedulers.py) on
    # a beta-schedule one.
    assert "unipc" in FLOW_SCHEDULER_NAMES and "unipc" in SCHEDULER_NAMES
    assert make_scheduler("unipc", WAN).use_flow_sigmas
    assert make_scheduler("unipc", {"_class_name": "FlowMatchEulerDiscreteScheduler"}).use_flow_sigmas
    assert not make_scheduler("unipc", {}).use_flow_sigmas
    assert make_scheduler("unipc", {}).prediction_type == "epsilon"
    assert isinstance(make_scheduler(None, WAN), UniPCMultistepScheduler)
    assert make_scheduler("unipc", WAN, flow_shift=5.0).flow_shift == 5.0
    sched = make_scheduler(None, {**WAN, "disable_corrector": [1, 2]})
    assert sched.disable_corrector == (1, 2) and hash(sched)  # hashable: a static jit argument
    assert make_scheduler(None, {**WAN, "solver_type": "midpoint"}).solver_type == "bh2"  # as diffusers
    for key, value in (("use_karras_sigmas", True), ("predict_x0", False)):
        with pytest.raises(ValueError, match=key):
            make_scheduler(None, {**WAN, key: value})
    with pytest.raises(ValueError, match="use_flow_sigmas"):
        make_scheduler(None, {**WAN, "use_flow_sigmas": False})
    with pytest.raises(ValueError, match="solver_order"):
        make_scheduler(None, {**WAN, "solver_order": 4})
    with pytest.raises(ValueError, match="mu"):
        make_scheduler(None, {**WAN, "use_dynamic_shifting": True}).schedule(10)
    # Order 2 or 3 at the last step against a final sigma of 0: diffusers' sample is NaN (order 2) or its solve
    # fails (order 3); ours was all NaN. Refused; with sigma_min it runs (LOOP_CASES' no_lof).
    for order in (2, 3):
        with pytest.raises(ValueError, match="lower_order_final"):
            make_scheduler(None, {**WAN, "lower_order_final": False, "solver_order": order})
    assert not make_scheduler(None, {**WAN, "lower_order_final": False, "solver_order": 1}).lower_order_final


def test_engine_denoise_loop_equals_diffusers():
    """Through the engine's own loop (models/registry.py/denoise_loop: lax.while_loop, traced step count, CFG,
    the per-step host callback), 30 steps on a schedule padded to 200 steps."""
    from meshserve.models.engine.denoise_loop import denoise_loop

    steps, guidance = 30, 5.0
    sched = make_scheduler("unipc", WAN)
    schedule = jax.tree.map(jnp.asarray, pad_schedule(sched.schedule(steps), 200))

    def model(x, t, i):  # interleaved [u0, c0, u1, c1]: a different velocity for the two halves
        half = jnp.asarray([0.0, 1.0] * (x.shape[0] // 2)).reshape(-1, *([1] * (x.ndim - 1)))
        return velocity_jnp(x, t) + 0.05 * half

    calls = []

    @jax.jit
    def run(schedule, latents):
        keys = jax.random.split(jax.random.key(0), latents.shape[0])
        return denoise_loop(
            model,
            sched,
            schedule,
            latents,
            keys,
            jnp.full((latents.shape[0],), guidance),
            do_cfg=True,
            on_step=lambda step, _: calls.append(int(step)) or np.bool_(True),
        )

    got, done = run(schedule, jnp.asarray(X0))
    assert int(done) == steps and calls == list(range(1, steps + 1))

    ref = reference(WAN, steps)
    ref.set_begin_index(0)
    x = torch.from_numpy(X0)
    for t in ref.timesteps:
        v = velocity_np(x.numpy(), np.float32(t))
        v = torch.from_numpy((v + guidance * 0.05).astype(np.float32))  # uncond + g * (cond - uncond)
        x = ref.step(v, t, x).prev_sample
    assert rel_err(got, x.numpy()) <= 1e-5

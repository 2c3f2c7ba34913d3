"""The step count is a traced value: schedules padded to MAX_STEPS, the loop's trip count traced, so a new step
count compiles nothing; and a padded schedule runs exactly as the unpadded one (the scheduler cases of
test_schedulers.py whose step logic depends on the step count: each scheduler's default and every case setting
orders, final steps, clipping, noise or zero-SNR; DPM-Solver's final-step orders and clipped schedules included)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshserve.models import load_pipeline
from meshserve.models.schedulers import pad_schedule
from tests.models.test_schedulers import CASES, SHAPE, build, case_id, fake_model, rel_err, sdxl_config  # noqa: F401
from tests.xla_level import SERVING_EMITTERS

H, W = 64, 48
COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits")


class CompileCounter:
    """Counts XLA compilations, whether compiled by the backend or read from the persistent cache (the tests
    run with it on, so counting backend compiles alone would miss programs compiled in an earlier session)."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event, duration, **_):
        if event == COMPILE_EVENTS[0]:
            self.count += 1

    def _on_event(self, event, **_):
        if event == COMPILE_EVENTS[1]:
            self.count += 1


@pytest.fixture(scope="module")
def counter():
    return CompileCounter()


@pytest.mark.parametrize("scheduler", ["euler", "dpmpp_2m_sde"])
def test_new_step_count_compiles_nothing(tiny_sdxl_path, counter, scheduler, record_property):
    pipe = load_pipeline(tiny_sdxl_path)
    kw = dict(height=H, width=W, guidance_scale=5.0, seed=3, scheduler=scheduler, output_type="np")
    before = counter.count
    pipe("a cat", num_inference_steps=2, **kw)
    first = counter.count - before
    programs = pipe.compilations
    seen = []
    for steps in (3, 5, 7):
        out = pipe("a cat", num_inference_steps=steps, callback=lambda s, t: seen.append((s, t)), **kw)
        assert not out.compiled
    record_property("compilations_first_call", first)
    record_property("compilations_steps_3_5_7", counter.count - before - first)
    assert first >= 3  # the counter is live: text_encode, denoise, vae_decode at least
    assert counter.count - before - first == 0, f"steps 3, 5, 7 compiled {counter.count - before - first}"
    assert pipe.compilations == programs == 3
    assert [t for _, t in seen] == [3] * 3 + [5] * 5 + [7] * 7  # the callback hears the real count


# Compiled with serving's fusion emitters (tests/xla_level.py): the suite's older ones put it 4.4e-4 away from
# the exact loop at zero terminal SNR.
@partial(jax.jit, static_argnums=0, compiler_options=SERVING_EMITTERS)
def run_padded_loop(scheduler, schedule, latents, noises):
    """test_schedulers' run_loop on a padded schedule: a while_loop whose trip count is the traced
    schedule.num_steps (one program for every step count)."""
    sample = latents * scheduler.init_noise_sigma(schedule)

    def body(carry):
        i, sample, state = carry
        x_in = scheduler.scale_model_input(schedule, sample, i)
        model_output = fake_model(x_in, schedule.timesteps[i], jnp)
        noise = noises[i] if scheduler.stochastic else None
        sample, state = scheduler.step(schedule, state, model_output, sample, i, noise=noise)
        return i + 1, sample, state

    carry = (jnp.int32(0), sample, scheduler.init_state(sample))
    _, sample, _ = jax.lax.while_loop(lambda c: c[0] < schedule.num_steps, body, carry)
    return sample


# Settings that change what a step does from its index or the step count (orders, final steps, a clipped or
# zero-SNR end, noise, PNDM's start): the padded loop's traced count must reproduce them. The other cases of
# test_schedulers.py (beta schedules, spacings, sigma respacings) change only the schedule's values; checking
# them all here took 150 s of a 39-minute suite on a slow VM (2026-11-30), for one scheduler's worth of coverage.
STEP_LOGIC = {
    "solver_order", "lower_order_final", "final_sigmas_type", "euler_at_final", "skip_prk_steps", "lambda_min_clipped",
    "algorithm_type", "solver_type", "disable_corrector", "eta", "rescale_betas_zero_snr",
}  # fmt: skip
PADDED_CASES = [
    case
    for k, case in enumerate(CASES)
    if not case[1] or case[0] not in {c[0] for c in CASES[:k]} or STEP_LOGIC & {*case[1], *case[2]}
]


@pytest.mark.parametrize("case", PADDED_CASES, ids=case_id)
def test_padded_schedule_runs_as_the_exact_one(sdxl_config, case):  # noqa: F811
    from tests.models.test_schedulers import run_loop

    ours, _ = build(sdxl_config, case)
    # The exact loop op by op, where it rounds close enough to the padded program: compiled, its three step
    # counts were three programs a case, two thirds of this test's time (bench/README.md, "The test suite's
    # time"). Op by op against one fused program the loops differ by 1.9e-5 at most (DPM-Solver++ on a
    # clipped cosine schedule, 16 steps), 2e-6 for most cases; a step of the wrong order or a padded sigma read
    # is 1e-3 or more. At zero terminal SNR the last step divides by a vanishing alpha and amplifies roundings
    # (8.9e-4 op by op at 1 step): there the exact loop is a program too, compiled as the padded one.
    zero_snr = {**case[1], **case[2]}.get("rescale_betas_zero_snr", False)
    exact_loop = (
        jax.jit(run_loop.__wrapped__, static_argnums=0, compiler_options=SERVING_EMITTERS)
        if zero_snr
        else jax.disable_jit()(run_loop.__wrapped__)
    )
    rng = np.random.default_rng(0)
    latents = jnp.asarray(rng.standard_normal(SHAPE).astype(np.float32))
    for steps in (1, 5, 16):
        if getattr(ours, "skip_prk_steps", True) is False and steps < 4:  # PNDM's Runge-Kutta start
            continue
        noises = jnp.asarray(rng.standard_normal((40, *SHAPE)).astype(np.float32))
        schedule = ours.schedule(steps)
        exact = exact_loop(ours, schedule, latents, noises[: schedule.num_steps])
        padded = run_padded_loop(ours, pad_schedule(schedule, 40), latents, noises)
        # Two programs: PNDM's 1-step transfer from t = 999 scales the sample by sqrt(alpha_bar_prev /
        # alpha_bar_t) ~ 15 and cancels most of it with the noise term, where their roundings (fused
        # differently) differ by 2.4e-6.
        bound = (1e-5 if case[0] == "pndm" else 1e-6) if zero_snr else 1e-4
        assert rel_err(padded, exact) <= bound, steps


def test_compiled_programs_are_counted_logged_and_bounded(caplog):
    """Every compilation counts once and logs its stage, shapes and seconds; with max_programs the least
    recently used program is dropped and compiles again when next needed."""
    import logging

    from meshserve.models.engine.programs import CompiledPrograms

    def scale(weights, x, *, power):
        return weights * x**power

    programs = CompiledPrograms("test", max_programs=2)
    w = jnp.float32(2.0)
    with caplog.at_level(logging.INFO, logger="meshserve.models.engine.programs"):
        for shape in [(2,), (3,), (2,), (4,), (3,)]:
            out = programs.run("scale", scale, {"power": 2}, w, jnp.ones(shape))
            assert out.shape == shape
    # (2,) and (3,) compile; (2,) hits; (4,) compiles and drops (3,); (3,) compiles again and drops (2,).
    assert programs.count == 4 and len(programs) == 2
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("test: compiled")]
    assert len(compiled) == 4 and "[(3,)]" in compiled[1] and " s, temporaries " in compiled[1]
    assert any("dropped" in r.getMessage() for r in caplog.records)


def test_compiled_programs_record_their_temporaries(caplog):
    """Each stage keeps the largest temporaries of its programs (XLA's memory analysis), logged with the
    compilation: a chain of two matmuls holds the first's [256, 256] fp32 result (256 KiB) while the second
    runs, so the program's temporaries are at least that."""
    import logging

    from meshserve.models.engine.programs import CompiledPrograms

    def chain(weights, x):
        return (x @ weights) @ weights

    programs = CompiledPrograms("test")
    w = jnp.ones((256, 256), jnp.float32)
    with caplog.at_level(logging.INFO, logger="meshserve.models.engine.programs"):
        programs.run("chain", chain, {}, w, jnp.ones((256, 256), jnp.float32))
        programs.run("chain", chain, {}, w, jnp.ones((8, 256), jnp.float32))
    assert programs.temp_bytes["chain"] >= 256 * 256 * 4, programs.temp_bytes
    logged = [r.getMessage() for r in caplog.records if "compiled chain" in r.getMessage()]
    assert len(logged) == 2 and logged[0].endswith(" MiB per device"), logged


def test_warm_up_compiles_the_schedulers_it_is_given(tiny_sdxl_path):
    """warm_up(schedulers=...) (a pool's warm_up_schedulers) compiles each one's denoise programs, CFG off and
    on; a call naming one then compiles nothing, and the folder's own scheduler by name adds no program."""
    pipe = load_pipeline(tiny_sdxl_path)
    pipe.warm_up([(W, H)])
    plain = pipe.compilations
    pipe.warm_up([(W, H)], schedulers=[None, "euler", "ddim"])
    # ddim's denoise program without and with CFG; euler is the folder's own.
    assert pipe.compilations == plain + 2
    before = pipe.compilations
    for scheduler, guidance in (("ddim", 1.0), ("ddim", 5.0), ("euler", 5.0)):
        out = pipe(
            "a cat", height=H, width=W, num_inference_steps=3, guidance_scale=guidance, scheduler=scheduler
        )
        assert not out.compiled, scheduler
    assert pipe.compilations == before

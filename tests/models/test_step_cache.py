"""The step cache (models/engine/step_cache.py): the decision rule on its own, then inside the compiled loop
of SDXL (deep features, TeaCache), Flux and Wan (first block, TeaCache): threshold 0 is the uncached model, a threshold skips steps
and counts them, a new threshold compiles nothing, the settings join the batch key, and a layout takes the
single device's decisions.

Random weights say nothing about the quality of a cached picture (issue 22 measures it on trained models); these
tests check the mechanics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshserve.models import load_pipeline
from meshserve.models.engine.common import PipelineError
from meshserve.models.engine.step_cache import (
    CacheSlot,
    _activate,
    after_first_block,
    before_blocks,
    deep_features,
    parse_cache,
    skipped_steps,
    take_turns,
)

# --------------------------------------------------------------------------------------------------
# The decision rule


def _rest(x):
    return 3.0 * x + 1.0


def _step(slot, state, x_in, first):
    slot.state = state
    with _activate(slot):
        out = after_first_block(x_in, first, _rest)
    return out, slot.new_state


def test_the_rule_computes_first_then_skips_while_the_first_residual_holds():
    x_in = jnp.ones((2, 4, 3))
    first = x_in + 0.5  # residual 0.5 everywhere
    slot = CacheSlot("first_block", jnp.float32(0.1))
    zeros = jnp.zeros_like(x_in)
    state = (zeros, zeros, jnp.bool_(False), jnp.zeros(2, jnp.int32))

    # Nothing computed yet: every block runs, the residuals are stored.
    out, state = _step(slot, state, x_in, first)
    np.testing.assert_allclose(out, _rest(first))
    np.testing.assert_allclose(state[1], _rest(first) - first)
    assert bool(state[2]) and state[3].tolist() == [0] * 2

    # The first residual moved 4 % (< 0.1): the stored tail is added to this step's first output.
    first2 = x_in + 0.52
    out2, state2 = _step(slot, state, x_in, first2)
    np.testing.assert_allclose(out2, first2 + state[1], rtol=1e-6)
    assert not np.allclose(out2, _rest(first2))
    assert state2[3].tolist() == [1] * 2
    np.testing.assert_allclose(state2[0], state[0])  # the reference stays the last computed step's

    # Moved 12 % from that reference (the skipped step's 4 % is not a new reference): all blocks run again.
    first3 = x_in + 0.56
    out3, state3 = _step(slot, state2, x_in, first3)
    np.testing.assert_allclose(out3, _rest(first3), rtol=1e-6)
    assert state3[3].tolist() == [1] * 2
    np.testing.assert_allclose(state3[0], first3 - x_in, rtol=1e-6)


def test_parts_that_take_turns_keep_their_own_state():
    """Wan 2.2's two experts: part A for t >= 0.5, part B below, each with its own state. B's first block moves
    its input exactly as A's did, so under one state B's first step would reuse A's tail; under its own it
    computes, then skips (threshold 1)."""

    def part(scale):
        return lambda x: after_first_block(x, x + 0.5, lambda first: scale * first)

    def model(x, t, i):
        return take_turns((t < 0.5).astype(jnp.int32), [part(3.0), part(5.0)], x)

    x = jnp.ones((2, 4, 3))
    slot = CacheSlot("first_block", jnp.float32(1.0))
    state = slot.init_state(model, x, jnp.float32(1.0), 0)
    outs = []
    for i, t in enumerate((0.9, 0.7, 0.3, 0.1)):
        out, state = slot.step(model, x, jnp.float32(t), i, state)
        outs.append(out)
    np.testing.assert_allclose(outs[0], 3.0 * (x + 0.5))  # A computes
    np.testing.assert_allclose(outs[1], outs[0])  # A skips: its own tail
    np.testing.assert_allclose(outs[2], 5.0 * (x + 0.5))  # B's first step computes
    np.testing.assert_allclose(outs[3], outs[2])  # B skips: its own tail
    assert skipped_steps(state).tolist() == [2, 2]  # both parts' skips, per row


def test_deep_features_reuse_the_deep_output_itself():
    """The UNet's form: the signal is the first down block's output, a skipped step returns the stored deep
    output (not a residual added to this step's input)."""
    slot = CacheSlot("deep_features", jnp.float32(0.1))
    first = jnp.full((1, 4, 4, 2), 2.0)
    state = (jnp.zeros_like(first), jnp.zeros_like(first), jnp.bool_(False), jnp.zeros(1, jnp.int32))

    def call(state, first):
        slot.state = state
        with _activate(slot):
            out = deep_features(first, _rest)
        return out, slot.new_state

    out, state = call(state, first)
    np.testing.assert_allclose(out, _rest(first))
    out2, state2 = call(state, first * 1.05)  # 5 % change: the stored deep output, as it was
    np.testing.assert_allclose(out2, _rest(first))
    assert state2[3].tolist() == [1] * 1
    out3, _ = call(state2, first * 1.2)  # 20 % from the reference: computed again
    np.testing.assert_allclose(out3, _rest(first * 1.2))


def test_teacache_sums_step_to_step_changes_and_reuses_the_whole_stack():
    """TeaCache: the signal's change from the previous step (not from the last computed one) is summed since
    the stack last ran; under the threshold the stack's stored residual is added to this step's input."""
    slot = CacheSlot("teacache", jnp.float32(0.1))
    x = jnp.full((2, 4, 3), 1.0)
    signal = jnp.full((2, 4, 3), 2.0)
    zeros = jnp.zeros_like(x)
    state = (zeros, zeros, jnp.bool_(False), jnp.zeros(2, jnp.int32), jnp.zeros(2))

    def call(state, x, signal):
        slot.state = state
        with _activate(slot):
            out = before_blocks(x, signal, _rest)
        return out, slot.new_state

    out, state = call(state, x, signal)  # nothing stored yet: the stack runs
    np.testing.assert_allclose(out, _rest(x))
    np.testing.assert_allclose(state[1], _rest(x) - x)
    assert state[3].tolist() == [0] * 2 and state[4].tolist() == [0.0] * 2

    x2 = x * 2  # the stored residual goes on this step's input
    out2, state2 = call(state, x2, signal * 1.04)  # moved 4 %: skipped
    np.testing.assert_allclose(out2, x2 + state[1], rtol=1e-6)
    assert state2[3].tolist() == [1] * 2 and state2[4].tolist() == pytest.approx([0.04] * 2, rel=1e-4)
    np.testing.assert_allclose(state2[0], signal * 1.04)  # the reference is always the previous step

    out3, state3 = call(state2, x2, signal * 1.04 * 1.04)  # another 4 %: 8 % in all, still skipped
    np.testing.assert_allclose(out3, x2 + state[1], rtol=1e-6)
    assert state3[3].tolist() == [2] * 2

    out4, state4 = call(state3, x2, signal * 1.04**3)  # 12 % in all: the stack runs, the sum restarts
    np.testing.assert_allclose(out4, _rest(x2), rtol=1e-6)
    assert state4[3].tolist() == [2] * 2 and state4[4].tolist() == [0.0] * 2


def test_each_row_decides_alone():
    """Two rows: the one that moved 4 % takes its stored tail, the one that moved 20 % computes (the blocks run
    for both); each row's reference and count are its own, so a row's output is what it gets alone."""
    x_in = jnp.ones((2, 4, 3))
    slot = CacheSlot("first_block", jnp.float32(0.1))
    zeros = jnp.zeros_like(x_in)
    _, state = _step(slot, (zeros, zeros, jnp.bool_(False), jnp.zeros(2, jnp.int32)), x_in, x_in + 0.5)
    first2 = x_in + jnp.array([0.52, 0.6]).reshape(2, 1, 1)
    out2, state2 = _step(slot, state, x_in, first2)
    np.testing.assert_allclose(out2[0], first2[0] + state[1][0], rtol=1e-6)  # row 0: skipped
    np.testing.assert_allclose(out2[1], _rest(first2[1]), rtol=1e-6)  # row 1: computed
    assert state2[3].tolist() == [1, 0]
    np.testing.assert_allclose(state2[0][0], state[0][0])  # row 0 keeps its reference
    np.testing.assert_allclose(state2[0][1], first2[1] - x_in[1], rtol=1e-6)  # row 1 takes the new one
    for row in (0, 1):  # each row alone: the same output and count
        slot1 = CacheSlot("first_block", jnp.float32(0.1))
        sub = jax.tree.map(lambda a, r=row: a[r : r + 1] if a.ndim else a, state)
        alone, alone_state = _step(slot1, sub, x_in[row : row + 1], first2[row : row + 1])
        np.testing.assert_allclose(out2[row : row + 1], alone, rtol=1e-6)
        assert alone_state[3].tolist() == [state2[3][row]]


def test_a_row_without_cfg_in_a_cfg_batch_decides_on_its_positive_half():
    """CFG rows are interleaved (uncond, cond): a CFG row's change is over both halves, a row without CFG (its
    negative half computed and thrown away) over its positive half alone, what it computes alone."""
    x_in = jnp.ones((4, 4, 3))
    slot = CacheSlot("first_block", jnp.float32(0.1), cfg_rows=jnp.array([True, False]))
    zeros = jnp.zeros_like(x_in)
    _, state = _step(slot, (zeros, zeros, jnp.bool_(False), jnp.zeros(2, jnp.int32)), x_in, x_in + 0.5)
    # Negative halves move 40 %, positive halves 4 %: the CFG row (mean 22 %) computes, the other skips.
    moved = jnp.array([0.7, 0.52, 0.7, 0.52]).reshape(4, 1, 1)
    _, state2 = _step(slot, state, x_in, x_in + moved)
    assert state2[3].tolist() == [0, 1]


def test_a_hook_of_another_method_just_runs():
    """Flux and Wan route through both DiT hooks: only the active method's acts."""
    x = jnp.ones((1, 2, 3))
    slot = CacheSlot("teacache", jnp.float32(1.0))
    slot.state = (x, x, jnp.bool_(True), jnp.zeros(1, jnp.int32), jnp.zeros(1))
    with _activate(slot):
        np.testing.assert_allclose(after_first_block(x, x + 1, _rest), _rest(x + 1))
        np.testing.assert_allclose(deep_features(x, _rest), _rest(x))


def test_without_an_active_cache_the_blocks_just_run():
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(after_first_block(x, x + 1, _rest), _rest(x + 1))
    np.testing.assert_allclose(before_blocks(x, x, _rest), _rest(x))


@pytest.mark.parametrize(
    "cache,match",
    [
        ({"method": "magcache"}, "method must be one of"),
        ({"threshold": 0.1}, "method must be one of"),
        ({"method": "first_block", "threshold": -0.1}, "between 0 and 1"),
        ({"method": "first_block", "threshold": 1.5}, "between 0 and 1"),
        ({"method": "first_block", "threshold": float("nan")}, "between 0 and 1"),
        ({"method": "first_block", "threshold": "0.1"}, "must be a number"),
        ({"method": "first_block", "threshold": True}, "must be a number"),
        ({"method": "first_block", "every": 2}, "takes 'method' and 'threshold'"),
        ("first_block", "must be a mapping"),
    ],
)
def test_bad_cache_settings_are_pipeline_errors(cache, match):
    with pytest.raises(PipelineError, match=match):
        parse_cache(cache, {"first_block": 0.08})


def test_defaults_fill_the_threshold():
    spec = parse_cache({"method": "first_block"}, {"first_block": 0.08})
    assert (spec.method, spec.threshold) == ("first_block", 0.08)
    assert parse_cache(None, {}) is None
    with pytest.raises(PipelineError, match="none \\(this model has none\\)"):
        parse_cache({"method": "first_block"}, {})


# --------------------------------------------------------------------------------------------------
# In the compiled loop

H = W = 32
STEPS = 6


@pytest.fixture(scope="module")
def sdxl(tiny_sdxl_path):
    return load_pipeline(tiny_sdxl_path)


@pytest.fixture(scope="module")
def flux(tiny_flux_dev_path):
    return load_pipeline(tiny_flux_dev_path)


@pytest.fixture(scope="module")
def wan(tiny_wan_path):
    return load_pipeline(tiny_wan_path)


METHODS = {
    "sdxl": ["deep_features", "teacache"],
    "flux": ["first_block", "teacache"],
    "wan": ["first_block", "teacache"],
}


def _kw(pipe):
    kw = dict(height=H, width=W, num_inference_steps=STEPS, seed=3, output_type="np")
    if pipe.family == "wan":
        kw["num_frames"] = 5
    return kw


@pytest.mark.parametrize(
    "family,method", [(family, method) for family, methods in METHODS.items() for method in methods]
)
def test_cache_in_the_loop(family, method, request, record_property):
    pipe = request.getfixturevalue(family)
    assert list(pipe.limits["cache"]) == METHODS[family]
    kw = _kw(pipe)
    plain = pipe("a red circle", **kw)
    assert plain.cached_steps is None

    # Threshold 0: no step is skipped, the output is the plain program's.
    exact = pipe("a red circle", cache={"method": method, "threshold": 0.0}, **kw)
    assert exact.cached_steps == [0]
    err = float(np.abs(exact.images - plain.images).max())
    record_property("threshold_0_max_abs_err", err)
    assert err <= 1e-5, err

    # The highest threshold skips steps (every one but the first for the first-block rule here; the tiny
    # random UNet's first down block moves more than 100 % on some step, and TeaCache's sum of step-to-step
    # changes passes 100 % within a few steps), and a new threshold is an input: it compiles nothing.
    before = pipe.compilations
    lazy = pipe("a red circle", cache={"method": method, "threshold": 1.0}, **kw)
    assert pipe.compilations == before
    record_property("threshold_1_cached_steps", lazy.cached_steps)
    every_but_first = method == "first_block"
    (skipped,) = lazy.cached_steps
    assert skipped == STEPS - 1 if every_but_first else 0 < skipped < STEPS
    assert np.abs(lazy.images - plain.images).max() > 1e-4  # skipping changed the output: the test can fail
    assert np.isfinite(lazy.images).all()

    # With CFG the uncond and cond rows share each step's decision.
    cfg = dict(kw, **({"true_cfg_scale": 4.0, "negative_prompt": "blurry"} if family == "flux" else {}))
    both = pipe("a red circle", cache={"method": method, "threshold": 1.0}, **cfg)
    (skipped,) = both.cached_steps
    assert skipped == STEPS - 1 if every_but_first else 0 < skipped < STEPS


def test_an_image_does_not_depend_on_what_it_is_batched_with(sdxl):
    """Each row decides alone (its own means, its own state): a CFG row and a row without CFG that skip on
    different steps give in one batch what each gives alone (one decision per batch, from means over every
    row, gave both rows one count here, 2, where the first skips 3 steps alone)."""
    kw = dict(height=H, width=W, num_inference_steps=8, output_type="np")
    cache = {"method": "deep_features", "threshold": 0.3}
    a = sdxl("a red circle", seed=1, guidance_scale=5.0, cache=cache, **kw)
    b = sdxl("a blue square", seed=2, guidance_scale=1.0, cache=cache, **kw)
    assert a.cached_steps != b.cached_steps  # the rows decide differently: the test can fail
    both = sdxl(["a red circle", "a blue square"], seed=[1, 2], guidance_scale=[5.0, 1.0], cache=cache, **kw)
    assert both.cached_steps == a.cached_steps + b.cached_steps
    assert float(np.abs(both.images[0] - a.images[0]).max()) <= 1e-5
    assert float(np.abs(both.images[1] - b.images[0]).max()) <= 1e-5


def test_cache_settings_join_the_batch_key(flux, tiny_sdxl_path):
    base = {"prompt": "x", "width": W, "height": H}
    plain = flux.batch_key(base)
    low = flux.batch_key({**base, "cache": {"method": "first_block", "threshold": 0.05}})
    default = flux.batch_key({**base, "cache": {"method": "first_block"}})
    assert len({plain, low, default}) == 3
    assert default == flux.batch_key({**base, "cache": {"method": "first_block", "threshold": 0.08}})


def test_a_method_of_another_family_is_refused(embedded_sdxl, flux):
    with pytest.raises(PipelineError, match=r"one of \['deep_features', 'teacache'\]"):
        embedded_sdxl("a cat", num_inference_steps=1, cache={"method": "first_block"})
    with pytest.raises(PipelineError, match=r"one of \['first_block', 'teacache'\]"):
        flux("a cat", num_inference_steps=1, height=H, width=W, cache={"method": "deep_features"})


def test_a_flux_without_double_blocks_offers_no_first_block_cache(tmp_path, monkeypatch):
    """Its "first block" would be no block: a residual of 0, every step after the first skipped."""
    from meshserve.models.flux import random_tiny

    monkeypatch.setattr(random_tiny, "TRANSFORMER", {**random_tiny.TRANSFORMER, "num_layers": 0})
    pipe = load_pipeline(random_tiny.write_random_flux(tmp_path / "flux"), dtype="float32")
    assert set(pipe.limits["cache"]) == {"teacache"}
    with pytest.raises(PipelineError, match=r"one of \['teacache'\]"):
        pipe("a cat", num_inference_steps=1, height=H, width=W, cache={"method": "first_block"})


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (XLA_FLAGS host device count)")
@pytest.mark.parametrize(
    "family,method",
    [("sdxl", "deep_features"), ("sdxl", "teacache"), ("flux", "first_block"), ("flux", "teacache")],
)
def test_a_layout_takes_the_single_device_decisions(family, method, request, record_property):
    """cfg2 x context2: the change is a reduction over sharded rows and tokens, replicated, so every device
    takes the branch one device takes (thresholds 0 and 1: all computed, most skipped)."""
    single = request.getfixturevalue(family)
    folder = request.getfixturevalue({"sdxl": "tiny_sdxl_path", "flux": "tiny_flux_dev_path"}[family])
    layout = load_pipeline(folder, mesh={"cfg": 2, "context": 2}, devices=jax.devices()[:4])
    cfg = {"true_cfg_scale": 4.0} if family == "flux" else {"guidance_scale": 5.0}
    kw = dict(_kw(single), negative_prompt="blurry", **cfg)
    results = {}
    for threshold in (0.0, 1.0):
        cache = {"method": method, "threshold": threshold}
        one, four = single("a red circle", cache=cache, **kw), layout("a red circle", cache=cache, **kw)
        assert one.cached_steps == four.cached_steps
        err = float(np.abs(one.images - four.images).max())
        results[threshold] = err
        assert err <= 1e-4, (threshold, err)
    record_property("layout_max_abs_err", results)


def test_warm_up_compiles_the_cached_programs(tiny_flux_dev_path):
    """warm_up(cache=[...]) (a pool's warm_up_cache) compiles each method's denoise programs, CFG off and on:
    a cached call at any threshold then compiles nothing."""
    pipe = load_pipeline(tiny_flux_dev_path)
    pipe.warm_up([(W, H)])
    plain = pipe.compilations
    pipe.warm_up([(W, H)], cache=["first_block"])
    assert pipe.compilations == plain + 2  # the cached denoise program without and with true CFG
    before = pipe.compilations
    for threshold, cfg in ((0.3, 1.0), (0.05, 4.0)):
        pipe(
            "a red circle",
            negative_prompt="blurry",
            true_cfg_scale=cfg,
            height=H,
            width=W,
            num_inference_steps=3,
            cache={"method": "first_block", "threshold": threshold},
        )
    assert pipe.compilations == before

"""Step caching inside the one compiled loop: skip most of the denoiser on steps where it would change little.

    pipe(prompt, cache={"method": "first_block", "threshold": 0.08})

First-block cache (the method of ParaAttention's FBCache and diffusers' FirstBlockCacheConfig): every step
runs the denoiser's first block. Its residual r = output - input is compared with r_ref, the residual of the
last step that ran every block: when mean|r - r_ref| / mean|r_ref| < threshold, the other blocks are skipped
and the residual they added on that step (tail = their output - their input) is added to the first block's
output instead. The reference moves only on a computed step, so small changes add up until one computes.

How it fits the compiled loop (models/engine/denoise_loop.py):
- The decision is a traced value: `lax.cond` picks "add the cached tail" or "run the other blocks", so the
  method is a program variant (like CFG on/off) and the threshold is an input: a new threshold never compiles.
- The decision is one per step for the whole model batch (the means run over every row, CFG halves included),
  so the rows of a batch share it and a pool puts only jobs with equal cache settings in one batch (the
  settings are in `batch_key`). The means are reductions to a replicated scalar, so every device of a layout
  takes the same branch: the collectives inside the skipped blocks are skipped everywhere or nowhere.
- The cache's state (r_ref, tail, whether a step computed yet, how many steps were skipped) rides in the
  loop's carry. Its shapes come from tracing the denoiser once abstractly (`init_state`).

A family supports it by routing its blocks through one of two hooks; without an active cache each is
rest(first), the plain model:
- `after_first_block(x_in, first, rest)` (method "first_block", the DiTs): x_in the first block's input,
  first its output, rest(first) the remaining blocks (the output head stays outside: it runs on every step).
- `deep_features(first, deep)` (method "deep_features", the UNet; DeepCache's idea, with the first-block
  rule deciding instead of a fixed interval): first the first down block's output, deep(first) everything
  down to the last up block's input. A skipped step runs conv_in, the first down block, the last up block and
  the output head, and reuses the deep features of the last step that computed them.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from numbers import Real

import jax
import jax.numpy as jnp

from meshserve.models.engine.common import PipelineError

_ACTIVE: contextvars.ContextVar[CacheSlot | None] = contextvars.ContextVar(
    "meshserve_step_cache", default=None
)


@dataclass(frozen=True)
class CacheSpec:
    """A call's cache settings: the method (static: it selects the program) and its threshold (traced)."""

    method: str
    threshold: float


def parse_cache(cache, defaults: Mapping[str, float]) -> CacheSpec | None:
    """`cache` as a call gives it (None, or {"method": ..., "threshold": ...}; threshold optional) -> a
    CacheSpec, checked against the model's methods and their default thresholds (`defaults`)."""
    if cache is None:
        return None
    if not isinstance(cache, Mapping):
        raise PipelineError(f"cache must be a mapping with a 'method', got {type(cache).__name__}")
    unknown = set(cache) - {"method", "threshold"}
    if unknown:
        raise PipelineError(f"cache takes 'method' and 'threshold', not {sorted(unknown)}")
    method = cache.get("method")
    if method not in defaults:
        raise PipelineError(
            f"cache method must be one of {sorted(defaults) or 'none (this model has none)'}, got {method!r}"
        )
    threshold = cache.get("threshold")
    if threshold is None:
        threshold = defaults[method]
    if isinstance(threshold, bool) or not isinstance(threshold, Real):
        raise PipelineError(f"cache threshold must be a number, got {threshold!r}")
    if not math.isfinite(threshold) or not 0 <= threshold <= 1:
        raise PipelineError(f"cache threshold must be between 0 and 1, got {threshold}")
    return CacheSpec(method, float(threshold))


class CacheSlot:
    """Trace-time exchange between the loop and the denoiser's blocks: the loop puts the carried state here
    before calling the model, `after_first_block` leaves the next state. `threshold`: a traced [] float32."""

    def __init__(self, threshold):
        self.threshold = threshold
        self.state = None
        self.new_state = None

    def init_state(self, model: Callable, x, t):
        """The state before the first step: zeros shaped by one abstract trace of `model(x, t)` (no compute)."""

        def probe():
            self.state = None
            with _activate(self):
                model(x, t)
            return self.new_state

        shapes = jax.eval_shape(probe)
        if shapes is None:
            raise ValueError("the denoiser never called after_first_block: it has no step cache")
        self.state = self.new_state = None
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def step(self, model: Callable, x, t, state):
        """model(x, t) with the cache's state in and out: (output, next state)."""
        self.state, self.new_state = state, None
        with _activate(self):
            out = model(x, t)
        if self.new_state is None:
            raise ValueError("the denoiser never called after_first_block: it has no step cache")
        new, self.state, self.new_state = self.new_state, None, None
        return out, new


@contextlib.contextmanager
def _activate(slot: CacheSlot):
    token = _ACTIVE.set(slot)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def skipped_steps(state) -> jax.Array:
    """The number of steps the cache skipped, from the loop's final cache state."""
    return state[3]


def after_first_block(x_in, first, rest: Callable):
    """A DiT's blocks after the first: rest(first), or, under an active cache on a step whose first block's
    residual (first - x_in) changed little, first + the residual the other blocks added when they last ran."""
    return _cached(first - x_in, first, rest, residual=True)


def deep_features(first, deep: Callable):
    """A UNet's deep part: deep(first) (the first down block's output -> the last up block's input), or, under
    an active cache on a step whose `first` changed little, the deep part's output when it last ran."""
    return _cached(first, first, deep, residual=False)


def _cached(signal, first, rest: Callable, *, residual: bool):
    """rest(first), or its stored result when `signal` moved less than the threshold since the last step that
    ran `rest` (stored as rest(first) - first with `residual`, else rest(first))."""
    slot = _ACTIVE.get()
    if slot is None:
        return rest(first)

    def stored_of(out, first):
        return out - first if residual else out

    if slot.state is None:  # init_state's abstract trace: only the shapes matter
        out = rest(first)
        slot.new_state = (signal, stored_of(out, first), jnp.bool_(False), jnp.int32(0))
        return out
    ref, stored, computed, skipped = slot.state
    s, s_ref = signal.astype(jnp.float32), ref.astype(jnp.float32)
    change = jnp.mean(jnp.abs(s - s_ref)) / jnp.maximum(jnp.mean(jnp.abs(s_ref)), 1e-12)
    skip = computed & (change < slot.threshold)

    def cached(first, signal):
        out = first + stored.astype(first.dtype) if residual else stored
        return out, ref, stored

    def computed_now(first, signal):
        out = rest(first)
        return out, signal.astype(ref.dtype), stored_of(out, first).astype(stored.dtype)

    out, ref, stored = jax.lax.cond(skip, cached, computed_now, first, signal)
    slot.new_state = (ref, stored, jnp.bool_(True), skipped + skip.astype(jnp.int32))
    return out

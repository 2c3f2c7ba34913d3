"""Step caching inside the one compiled loop: skip most of the denoiser on steps where it would change little.

    pipe(prompt, cache={"method": "first_block", "threshold": 0.08})

Three methods, each deciding per step whether the denoiser's expensive part runs or its last result is reused:

First-block cache ("first_block", the method of ParaAttention's FBCache and diffusers' FirstBlockCacheConfig):
every step runs the denoiser's first block. Its residual r = output - input is compared with r_ref, the residual of the
last step that ran every block: when mean|r - r_ref| / mean|r_ref| < threshold, the other blocks are skipped
and the residual they added on that step (tail = their output - their input) is added to the first block's
output instead. The reference moves only on a computed step, so small changes add up until one computes.

TeaCache ("teacache", Liu et al. 2024, "Timestep Embedding Tells: It's Time to Cache"): the signal is the first
block's modulated input (a DiT's: its normalised input shifted and scaled by the timestep embedding, one small
matmul; the UNet's: its first resnet's state where the timestep embedding is added, one conv), so a skipped
step runs no block at all. Its relative change from the previous step (not from
the last computed one) is summed over the steps since the blocks last ran; while the sum stays under the
threshold the blocks are skipped and the residual of the whole stack (output - input, from the last step that
ran it) is added to this step's input. The paper rescales each change by a polynomial fitted to one checkpoint
(its Flux.1-dev coefficients are meaningless for another model); here the change is used as measured, so a
threshold reads the same on every checkpoint of a family: the sum of relative L1 changes allowed between two
computed steps.

How it fits the compiled loop (models/engine/denoise_loop.py):
- The decision is a traced value: `lax.cond` picks "add the cached tail" or "run the other blocks", so the
  method is a program variant (like CFG on/off) and the threshold is an input: a new threshold never compiles.
- The decision is one per output row, as that row alone would take it: its means run over its own model rows
  (both CFG halves, or only the positive one of a row without CFG in a CFG batch, what it computes alone), and
  its state (reference, stored result, steps skipped, TeaCache's sum) is its own. The blocks are skipped when
  every row of the batch skips; when some row computes, the blocks run for all and each row that decided to
  skip still takes its stored result and keeps its state, so a row's output never depends on the rows batched
  with it (an audit saw a shared decision move an image by 124/255 against the same job alone). Whether all
  rows skip is a reduction to a replicated scalar, so every device of a layout takes the same branch: the
  collectives inside the skipped blocks are skipped everywhere or nowhere.
- The cache's state (per row: r_ref, tail, steps skipped, TeaCache's sum of changes since the row last computed;
  whether a step computed yet) rides in the loop's carry. Its shapes come from tracing the denoiser once
  abstractly (`init_state`).

A family supports a method by routing its blocks through the method's hook; without an active cache of that
method a hook is the plain model:
- `after_first_block(x_in, first, rest)` (method "first_block", the DiTs): x_in the first block's input,
  first its output, rest(first) the remaining blocks (the output head stays outside: it runs on every step).
- `deep_features(first, deep)` (method "deep_features", the UNet; DeepCache's idea, with the first-block
  rule deciding instead of a fixed interval): first the first down block's output, deep(first) everything
  down to the last up block's input. A skipped step runs conv_in, the first down block, the last up block and
  the output head, and reuses the deep features of the last step that computed them.
- `before_blocks(x, signal, blocks)` (method "teacache"): x the first block's input, signal its modulated
  input, blocks(x) the whole stack (which may itself route through `after_first_block` or `deep_features`).
  The UNet's stack runs from conv_in's output to the output head's input, so a skipped step runs only
  conv_in, the signal's conv and the head: on the embedded tiny SDXL this is what reaches the 1.5x target,
  where `deep_features` (which still runs the full-resolution first down and last up blocks) cannot
  (docs/step-cache.md).

A denoiser whose parts take turns by step (Wan 2.2's two experts) routes them through `take_turns(index,
parts, *args)`: each part keeps a cache state of its own, so a part compares its features only with its own
(the other expert's are no reference for it) and its first step always computes.
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
    before calling the model, the method's hook leaves the next state. `method`: static (it is part of the
    program); `threshold`: a traced [] float32; `cfg_rows`: None when the model batch is one model row per
    output row, else (CFG: rows interleaved uncond, cond) [B] bool, whether each output row runs CFG."""

    def __init__(self, method: str, threshold, cfg_rows=None):
        self.method = method
        self.threshold = threshold
        self.cfg_rows = cfg_rows
        self.state = None
        self.new_state = None

    def row_change(self, signal, ref) -> jax.Array:
        """[B] fp32, each output row's relative change mean|signal - ref| / mean|ref| over its own model rows:
        both CFG halves, or the positive one alone for a row without CFG (what it computes alone)."""
        s, s_ref = signal.astype(jnp.float32), ref.astype(jnp.float32)
        axes = tuple(range(1, s.ndim))
        num, den = jnp.mean(jnp.abs(s - s_ref), axis=axes), jnp.mean(jnp.abs(s_ref), axis=axes)
        if self.cfg_rows is not None:
            num, den = (
                jnp.where(self.cfg_rows, v.reshape(-1, 2).mean(axis=1), v.reshape(-1, 2)[:, 1])
                for v in (num, den)
            )
        return num / jnp.maximum(den, 1e-12)

    def model_rows(self, per_row, like) -> jax.Array:
        """[B] per output row -> broadcastable over `like` [model batch, ...] (each CFG pair takes its row's)."""
        if self.cfg_rows is not None:
            per_row = jnp.repeat(per_row, 2)
        return per_row.reshape(-1, *([1] * (like.ndim - 1)))

    def output_rows(self, model_batch: int) -> int:
        return model_batch // 2 if self.cfg_rows is not None else model_batch

    def init_state(self, model: Callable, x, t, i):
        """The state before the first step: zeros shaped by one abstract trace of `model(x, t, i)` (no compute)."""

        def probe():
            self.state = None
            with _activate(self):
                model(x, t, i)
            return self.new_state

        shapes = jax.eval_shape(probe)
        if shapes is None:
            raise ValueError(f"the denoiser has no {self.method!r} step cache (its hook was never called)")
        self.state = self.new_state = None
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def step(self, model: Callable, x, t, i, state):
        """model(x, t, i) with the cache's state in and out: (output, next state)."""
        self.state, self.new_state = state, None
        with _activate(self):
            out = model(x, t, i)
        if self.new_state is None:
            raise ValueError(f"the denoiser has no {self.method!r} step cache (its hook was never called)")
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
    """[B] int32, the steps the cache skipped for each output row, from the loop's final cache state."""
    if isinstance(state, PartStates):
        return sum(skipped_steps(part) for part in state.parts)
    return state[3]


@jax.tree_util.register_pytree_node_class
class PartStates:
    """The cache states of a denoiser's parts that take turns (`take_turns`), one per part."""

    def __init__(self, parts):
        self.parts = tuple(parts)

    def tree_flatten(self):
        return self.parts, None

    @classmethod
    def tree_unflatten(cls, _, parts):
        return cls(parts)


def take_turns(index, parts: list[Callable], *args):
    """parts[index](*args), `index` a traced int (one program, one part runs per step); under an active cache,
    each part with its own state (module docstring)."""
    slot = _ACTIVE.get()
    if slot is None:
        return jax.lax.switch(index, parts, *args)
    if slot.state is None:  # init_state's abstract trace: every part's state shapes
        states = []
        for part in parts:
            out = part(*args)
            states.append(slot.new_state)
        slot.new_state = PartStates(states)
        return out
    states = slot.state.parts

    def turn(i):
        def run(*args):  # the hook reads this part's state and leaves its next one; the others carry over
            slot.state, slot.new_state = states[i], None
            out = parts[i](*args)
            return out, PartStates([slot.new_state if j == i else s for j, s in enumerate(states)])

        return run

    out, new = jax.lax.switch(index, [turn(i) for i in range(len(parts))], *args)
    slot.state, slot.new_state = PartStates(states), new
    return out


def _slot_for(method: str) -> CacheSlot | None:
    slot = _ACTIVE.get()
    return slot if slot is not None and slot.method == method else None


def after_first_block(x_in, first, rest: Callable):
    """A DiT's blocks after the first: rest(first), or, under an active "first_block" cache on a step whose
    first block's residual (first - x_in) changed little, first + the residual the other blocks added when
    they last ran."""
    if _slot_for("first_block") is None:
        return rest(first)
    return _cached(first - x_in, first, rest, residual=True)


def deep_features(first, deep: Callable):
    """A UNet's deep part: deep(first) (the first down block's output -> the last up block's input), or, under
    an active "deep_features" cache on a step whose `first` changed little, the deep part's output when it
    last ran."""
    if _slot_for("deep_features") is None:
        return deep(first)
    return _cached(first, first, deep, residual=False)


def before_blocks(x, signal, blocks: Callable):
    """A denoiser's whole block stack: blocks(x), or, under an active "teacache" cache on a step where `signal`
    (the first block's modulated input) has moved less than the threshold in all since the stack last ran,
    x + the residual the stack added when it last ran."""
    slot = _slot_for("teacache")
    if slot is None:
        return blocks(x)
    if slot.state is None:  # init_state's abstract trace: only the shapes matter
        out = blocks(x)
        rows = slot.output_rows(x.shape[0])
        slot.new_state = (signal, out - x, jnp.bool_(False), jnp.zeros(rows, jnp.int32), jnp.zeros(rows))
        return out
    prev, stored, computed, skipped, moved = slot.state
    moved = moved + slot.row_change(signal, prev)
    skip = computed & (moved < slot.threshold)  # [B]: each row's own decision

    def cached(x):  # every row skips: no block runs
        return x + stored.astype(x.dtype), stored, moved

    def computed_now(x):  # some row computes: the rows that skip keep their stored residual and their sum
        out = blocks(x)
        keep = slot.model_rows(skip, out)
        out = jnp.where(keep, x + stored.astype(x.dtype), out)
        return out, jnp.where(keep, stored, (out - x).astype(stored.dtype)), jnp.where(skip, moved, 0.0)

    out, stored, moved = jax.lax.cond(jnp.all(skip), cached, computed_now, x)
    # The reference is always the previous step: TeaCache sums step-to-step changes.
    slot.new_state = (
        signal.astype(prev.dtype),
        stored,
        jnp.bool_(True),
        skipped + skip.astype(jnp.int32),
        moved,
    )
    return out


def _cached(signal, first, rest: Callable, *, residual: bool):
    """rest(first), or its stored result when `signal` moved less than the threshold since the last step that
    ran `rest` (stored as rest(first) - first with `residual`, else rest(first))."""
    slot = _ACTIVE.get()

    def stored_of(out, first):
        return out - first if residual else out

    if slot.state is None:  # init_state's abstract trace: only the shapes matter
        out = rest(first)
        rows = slot.output_rows(first.shape[0])
        slot.new_state = (signal, stored_of(out, first), jnp.bool_(False), jnp.zeros(rows, jnp.int32))
        return out
    ref, stored, computed, skipped = slot.state
    skip = computed & (slot.row_change(signal, ref) < slot.threshold)  # [B]: each row's own decision

    def reused(first):
        return first + stored.astype(first.dtype) if residual else stored

    def cached(first, signal):  # every row skips: `rest` does not run
        return reused(first), ref, stored

    def computed_now(first, signal):  # some row computes: the rows that skip keep their stored result and ref
        out = rest(first)
        keep = slot.model_rows(skip, out)
        new_ref = jnp.where(slot.model_rows(skip, signal), ref, signal.astype(ref.dtype))
        new_stored = jnp.where(keep, stored, stored_of(out, first).astype(stored.dtype))
        return jnp.where(keep, reused(first).astype(out.dtype), out), new_ref, new_stored

    out, ref, stored = jax.lax.cond(jnp.all(skip), cached, computed_now, first, signal)
    slot.new_state = (ref, stored, jnp.bool_(True), skipped + skip.astype(jnp.int32))
    return out

"""diffusers' `callback_on_step_end`: a Python function called after every step of the compiled loop, which sees
the latents and may replace them, or interrupt the call.

    def on_step_end(pipe, i, t, callback_kwargs):        # diffusers' signature
        latents = callback_kwargs["latents"]              # numpy, diffusers' layout (`latents_layout`)
        if i == 3:
            pipe._interrupt = True                        # as diffusers: stop here, decode these latents
        return {"latents": latents * 0.9}                 # optional: the loop goes on from these

    pipe(prompt, callback_on_step_end=on_step_end, callback_on_step_end_tensor_inputs=["latents"])

The latents handed over are a writable copy: changed in place, they are what the loop goes on from, as with
diffusers' tensors; returned latents take their place. As in diffusers' loops: `i` counts the steps this call
runs from 0 (an image-to-image call's first step is 0, whatever its strength), `t` is that step's timestep (a
numpy scalar), and the callback runs after the scheduler's step and, for a 4-channel inpaint, after the known
region is laid back. `pipe._interrupt = True` ends the loop after this step and the call decodes the latents it
has (diffusers' `interrupt`: the remaining steps are skipped); it is reset when a call starts. Only "latents"
can be read: the other names diffusers' pipelines offer (prompt_embeds, add_time_ids...) are inputs of the
compiled program, not values it can hand back per step (a callback object's own `tensor_inputs`, as diffusers'
PipelineCallback classes declare them, are checked the same way).

How it runs: the denoise program gets an io_callback after each step that takes the latents to the host and
returns the callback's (or the same) latents, and a flag that stops the loop. It is a variant of the program
(`step_end` in its static key), compiled only by calls that pass a callback: a call without one runs the
program it always ran. On a mesh, the latents are gathered to one device for the callback and spread again
(a debugging and research hook, not a fast path); one process only (a multi-host pool's followers have no
callback to call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from meshserve.models.engine.common import PipelineError

TENSOR_INPUTS = ("latents",)


def check_step_end(callback, tensor_inputs: Sequence[str] | None) -> tuple[str, ...]:
    """The call's callback_on_step_end and its tensor inputs -> the names to hand it. Without a list, a callback
    object's own `tensor_inputs` (diffusers' PipelineCallback classes declare theirs), else the latents."""
    if tensor_inputs is None and callback is not None:
        tensor_inputs = getattr(callback, "tensor_inputs", None)
        if tensor_inputs is not None:
            tensor_inputs = list(tensor_inputs)
    names = tuple(TENSOR_INPUTS if tensor_inputs is None else tensor_inputs)
    if isinstance(tensor_inputs, str) or not all(isinstance(k, str) for k in names):
        raise PipelineError("callback_on_step_end_tensor_inputs must be a list of names, e.g. ['latents']")
    unknown = [k for k in names if k not in TENSOR_INPUTS]
    if unknown:
        raise PipelineError(
            f"callback_on_step_end_tensor_inputs: {unknown} cannot be read per step; "
            f"supported: {list(TENSOR_INPUTS)}"
        )
    if callback is None:
        if tensor_inputs is not None:
            raise PipelineError("callback_on_step_end_tensor_inputs needs a callback_on_step_end")
        return names
    if not callable(callback):
        raise PipelineError(f"callback_on_step_end must be callable, got {type(callback).__name__}")
    if jax.process_count() > 1:
        raise PipelineError("callback_on_step_end runs in one process; this pipeline spans several")
    return names


class StepEndHook:
    """The host end of the loop's step-end callback, and the traced call that reaches it. One per pipeline;
    `listening` wires a call's callback (and the pipeline it is handed) to it for the length of the call. It
    holds neither between calls: it is the host function of every program compiled with it, which C++ keeps
    alive where Python's collector cannot see it (a pipeline it held would never be freed: previews.py)."""

    def __init__(self, latents_axes: tuple[int, ...] | None):
        self.latents_axes = latents_axes
        self.pipe = None
        self.callback: Callable | None = None
        self.names: tuple[str, ...] = TENSOR_INPUTS
        self.start, self.error, self.interrupted = 0, None, False

    def listening(self, pipe, callback, names: tuple[str, ...], start: int) -> _Listening:
        return _Listening(self, pipe, callback, names, start)

    def in_loop(self):
        """Traced: `step_end(latents, i, t) -> (latents, go)` for the denoise loop."""

        def step_end(latents, i, t):
            shapes = (jax.ShapeDtypeStruct(latents.shape, latents.dtype), jax.ShapeDtypeStruct((), jnp.bool_))
            return io_callback(self, shapes, i, t, latents, ordered=False)

        return step_end

    def __call__(self, i, t, latents):
        """On the host, after step i of the loop (its absolute index): the callback on diffusers' layout, its
        latents back in the loop's. An error stops the loop and is raised by the call (not by XLA's runtime)."""
        if self.error is not None:
            return latents, np.bool_(False)
        if self.callback is None:  # a program of this variant run without a listener: it just goes on
            return latents, np.bool_(True)
        try:
            # A writable copy: as with diffusers' tensors, what the callback changes in place is what the loop
            # goes on from (unless it returns other latents).
            view = np.array(np.transpose(latents, self.latents_axes or tuple(range(np.ndim(latents)))))
            kwargs = {"latents": view} if "latents" in self.names else {}
            out = self.callback(self.pipe, int(i) - self.start, np.asarray(t), kwargs)
            if out is not None and not isinstance(out, dict):
                raise PipelineError(
                    f"callback_on_step_end must return a dict or None, got {type(out).__name__}"
                )
            given = np.asarray((out or {}).get("latents", view))
            if given.shape != view.shape:
                raise PipelineError(
                    f"callback_on_step_end returned latents of shape {list(given.shape)}; they must keep the "
                    f"shape they were given, {list(view.shape)}"
                )
            if self.latents_axes is not None:
                given = np.transpose(given, np.argsort(self.latents_axes))
            latents = np.ascontiguousarray(given).astype(latents.dtype)
            if getattr(self.pipe, "_interrupt", False):
                self.interrupted = True
                return latents, np.bool_(False)
            return latents, np.bool_(True)
        except Exception as e:  # noqa: BLE001 - any error of the user's function is the call's
            self.error = e
            return latents, np.bool_(False)


class _Listening:
    """While entered: the hook calls `callback` with `pipe` (whose `_interrupt` is reset first)."""

    def __init__(self, hook: StepEndHook, pipe, callback, names, start: int):
        self.hook, self.pipe, self.callback, self.names, self.start = hook, pipe, callback, names, start

    def __enter__(self):
        hook = self.hook
        hook.pipe, hook.callback, hook.names, hook.start = self.pipe, self.callback, self.names, self.start
        hook.error, hook.interrupted = None, False
        self.pipe._interrupt = False
        return hook

    def __exit__(self, *exc):
        self.hook.pipe = self.hook.callback = None

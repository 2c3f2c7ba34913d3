"""A pipeline's compiled programs: compiled ahead of time, counted, logged, optionally bounded (LRU).

    programs = CompiledPrograms(max_programs=None, compiler_options=None)
    out = programs.run("denoise", fn, {"scheduler": s, "do_cfg": True}, weights, *inputs)

A program is keyed by its stage, its static settings and the shapes, dtypes and shardings of its request
inputs; the weights argument is the same for every call of a stage and is left out of the key (flattening a
UNet's state per call would cost more host time than the rest of the dispatch). Every compilation is counted
(`count`) and logged at INFO with its stage, input shapes, seconds and temporaries (XLA's memory analysis:
what the program allocates beside its arguments; the largest per stage in `temp_bytes`), which is what the
serving side exports as its compilation metric. With `max_programs` set, the least recently used program is
dropped past the bound (a pool that serves any size keeps its memory bounded; a dropped program compiles
again when next needed).
`compiler_options` (XLA options, e.g. {"xla_gpu_enable_latency_hiding_scheduler": True}) go to every program's
compilation, so that a pool can set them for its own programs without XLA_FLAGS, which bind every pool of the
process.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

import jax
import numpy as np

from meshserve.models.engine.host_callback_cache import cache_programs_with_host_callbacks

log = logging.getLogger(__name__)


def check_compiler_options(options: Mapping[str, bool | int | float | str] | None) -> None:
    """Raises ValueError with XLA's own reason ("No such compile option: ...", "... is not a valid bool value")
    when `options` would not compile: checked on a trivial program when a pipeline loads, not at its first
    request."""
    if not options:
        return
    try:
        jax.jit(lambda x: x + 1).lower(np.float32(0)).compile(compiler_options=dict(options))
    except Exception as e:  # JaxRuntimeError INVALID_ARGUMENT
        raise ValueError(f"xla_options: {str(e).removeprefix('INVALID_ARGUMENT: ')}") from None


def compiler_options(
    gpu_defaults: Mapping[str, bool | int | float | str],
    platform: str,
    pool_options: Mapping[str, bool | int | float | str] | None,
) -> dict | None:
    """A pipeline's XLA options: its family's `gpu_defaults` where its devices are GPUs, then the pool's own
    (which win, so a pool can put a default back)."""
    options = (dict(gpu_defaults) if platform == "gpu" else {}) | dict(pool_options or {})
    return options or None


def _signature(inputs) -> tuple:
    leaves, treedef = jax.tree.flatten(inputs)
    return treedef, tuple(
        (
            tuple(getattr(x, "shape", ())),
            str(getattr(x, "dtype", type(x).__name__)),
            getattr(x, "sharding", None),
        )
        for x in leaves
    )


class CompiledPrograms:
    def __init__(
        self,
        owner: str = "pipeline",
        max_programs: int | None = None,
        compiler_options: Mapping[str, bool | int | float | str] | None = None,
    ):
        if max_programs is not None and max_programs < 1:
            raise ValueError(f"max_programs must be at least 1, got {max_programs}")
        self.owner, self.max_programs = owner, max_programs
        self.compiler_options = dict(compiler_options) if compiler_options else None
        # Wherever JAX's persistent cache is on (enable_compilation_cache, or JAX's own setting such as
        # JAX_COMPILATION_CACHE_DIR), a denoise program read back from it must get this process's host
        # callbacks: JAX's own read loads an entry written by a meshserve process without them, and the first
        # step's callback then crashed the process (SIGSEGV, seen 2026-11-23 in a `load_pipeline` subprocess).
        cache_programs_with_host_callbacks()
        self._programs: OrderedDict[tuple, jax.stages.Compiled] = OrderedDict()
        self.count = 0  # programs compiled so far (a dropped and recompiled program counts again)
        self.seconds = 0.0  # spent compiling them
        self.by_stage: dict[str, int] = {}
        # The largest temporaries (bytes per device, XLA's memory analysis) of a program of each stage: what a
        # program allocates beside the weights and its inputs while it runs, which sizes a pool's memory.
        self.temp_bytes: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._programs)

    def run(self, stage: str, fn: Callable, static: Mapping, weights, *inputs):
        key = (stage, tuple(sorted(static.items())), _signature(inputs))
        program = self._programs.get(key)
        if program is None:
            program = self._compile(stage, fn, static, weights, inputs)
            self._programs[key] = program
            if self.max_programs is not None and len(self._programs) > self.max_programs:
                dropped = self._programs.popitem(last=False)[0]
                log.info(
                    "%s: dropped compiled %s program (LRU bound %d)",
                    self.owner,
                    dropped[0],
                    self.max_programs,
                )
        else:
            self._programs.move_to_end(key)
        return program(weights, *inputs)

    def _compile(self, stage, fn, static, weights, inputs):
        t0 = time.perf_counter()
        lowered = jax.jit(functools.partial(fn, **static)).lower(weights, *inputs)
        program = lowered.compile(compiler_options=self.compiler_options)
        seconds = time.perf_counter() - t0
        self.count += 1
        self.seconds += seconds
        self.by_stage[stage] = self.by_stage.get(stage, 0) + 1
        shapes = [tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(inputs)]
        settings = {k: (type(v).__name__ if hasattr(v, "step") else v) for k, v in static.items()}
        temp = _temp_bytes(program)
        if temp is not None:
            self.temp_bytes[stage] = max(temp, self.temp_bytes.get(stage, 0))
        log.info(
            "%s: compiled %s %s inputs %s in %.2f s, temporaries %s per device",
            self.owner,
            stage,
            settings,
            shapes,
            seconds,
            "unknown" if temp is None else f"{temp / 2**20:.1f} MiB",
        )
        return program


def _temp_bytes(program: jax.stages.Compiled) -> int | None:
    """The program's temporaries in bytes per device, or None where the backend gives no memory analysis."""
    try:
        return int(program.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001  (a backend or program kind without the analysis)
        return None

"""The pipeline contract every family implements, and the host-side machinery they share.

What the serving side reads (workers/runner.py relies on nothing else):

    family, task                     "sdxl", "text-to-image" ("text-to-video" adds frames)
    defaults                         {"width", "height", "num_inference_steps", "guidance_scale"}
    limits                           {"size_multiple", "min_size", "max_size", "min_steps", "max_steps", "max_n",
                                      "schedulers"} + "frames": {min_frames, max_frames, step, offset, default}
                                      for video (service/contract.py ModelLimits / FrameLimits)
    batch_fields                     the request fields that are per-batch keyword arguments of __call__
                                     (size, steps, scheduler; num_frames for video)
    batch_key(request) -> tuple      what must match for two jobs to share a batch (request: a plain mapping
                                     of the job's fields); a family adds its static settings (a text length)
    compiled_batch_size(rows, data)  the batch the rows run as: images pad to powers of two (few programs),
                                     video compiles the exact sizes the pool warms up (a padded row would
                                     cost a whole extra video)
    warm_up(buckets, batch_sizes,    compile every program those shapes need (video: each frame count)
            num_frames=)
    __call__(prompt, negative_prompt=, guidance_scale=, seed=, num_images_per_prompt=, output_type=,
             callback=, **{batch_fields}) -> PipelineOutput
    compilations                     programs compiled so far (each also logged with its shapes and seconds)

Per-row arguments (prompt, negative_prompt, guidance_scale, seed) take one value per output row, so jobs with
different prompts, guidance and seeds share one program. Errors in a request raise `PipelineError`; anything
else raised is an engine fault.

Shared here: seeds -> per-row key data placed with the batch sharding, schedules padded to MAX_STEPS and
cached per (scheduler, steps) on the pool's devices, the compiled-program cache, the step callback's host end,
request checks. The denoising loop itself is `denoise_loop.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshserve.models.checkpoints.loading import read_json
from meshserve.models.engine.common import GenerationCancelled, PipelineError
from meshserve.models.engine.denoise_loop import StepReporter
from meshserve.models.engine.programs import CompiledPrograms
from meshserve.models.engine.seeds import key_data
from meshserve.models.parallel.placement import Placement
from meshserve.models.schedulers import SCHEDULER_NAMES, make_scheduler, pad_schedule

# Every schedule is padded to this many steps, so the step count is a traced value and never compiles.
MAX_STEPS = 200
MAX_IMAGES = 8
OUTPUT_TYPES = ("pil", "np", "latent")


# A model folder may carry the settings it was made to be served with (the embedded model's training writes
# them): {"defaults": {"num_inference_steps": 20, "guidance_scale": 5.0}}. diffusers ignores the file.
SERVING_DEFAULTS_FILE = "meshserve.json"
_FOLDER_DEFAULT_TYPES = {"num_inference_steps": int, "guidance_scale": float, "width": int, "height": int}


def folder_serving_defaults(folder) -> dict:
    """The `defaults` of a model folder's meshserve.json ({} without one); PipelineError on a malformed one."""
    path = Path(folder) / SERVING_DEFAULTS_FILE
    if not path.is_file():
        return {}
    try:
        defaults = read_json(path).get("defaults", {})
        return {
            name: _FOLDER_DEFAULT_TYPES[name](value)
            for name, value in defaults.items()
            if name in _FOLDER_DEFAULT_TYPES and not isinstance(value, bool)
        }
    except (ValueError, TypeError, AttributeError) as e:
        raise PipelineError(f"{path}: malformed serving defaults ({e})") from e


def batch_bucket(rows: int, data: int = 1) -> int:
    """The next power of two >= rows, and a multiple of the mesh's data axis."""
    size = 1 << max(rows - 1, 0).bit_length()
    return -(-size // data) * data


class DiffusionPipeline:
    """Base of every family's pipeline. A subclass sets `family`, `task`, `scheduler_config` (a diffusers
    scheduler config dict) and `placement`, and implements `defaults`, `limits` and `__call__`."""

    family: str = ""
    task: str = "text-to-image"
    batch_fields: tuple[str, ...] = ("width", "height", "num_inference_steps", "scheduler")
    # Images: pad a batch to a power of two, which bounds a pool to log2(max_batch) + 1 programs per bucket.
    # A padded row is not free: on the tiny SDXL (CPU, 64x48, CFG, 4 steps, median of 5) batch 1 -> 2 took
    # denoise 133 -> 265 ms and decode 14 -> 27 ms, so a padded row costs ~a real row. Cheap for images;
    # for video that would be a whole extra video, so video families set False and compile the exact
    # batch sizes their pool warms up.
    pads_batches: bool = True
    scheduler_config: Mapping
    placement: Placement | None = None

    def __init__(self, *, max_programs: int | None = None):
        self.programs = CompiledPrograms(type(self).__name__, max_programs)
        self.step_reporter = StepReporter()
        self._schedulers: dict[str | None, object] = {}
        self._schedules = lru_cache(maxsize=256)(self._make_schedule)

    def split_modules(self, modules: Mapping[str, object]) -> None:
        """Split each loaded module into graph + state once (`self._graphs`, `self._states`, by name): the
        compiled programs take the state as an argument and merge inside, so no Python walks a module tree per
        call (nnx.jit would, every call)."""
        from flax import nnx

        self._graphs, self._states = {}, {}
        for name, module in modules.items():
            self._graphs[name], self._states[name] = nnx.split(module)

    # ---------------------------------------------------------------------------------------------
    # The contract's generic parts

    @property
    def defaults(self) -> dict:
        raise NotImplementedError

    @property
    def limits(self) -> dict:
        raise NotImplementedError

    def __call__(self, prompt, **kwargs):
        raise NotImplementedError

    def batch_key(self, request: Mapping) -> tuple:
        return tuple(request.get(name) for name in self.batch_fields)

    def compiled_batch_size(self, rows: int, data: int = 1) -> int:
        return batch_bucket(rows, data) if self.pads_batches else rows

    @property
    def compilations(self) -> int:
        return self.programs.count

    def warm_up(
        self,
        buckets: Sequence[tuple[int, int]] | None = None,
        batch_sizes: Sequence[int] = (1,),
        num_inference_steps: int | None = None,
        num_frames: Sequence[int] | None = None,
    ) -> float:
        """Compiles every stage for each (width, height) bucket and batch size, with and without CFG, and for a
        video family each of `num_frames` (None: its default frame count; a frame count is a shape).
        One step is enough: the step count is traced (num_inference_steps is accepted for the old callers)."""
        t0 = time.perf_counter()
        d = self.defaults
        if "frames" in self.limits:
            frame_counts = [{"num_frames": int(n)} for n in num_frames or [self.limits["frames"]["default"]]]
        elif num_frames:
            raise PipelineError(f"{self.family} makes images: it takes no num_frames to warm up")
        else:
            frame_counts = [{}]
        for width, height in buckets or [(d["width"], d["height"])]:
            for extra in frame_counts:
                for b in batch_sizes:
                    for g in sorted({d["guidance_scale"], 1.0}):
                        self(
                            [""] * b,
                            height=height,
                            width=width,
                            num_inference_steps=1,
                            guidance_scale=g,
                            seed=0,
                            output_type="np",
                            **extra,
                        )
        return time.perf_counter() - t0

    # ---------------------------------------------------------------------------------------------
    # Shared host machinery

    def scheduler(self, name: str | None):
        """The scheduler object for a name (None: the folder's own), made once: it is a static argument of
        the denoise program, so reusing the instance keeps the program cache hit."""
        if name not in self._schedulers:
            try:
                self._schedulers[name] = make_scheduler(name, self.scheduler_config)
            except ValueError as e:
                raise PipelineError(str(e)) from None
        return self._schedulers[name]

    def schedule(self, name: str | None, steps: int):
        """(scheduler, padded schedule on the pool's devices, the steps it really runs), cached per
        (name, steps): a request computes nothing on the host for its schedule."""
        return self._schedules(name, int(steps))

    def _make_schedule(self, name, steps):
        sched = self.scheduler(name)
        schedule = sched.schedule(steps)
        real = int(schedule.timesteps.shape[0])  # DPM-Solver's clipped schedules can be shorter
        return sched, self.put_replicated(pad_schedule(schedule, self.limits["max_steps"])), real

    def put_replicated(self, tree):
        if self.placement is None:
            return jax.device_put(tree)
        return jax.device_put(tree, NamedSharding(self.placement.mesh, P()))

    def put_batch(self, x: np.ndarray) -> jax.Array:
        """A host array [B, ...] straight into its batch sharding on the pool's devices (no device-0 copy)."""
        x = np.asarray(x)
        if self.placement is None:
            return jax.device_put(x)
        return jax.device_put(x, self.placement.batch_spec(x.shape[0], x.ndim))

    def put_keys(self, seeds: list[int]) -> jax.Array:
        return self.put_batch(key_data(seeds))

    def constrain(self, x):
        return self.placement.constrain_batch(x) if self.placement else x

    def run_denoise(self, total: int, callback: Callable | None, program: Callable, *args):
        """Runs a denoise program with `callback(step, total)` wired to its step callback; raises
        GenerationCancelled when the callback stopped it."""
        self.step_reporter.listener, self.step_reporter.total = callback, total
        try:
            latents, done = program(*args)
            done = int(done)
        finally:
            self.step_reporter.listener = None
        if done < total:
            raise GenerationCancelled(f"stopped after {done} of {total} steps")
        return latents

    def check_request(self, height: int, width: int, steps: int, n: int, output_type: str) -> None:
        limits = self.limits
        m = limits["size_multiple"]
        for name, value in (("height", height), ("width", width)):
            if value % m or value < m:
                raise PipelineError(f"{name} must be a positive multiple of {m}, got {value}")
        if not limits["min_steps"] <= steps <= limits["max_steps"]:
            raise PipelineError(
                f"num_inference_steps must be between {limits['min_steps']} and {limits['max_steps']}, "
                f"got {steps}"
            )
        if not 1 <= n <= limits["max_n"]:
            raise PipelineError(f"num_images_per_prompt must be between 1 and {limits['max_n']}, got {n}")
        if output_type not in OUTPUT_TYPES:
            raise PipelineError(f"output_type must be 'pil', 'np' or 'latent', got {output_type!r}")


def to_host(x) -> np.ndarray:
    """A device array as a numpy array on this host. An array that spans the devices of several processes (a
    multi-host pool: workers/multihost.py) cannot be read by np.asarray; it is all-gathered instead, a
    collective that every process of the group calls (they all run the same pipeline call) and that gives each
    of them the whole array. Every family turns its outputs into numpy with this."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def image_limits(size_multiple: int, default_size: int) -> dict:
    """The limits of a text-to-image family (sizes in pixels)."""
    return {
        "size_multiple": size_multiple,
        "min_size": size_multiple,
        "max_size": max(2048, default_size * 2),
        "min_steps": 1,
        "max_steps": MAX_STEPS,
        "max_n": MAX_IMAGES,
        "schedulers": list(SCHEDULER_NAMES),
    }

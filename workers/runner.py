"""The runner interface between a pool's job loop and a model: load, warm_up, run(batch), shutdown.

What crosses the boundary is plain data: a batch of `RunRequest`s (one per job, already normalised by the
service: every field set) goes in, one `RunResult` per job with encoded bytes comes out. The job loop knows
nothing of JAX; the runner knows nothing of Redis. `run` is blocking and is called from the pool's own
thread; its `callback(step, total)` fires after every denoise step and stops the batch by returning False.

The job loop calls `run` in two halves so that encoding never holds the devices: `generate` (on the pool
thread: the model's part, ending in one uint8 `Generated` per job) and `encode_job` (on an encoder thread:
PNG / MP4 bytes), so the pool thread starts the next batch while the last one's outputs are encoded
(docs/outputs.md). A runner that only implements `run` (the fake, a custom one) is run whole by `generate`.

`PipelineRunner` wraps `meshserve.models.load_pipeline` for every family the models package serves, through
the pipeline contract alone (models/engine/pipeline.py: defaults, limits, row_fields, batch_fields,
batch_key, compiled_batch_size, warm_up, __call__); other runners are picked by name (`runner:` in pools.yaml).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshserve.limits import output_formats
from meshserve.service.contract import (
    DEFAULT_FPS,
    JobParams,
    ModelDefaults,
    ModelInfo,
    ModelLimits,
    OutputBlob,
)
from meshserve.service.image_inputs import ImageInputError, decode_image
from meshserve.service.input_store import InputStore
from meshserve.service.lora_sources import LoraSource
from meshserve.workers.adapters import Adapters, LoraLoadError
from meshserve.workers.encoding import can_encode, encode_output

StepCallback = Callable[[int, int], bool | None]
# Live previews: (job id, output index, step, total steps, uint8 [h, w, 3]) from the pool thread, when due.
PreviewCallback = Callable[[str, int, int, int, np.ndarray], None]

# Pools of one process load their models one at a time. transformers 5's lazy top-level module is not
# thread-safe: four threads doing `from transformers import CLIPTokenizer` at once raised ImportError in 3 of 3
# runs here (transformers 5.23), which is what a flux pool and an sdxl pool starting together hit. Loading is
# reading weights (bandwidth-bound either way); compiling (warm_up) still runs on every pool at once.
_LOAD_LOCK = threading.Lock()


class Cancelled(Exception):  # noqa: N818 - the name says what happened, as GenerationCancelled does
    """The step callback returned False: the batch stopped between two steps."""


class InvalidRequest(Exception):
    """A request this runner can never serve (bad size, unknown scheduler): fail the job now, don't retry."""


@dataclass(frozen=True)
class RunRequest:
    """One job as the runner sees it: its id and its normalised parameters (every field set by the service),
    and for a job with image inputs the decoded image and mask (`read_inputs`), or why they could not be read
    (`missing`: the runner fails that job with it)."""

    job_id: str
    params: JobParams
    image: Any = None  # PIL RGB image
    mask: Any = None  # PIL L image, the image's size: white repaints
    last_image: Any = None  # PIL RGB image: the video's last frame (Wan 2.1 FLF2V, Wan 2.2's I2V experts)
    control_image: Any = None  # PIL RGB image: a control model's edge or depth map (FLUX.1 Canny / Depth)
    missing: str | None = None
    tenant: str | None = None  # who submitted it: the scope of its texts in the pool's prompt cache
    # A part of a job too big for one batch (`row_parts`): the index of its first output in the job.
    first_output: int = 0

    def seeds(self) -> list[int]:
        # Image i of a job uses seed + i: a client that re-submits with a returned seed and n=1 gets that image.
        return [self.params.seed + i for i in range(self.params.n)]


@dataclass
class Generated:
    """One job's outputs as they leave the model, before encoding: uint8 [n, H, W, 3] (video [n, F, H, W, 3];
    float in [0, 1] is accepted too), its seeds, the batch's stage timings."""

    job_id: str
    arrays: np.ndarray
    seeds: list[int]
    timings: dict[str, float] = field(default_factory=dict)
    compiled: bool = False
    # Steps a step cache skipped (the fewest of the job's rows; None: no cache asked).
    cached_steps: int | None = None


@dataclass
class RunResult:
    job_id: str
    outputs: list[OutputBlob]  # encoded bytes, ready for Store.complete
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds: text_encode, denoise, ...
    compiled: bool = False  # this call compiled a new program (a bucket/batch size not warmed up)
    cached_steps: int | None = None  # steps a step cache skipped (None: the job asked for none)


class Runner(ABC):
    """One model on one pool's devices."""

    def __init__(self, name: str):
        self.name = name

    @abstractmethod
    def load(self) -> None:
        """Read weights onto the pool's devices."""

    @abstractmethod
    def info(self) -> ModelInfo:
        """What the pool registry publishes (family, task, defaults, limits); valid after load()."""

    def warm_up(
        self,
        buckets: Sequence[tuple[int, int]],
        batch_sizes: Sequence[int],
        num_inference_steps: int | None,
        frames: Sequence[int] = (),
        tasks: Sequence[str] | None = None,
        cache: bool = False,
    ) -> float:
        """Compile the programs for these (width, height) buckets and batch sizes (a video model: with each of
        these frame counts; none: its default), for each of `tasks` (None: the text task), with `cache` each
        step cache method's too; returns seconds spent."""
        return 0.0

    def batch_key(self, params: JobParams) -> tuple:
        """The job fields that must match for two jobs to share a batch (one compiled program; with image
        inputs one task and one strength: one image_encode program, one start step)."""
        return (
            *image_key(params),
            params.width,
            params.height,
            params.num_frames,
            params.num_inference_steps,
            params.scheduler,
        )

    # Whether `run` takes `previews=` (live previews: the jobs' `preview_every`, docs/previews.md).
    takes_previews = False

    # The pool's max_batch, set by load_runners: the most rows one call of the model runs (the device memory a
    # pool is sized for). A job with more images (n up to the model's max_n) runs in parts of at most this many.
    max_rows: int | None = None

    # LoRA adapters (docs/lora.md, "Served"): the pool's bookkeeping (workers/adapters.py), set by load_runners
    # for a runner that takes them; the runner's own part is loading, unloading and naming the resident ones.
    adapters: Adapters | None = None
    takes_loras = False

    def fetch_lora(self, source: LoraSource) -> LoraSource:
        """Bring an adapter's file where `load_lora` reads it, without touching the devices -> a local source;
        LoraLoadError when it cannot. Any thread: the pool runs it beside its jobs (a download must not hold a
        batch)."""
        return source

    def load_lora(self, name: str, source: LoraSource, *, load_into_transformer_2: bool = False) -> dict:
        """Load an adapter onto the devices -> {"rank", "bytes", ...}; LoraLoadError when it cannot.
        `load_into_transformer_2`: into Wan 2.2's low-noise expert (diffusers' argument)."""
        raise LoraLoadError(f"{self.name} takes no LoRA adapters")

    def unload_lora(self, name: str) -> None:  # noqa: B027 - only runners that take adapters hold any
        """Forget an adapter."""

    def resident_loras(self) -> list[str]:
        """The adapters on the devices now, least recently used first."""
        return []

    def touch_loras(self, names: list[str]) -> None:  # noqa: B027 - no LRU without adapters
        """Mark these adapters used now (the last to be evicted)."""

    def lora_slots(self) -> int:
        """How many adapters can be resident at once."""
        return 0

    def keep_prompt_cache(self, max_bytes: int) -> None:  # noqa: B027 - optional: a runner with text encoders
        """Keep up to `max_bytes` of text-encoder outputs on the devices (the pool's `prompt_cache_mb`)."""

    @abstractmethod
    def run(self, batch: Sequence[RunRequest], callback: StepCallback | None = None) -> list[RunResult]:
        """Generate every request of a compatible batch (equal `batch_key`s) together.
        Raises Cancelled when callback returns False, InvalidRequest for a request it can never serve."""

    def generate(self, batch: Sequence[RunRequest], callback: StepCallback | None = None, **previews):
        """`run`'s model half, on the pool thread: one `Generated` (not yet encoded) or `RunResult` per job, in
        the batch's order (`encode_job` makes either a RunResult). Default: `run` whole."""
        return self.run(batch, callback, **previews)

    def shutdown(self) -> None:  # noqa: B027 - optional hook: most runners hold nothing to free
        """Free device memory; the runner is not used again."""

    @property
    def compilations(self) -> int:
        """Programs compiled so far (for the compilation metric); 0 for runners that compile nothing."""
        return 0


class PipelineRunner(Runner):
    """Any family `meshserve.models.load_pipeline` knows, on the pool's device slice and mesh."""

    def __init__(
        self,
        name: str,
        path: str | None,
        dtype: str,
        mesh: dict[str, int] | None,
        devices: list | None,
        **options,
    ):
        super().__init__(name)
        self.path, self.dtype, self.mesh, self.devices, self.options = path, dtype, mesh, devices, options
        self.pipe = None

    def load(self) -> None:
        from meshserve.models import load_pipeline  # JAX is imported only by a worker that runs a real model
        from meshserve.models.registry import EMBEDDED_MODELS

        path = self.path
        if path is None and self.name in EMBEDDED_MODELS:  # `tiny-wan: {}` serves tiny-wan, not tiny-sdxl
            path = f"embedded:{self.name}"
        with _LOAD_LOCK:
            self.pipe = load_pipeline(
                path, dtype=self.dtype, mesh=self.mesh, devices=self.devices, **self.options
            )

    takes_loras = True

    def fetch_lora(self, source: LoraSource) -> LoraSource:
        if source.kind != "hub":
            return source
        from meshserve.models import PipelineError
        from meshserve.models.lora.formats import download_from_hub

        # Fetched here, so that the library reads exactly this file: given the id, it would first look for a
        # folder of that name relative to the working directory (outside the LoRA root).
        try:
            return LoraSource("path", str(download_from_hub(source.value)))
        except PipelineError as e:
            raise LoraLoadError(str(e)) from e

    def load_lora(self, name: str, source: LoraSource, *, load_into_transformer_2: bool = False) -> dict:
        from meshserve.models import PipelineError

        # Only Wan 2.2's two experts take the argument (as diffusers' loader mixins: the others have no such
        # parameter); their limits say so.
        expert = {"load_into_transformer_2": True} if load_into_transformer_2 else {}
        if expert and not (self.pipe.limits.get("loras") or {}).get("load_into_transformer_2"):
            raise LoraLoadError(
                f"load_into_transformer_2: {self.name} has no transformer_2 (Wan 2.2's experts)"
            )
        try:
            return self.pipe.load_lora(name, self.fetch_lora(source).value, **expert)
        except PipelineError as e:
            raise LoraLoadError(str(e)) from e

    def unload_lora(self, name: str) -> None:
        self.pipe.unload_lora(name)

    def resident_loras(self) -> list[str]:
        return list(self.pipe.loras)

    def touch_loras(self, names: list[str]) -> None:
        self.pipe.lora.rows([{"name": n} for n in names], 1, 1)  # marks them used; nothing runs

    def lora_slots(self) -> int:
        return int(self.pipe.lora.slots)

    def info(self) -> ModelInfo:
        limits = dict(self.pipe.limits, prompt_2=self.pipe.second_prompt)
        # The formats this worker can write (an mp4 needs PyAV): a request for another is refused by the API.
        limits["output_formats"] = [f for f in output_formats(limits) if can_encode(f)]
        if limits.get("strength"):  # so that the API refuses a strength that would run no step (422)
            limits["strength"] = {**limits["strength"], "rule": getattr(self.pipe, "strength_rule", None)}
        return ModelInfo(
            id=self.name,
            family=self.pipe.family,
            task=self.pipe.task,
            defaults=ModelDefaults(**self.pipe.defaults),
            limits=ModelLimits(**limits),
        )

    def warm_up(
        self, buckets, batch_sizes, num_inference_steps, frames=(), tasks=None, cache=False, schedulers=()
    ) -> float:
        # One step is enough whatever num_inference_steps says: the step count is traced.
        buckets = list(buckets) or [(self.pipe.defaults["width"], self.pipe.defaults["height"])]
        batch_sizes = sorted({self.pipe.compiled_batch_size(b, self._data) for b in batch_sizes})
        seconds = self.pipe.warm_up(
            buckets=buckets,
            batch_sizes=batch_sizes,
            num_frames=list(frames) or None,
            output_type="uint8",  # the decode program `generate` runs: the only one the pool compiles
            **({"tasks": list(tasks)} if tasks else {}),
            # The pool's warm_up_cache: every step cache method's denoise programs too.
            cache=list(self.pipe.limits.get("cache") or {}) if cache else (),
            # The pool's warm_up_schedulers, besides the folder's own (None).
            schedulers=[None, *schedulers],
        )
        # The live previews' latent-to-RGB map, fitted on the folder's VAE once per load (docs/previews.md).
        self.pipe.previews.prepare()
        return float(seconds + self.pipe.previews.fit_seconds)

    def batch_key(self, params: JobParams) -> tuple:
        # The pipeline's key (its batch fields; with image tasks, task and strength), read from the job in
        # diffusers' names; ours in front, so that jobs of different tasks or strengths never share a call
        # whatever the pipeline's key leaves out (a one-task model's leaves out the strength).
        request = {**params.model_dump(), "mask_image": params.mask}
        return (*image_key(params), *self.pipe.batch_key(request))

    @property
    def _data(self) -> int:
        return (self.mesh or {}).get("data", 1)

    takes_previews = True

    def keep_prompt_cache(self, max_bytes: int) -> None:
        from meshserve.models.engine.prompt_cache import PromptCache
        from meshserve.workers import metrics

        self.pipe.prompt_cache = PromptCache(max_bytes)
        metrics.PROMPT_CACHES.watch(self.name, self.pipe.prompt_cache)

    def run(self, batch, callback=None, previews: PreviewCallback | None = None) -> list[RunResult]:
        return [
            encode_job(req, g) for req, g in zip(batch, self.generate(batch, callback, previews), strict=True)
        ]

    def generate(self, batch, callback=None, previews: PreviewCallback | None = None) -> list[Generated]:
        for req in batch:  # an input gone from the store: that job fails (alone: the loop retries the rest)
            if req.missing is not None:
                raise InvalidRequest(req.missing)
        if self.adapters is not None:  # every adapter the batch names on the devices (workers/adapters.py)
            self.adapters.ensure([[lora.name for lora in req.params.loras] for req in batch])
        calls = row_parts(batch, self.max_rows)
        if len(calls) == 1:
            return self._generate(batch, callback, previews)
        # More rows than the pool's max_batch (one job's n, the batcher never joins such jobs): one call per
        # part, in order; the step callback sees the job's steps spread over all of them, so progress never
        # goes back, and a cancel stops the part running. Every row has its own seed's noise: parts change no
        # image.
        parts = []
        for i, call in enumerate(calls):
            parts += self._generate(call, _part_callback(callback, i, len(calls)), previews)
        return join_parts(batch, parts)

    def _generate(self, batch, callback, previews: PreviewCallback | None) -> list[Generated]:
        """One call of the pipeline for the batch's rows (at most max_rows of them)."""
        from meshserve.models import GenerationCancelled, PipelineError

        first = batch[0].params.model_dump()
        # One output per row: jobs with different n, prompts, negative prompts, seeds, the pipeline's row
        # fields (guidance; Flux: true_cfg_scale) and its per-prompt texts and text fields (prompt_2; SDXL:
        # clip_skip) share one program. A negative prompt of None is the family's empty negative (SDXL: zeros).
        second = ("prompt_2", "negative_prompt_2") if self.pipe.second_prompt else ()
        texts = ("prompt", "negative_prompt", *second, *self.pipe.text_fields)
        rows = {name: [] for name in (*texts, *self.pipe.row_fields, *self.pipe.pair_fields)}
        seeds, scopes = [], []
        for req in batch:
            for name, values in rows.items():
                value = getattr(req.params, name)
                # A job admitted on a card without the field: the model's default, or, for a field that
                # falls back to another (Wan 2.2's guidance_scale_2), None: the pipeline takes that row's.
                fallback = name in getattr(self.pipe, "row_field_fallbacks", {})
                if value is None and name in self.pipe.row_fields and not fallback:
                    value = self.pipe.defaults[name]
                values += [value] * req.params.n
            seeds += req.seeds()
            scopes += [req.tenant] * req.params.n
        # The pipeline says what batch the rows run as (images: padded to a power of two and a multiple of
        # the data axis; video: the exact size). Padding rows repeat the first row and are dropped after
        # decoding; every row has its own seed's noise, so they change nothing in the real rows.
        real = len(seeds)
        pad = self.pipe.compiled_batch_size(real, self._data) - real
        rows = {name: values + values[:1] * pad for name, values in rows.items()}
        # The per-batch arguments are the ones the pipeline names (size, steps, scheduler, frames...).
        settings = {name: first[name] for name in self.pipe.batch_fields if first.get(name) is not None}
        # A custom schedule (diffusers' sigmas / timesteps) is the batch's too: it is in the batch key.
        settings |= {name: first[name] for name in self.pipe.schedule_fields if first.get(name) is not None}
        try:
            out = self.pipe(
                rows.pop("prompt"),
                seed=seeds + seeds[:1] * pad,
                num_images_per_prompt=1,
                # Converted on the device: a quarter of float32's bytes cross to the host (docs/outputs.md).
                output_type="uint8",
                callback=callback,
                **image_arguments(batch, pad),
                **lora_arguments(batch, pad),
                # The step cache: one per batch (its settings are in the batch key).
                **({"cache": first["cache"]} if first.get("cache") else {}),
                # A row's texts are cached for its own tenant only (models/engine/prompt_cache.py, "Scopes").
                **(
                    {"prompt_cache_scope": scopes + scopes[:1] * pad}
                    if getattr(self.pipe, "prompt_cache", None) is not None
                    else {}
                ),
                **self._previews(batch, pad, previews),
                **rows,
                **settings,
            )
        except GenerationCancelled as e:
            raise Cancelled(str(e)) from e
        except PipelineError as e:
            # Only the pipeline's own request checks are the job's fault. Any other error (a ValueError
            # from a layout, a trace or a shape included) is the engine's: retried, then dead-lettered.
            raise InvalidRequest(str(e)) from e
        images = np.asarray(out.images)[:real]  # [B, H, W, 3] or [B, F, H, W, 3]
        seeds, timings = list(out.seeds)[:real], dict(out.timings)
        cached = None if out.cached_steps is None else list(out.cached_steps)[:real]
        return split_rows(batch, images, seeds, timings, bool(out.compiled), cached)

    def _previews(self, batch, pad: int, previews: PreviewCallback | None) -> dict:
        """The pipeline's preview arguments: each row's period (from the jobs: the same on every process of a
        multi-host pool, so all run one program) and a callback naming each due row's job and output."""
        every = [req.params.preview_every for req in batch for _ in range(req.params.n)]
        if not any(every):
            return {}
        owners = [(req.job_id, req.first_output + i) for req in batch for i in range(req.params.n)]

        def on_preview(step: int, total: int, rows: dict) -> None:
            for row, pixels in rows.items():
                if row < len(owners):  # padding rows have no job
                    previews(*owners[row], step, total, pixels)

        return {"preview_every": every + [0] * pad, "preview_callback": on_preview if previews else None}

    def shutdown(self) -> None:
        self.pipe = None

    @property
    def compilations(self) -> int:
        return int(getattr(self.pipe, "compilations", 0) or 0)


def lora_arguments(batch: Sequence[RunRequest], pad: int) -> dict:
    """The pipeline's `loras` for a batch: one list of {"name", "scale"} per output row (jobs with different
    adapters share one call: adapters are per-row inputs of the program, never part of the batch key), the
    padding rows none; nothing when no job has one (the program without adapters runs)."""
    if not any(req.params.loras for req in batch):
        return {}
    rows = [
        [{"name": lora.name, "scale": lora.scale} for lora in req.params.loras]
        for req in batch
        for _ in range(req.params.n)
    ]
    return {"loras": rows + [[] for _ in range(pad)]}


def image_key(params: JobParams) -> tuple:
    """What image inputs add to a batch key: the task they ask for (image? mask?), the strength and
    padding_mask_crop, with which the outputs take the image's size: such a job shares a call only with jobs of
    the same stored input reference (each job stores its own: it runs alone), so a call's outputs have one size."""
    crop = (params.padding_mask_crop, params.image) if params.padding_mask_crop is not None else None
    return (
        params.image is not None,
        params.mask is not None,
        params.last_image is not None,
        params.control_image is not None,
        params.strength,
        crop,
    )


# A job's decoded image inputs and the pipeline's argument for each (diffusers' names).
IMAGE_ARGUMENTS = (
    ("image", "image"),
    ("mask", "mask_image"),
    ("last_image", "last_image"),
    ("control_image", "control_image"),
)


def image_arguments(batch: Sequence[RunRequest], pad: int) -> dict:
    """The pipeline's image arguments for a batch (one task, one strength: `image_key`): one image (and mask)
    per output row in diffusers' names, the padding rows repeating the first."""
    args = {}
    for name, arg in IMAGE_ARGUMENTS:
        if getattr(batch[0], name) is not None:
            rows = [getattr(req, name) for req in batch for _ in range(req.params.n)]
            args[arg] = rows + rows[:1] * pad
    for name in ("strength", "padding_mask_crop"):
        if getattr(batch[0].params, name) is not None:
            args[name] = getattr(batch[0].params, name)
    return args


async def read_inputs(requests: Sequence[RunRequest], store, settings) -> list[RunRequest]:
    """The requests with their jobs' stored image inputs read (service/input_store.py) and decoded (in a
    thread: a 4096 x 4096 PNG takes a few tenths of a second). An input that is gone (its TTL, `job_ttl_s`,
    passed while the job was queued) sets `missing`, and the job fails with that reason, never silently runs
    without it. A Redis or object-store error propagates: the batch is left for redelivery."""
    inputs = InputStore.of(store)
    out = []
    for req in requests:
        p = req.params
        if p.image is None and p.control_image is None:
            out.append(req)
            continue
        decoded = {}
        for name, mode in (("image", "RGB"), ("mask", "L"), ("last_image", "RGB"), ("control_image", "RGB")):
            ref = getattr(p, name)
            if ref is None:
                continue
            data = await inputs.get(ref)
            if data is None:
                decoded = f"the job's {name} input has expired or was deleted ({ref}); submit the job again"
                break
            try:
                decoded[name] = (
                    await asyncio.to_thread(
                        decode_image, data, field=name, max_pixels=settings.max_image_pixels, mode=mode
                    )
                ).image
            except ImageInputError as e:  # stored by the API after the same checks: not expected
                decoded = f"the job's stored {name} input does not decode: {e}"
                break
        if isinstance(decoded, str):
            out.append(dataclasses.replace(req, missing=decoded))
        else:
            out.append(
                dataclasses.replace(
                    req, **{"mask": None, "last_image": None, "control_image": None, **decoded}
                )
            )
    return out


def row_parts(batch: Sequence[RunRequest], max_rows: int | None) -> list[list[RunRequest]]:
    """The batch as calls of at most `max_rows` rows (None: one call): jobs in order, a job cut where a call is
    full into parts with their own n, seed (the job's seed + the part's first index: the same per-image seeds)
    and `first_output`."""
    if max_rows is None or sum(req.params.n for req in batch) <= max_rows:
        return [list(batch)]
    calls, current, room = [], [], max_rows
    for req in batch:
        done = 0
        while done < req.params.n:
            take = min(room, req.params.n - done)
            params = req.params.model_copy(update={"n": take, "seed": req.params.seed + done})
            current.append(dataclasses.replace(req, params=params, first_output=req.first_output + done))
            done, room = done + take, room - take
            if room == 0:
                calls.append(current)
                current, room = [], max_rows
    if current:
        calls.append(current)
    return calls


def _part_callback(callback: StepCallback | None, part: int, parts: int) -> StepCallback | None:
    """A call's step callback as the job's progress over `parts` calls of the same steps, in the job's own
    step count (what its progress and its end report): steps done over all calls / parts, rounded down."""
    if callback is None:
        return None
    return lambda step, total: callback((part * total + step) // parts, total)


def join_parts(batch: Sequence[RunRequest], parts: list[Generated]) -> list[Generated]:
    """The parts' outputs as one `Generated` per job of `batch`, in order: rows and seeds concatenated, stage
    timings summed over the calls, compiled when any call compiled. cached_steps: the fewest any call skipped
    (each call decides for its own rows; a job's count stays at most its step count)."""
    out = []
    for req in batch:
        mine = [g for g in parts if g.job_id == req.job_id]
        timings: dict[str, float] = {}
        for g in mine:
            for stage, seconds in g.timings.items():
                timings[stage] = timings.get(stage, 0.0) + seconds
        cached = [g.cached_steps for g in mine if g.cached_steps is not None]
        out.append(
            Generated(
                req.job_id,
                np.concatenate([np.asarray(g.arrays) for g in mine]),
                [s for g in mine for s in g.seeds],
                timings,
                any(g.compiled for g in mine),
                min(cached) if cached else None,
            )
        )
    return out


def split_rows(
    batch: Sequence[RunRequest],
    images: np.ndarray,
    seeds: list[int],
    timings: dict[str, float],
    compiled: bool,
    cached_steps: list[int] | None = None,
) -> list[Generated]:
    """Cut a batch's rows [B, ...] back into per-job outputs (views: no copy). Batch-wide stage timings are
    every job's; the step cache's skipped steps are per row (each row decides alone): a job's are the fewest
    any of its rows skipped."""
    out, row = [], 0
    for req in batch:
        n = req.params.n
        rows, row_seeds = images[row : row + n], list(seeds[row : row + n])
        skipped = None if cached_steps is None else min(cached_steps[row : row + n])
        out.append(Generated(req.job_id, rows, row_seeds, timings, compiled, skipped))
        row += n
    return out


def encode_job(req: RunRequest, generated: Generated | RunResult) -> RunResult:
    """A job's outputs -> its RunResult with the encoded bytes (an already encoded RunResult passes through);
    `encode` in its timings is this job's own."""
    if isinstance(generated, RunResult):
        return generated
    t0 = time.perf_counter()
    images, outputs = generated.arrays, []
    for i in range(req.params.n):
        data, content_type = encode_output(
            images[i],
            req.params.output_format,
            fps=req.params.fps or DEFAULT_FPS,
            quality=req.params.output_compression,
        )
        outputs.append(
            OutputBlob(
                index=i,
                data=data,
                content_type=content_type,
                width=images.shape[-2],
                height=images.shape[-3],
                seed=int(generated.seeds[i]),
                num_frames=images.shape[1] if images.ndim == 5 else None,  # [n, F, H, W, 3] for video
            )
        )
    timings = {**generated.timings, "encode": time.perf_counter() - t0}
    return RunResult(req.job_id, outputs, timings, generated.compiled, generated.cached_steps)


def split_and_encode(
    batch: Sequence[RunRequest],
    images: np.ndarray,
    seeds: list[int],
    timings: dict[str, float],
    compiled: bool,
) -> list[RunResult]:
    """Cut a batch's rows back into per-job results and encode each output (a runner that encodes in `run`)."""
    rows = split_rows(batch, images, seeds, timings, compiled)
    return [encode_job(req, g) for req, g in zip(batch, rows, strict=True)]


def make_runner(
    name: str,
    runner: str,
    *,
    path: str | None,
    dtype: str,
    mesh: dict[str, int] | None,
    devices: list | None,
    options: dict[str, Any],
) -> Runner:
    """Pick a runner implementation by name: "pipeline", "fake", or "package.module:Class"."""
    if runner == "pipeline":
        return PipelineRunner(name, path, dtype, mesh, devices, **options)
    if runner == "fake":
        from meshserve.workers.fake_runner import FakeRunner

        return FakeRunner(name, **options)
    module_name, sep, cls_name = runner.partition(":")
    if not sep:
        raise ValueError(f"model {name!r}: unknown runner {runner!r}; use pipeline, fake, or module:Class")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(name, path=path, dtype=dtype, mesh=mesh, devices=devices, **options)

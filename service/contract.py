"""The job contract shared by the API (`service/`) and the worker pools (`workers/`).

Imports no FastAPI and no JAX: only pydantic. The string values of the enums are part of the HTTP API and of the
Redis data model, so renaming one is a breaking change on both.

What crosses each boundary:
- API -> store: `JobParams` (a request normalised against the model's defaults and limits) and a `Priority`.
- store -> worker: `Delivery` (the `Job` plus where it came from and its attempt number, the write fence).
- worker -> store: `OutputBlob` (encoded bytes) on success, a `JobError` code and message on failure, `PoolInfo`
  (with one `ModelInfo` per model) in the pool registry.
- store -> API: `Job` (with `Output` records pointing at `/v1/jobs/{id}/outputs/{i}`) and `Event`s for SSE.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from meshserve.limits import IMAGE_FORMATS, VIDEO_FORMATS


class JobStatus(StrEnum):
    """A job's life: queued -> running -> succeeded | failed | canceled (queued may also go straight to an end).

    `expired`: the job had a deadline (`Cancel-After`, `deadline_s`) and had not started by then (Replicate's
    "aborted"); one that was running at its deadline ends `canceled` with error code `deadline_exceeded`."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL_STATUSES


_TERMINAL_STATUSES = frozenset((JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELED, JobStatus.EXPIRED))


class Priority(StrEnum):
    """Workers read the high stream first, then normal, then low."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"


# The order in which workers read a model's streams (and in which queue positions are counted).
PRIORITY_ORDER: tuple[Priority, ...] = (Priority.HIGH, Priority.NORMAL, Priority.LOW)


class EventType(StrEnum):
    """The `event:` of the job's SSE stream, in the order they happen."""

    QUEUED = "queued"
    STARTED = "started"
    PROGRESS = "progress"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    EXPIRED = "expired"
    PREVIEW = "preview"  # a running job's live preview, among its progress events (docs/previews.md)

    @property
    def terminal(self) -> bool:
        return self in (EventType.SUCCEEDED, EventType.FAILED, EventType.CANCELED, EventType.EXPIRED)


# Output format -> content type, for images and video alike (an animated WebP is image/webp): the one map the
# API's schema, the store's file names and the workers' encoders use.
CONTENT_TYPES: dict[str, str] = {
    "png": "image/png",
    "jpeg": "image/jpeg",
    "webp": "image/webp",
    "mp4": "video/mp4",
}
# An image model's formats (its default first) and a video model's: meshserve/limits.py, which the pipelines read
# too (they never import the service).
# A video model that publishes no frame rate is written at Wan 2.1's, the rate it was trained at.
DEFAULT_FPS = 16


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


# ---------------------------------------------------------------------------------------------------------------
# What a worker publishes about a model (pool registry): the API validates requests against it.


class ModelDefaults(_Frozen):
    """Values a request's missing fields take (the pipeline's `defaults`)."""

    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    # Present (Flux: 1.0, i.e. off) only for a model that takes a true-CFG scale: its presence is how the API
    # knows to accept the request field; None: the model has none, the API refuses the field (422) and the
    # key is left out of what is written (the model card, the registry).
    true_cfg_scale: float | None = None
    # Present (SDXL: 0.0, i.e. off) only for a model that takes diffusers' guidance_rescale, as true_cfg_scale.
    guidance_rescale: float | None = None
    # Present (the model's guidance_scale) only for Wan 2.2's two experts: diffusers' guidance_scale_2, the CFG
    # scale of the low-noise expert's steps; a request leaving it out takes its own guidance_scale (diffusers').
    guidance_scale_2: float | None = None
    # Present (6.0 and 2.5) only for a model with diffusers' aesthetic score in its time ids (the SDXL refiner).
    aesthetic_score: float | None = None
    negative_aesthetic_score: float | None = None
    # Present (1.0) only for a model with a ControlNet (SDXL): how strongly its residuals steer the UNet.
    controlnet_conditioning_scale: float | None = None
    # Present (0.0, 1.0, False) with controlnet_conditioning_scale: the fraction of the steps where the ControlNet
    # starts and stops steering (diffusers' control_guidance_start / _end), and its guess mode.
    control_guidance_start: float | None = None
    control_guidance_end: float | None = None
    guess_mode: bool | None = None
    # Video models: the frame rate their outputs are written at (Wan: 16); None for image models, left out.
    fps: int | None = None

    @model_serializer(mode="wrap")
    def _leave_out_absent_fields(self, handler):
        data = handler(self)
        for name in (
            "true_cfg_scale",
            "guidance_rescale",
            "guidance_scale_2",
            "aesthetic_score",
            "negative_aesthetic_score",
            "controlnet_conditioning_scale",
            "control_guidance_start",
            "control_guidance_end",
            "guess_mode",
            "fps",
        ):
            if getattr(self, name) is None:
                data.pop(name, None)
        return data


class FrameLimits(_Frozen):
    """Video models: `num_frames` in [min_frames, max_frames] with (num_frames - offset) % step == 0, and, when
    `served` is given, one of those frame counts: the ones the pool compiled at start (a frame count is a shape,
    so any other would compile on the request path). None: any count the rule allows (an `any_size` pool)."""

    min_frames: int
    max_frames: int
    step: int = 1
    offset: int = 0
    default: int
    served: list[int] | None = None


class StrengthLimits(_Frozen):
    """Image inputs: `strength` in (min, max] (how much of the schedule runs from the noised image), and the
    strength each task uses when a request gives none (diffusers' pipeline defaults: SDXL img2img 0.3)."""

    min: float = 0.0  # exclusive
    max: float = 1.0
    defaults: dict[str, float] = Field(default_factory=dict)
    # How a strength picks the first step (models/engine/image_inputs.py, start_step): "int" (SDXL's
    # get_timesteps runs int(steps * strength) steps, so it must be >= 1) or "float" (Flux's); None: unknown.
    rule: Literal["int", "float"] | None = None


class SchedulerArguments(_Frozen):
    """The scheduler arguments of diffusers' pipelines a scheduler takes: the custom schedules `sigmas` /
    `timesteps` with their rules, DDIM's `eta`, and the step count it caps below the model's
    (meshserve/limits.py, `check_scheduler_arguments`)."""

    sigmas: bool = False
    timesteps: bool = False
    sigmas_end: bool = False  # sigmas include the last step's end (Euler: N + 1 values for N steps)
    max_sigma: float | None = None  # flow matching: 1
    max_timestep: int = 999
    eta: bool = False  # takes diffusers' eta (DDIM's noise weight, TCD's gamma)
    max_steps: int | None = None  # the most num_inference_steps it makes (LCM: its original_inference_steps)
    min_steps: int | None = None  # the fewest it makes (PNDM's Runge-Kutta start: 4)


class CacheMethodLimits(_Frozen):
    """A step cache method a model has (models/engine/step_cache.py): the threshold a request leaving it out
    runs with."""

    default_threshold: float


class CacheSettings(_Frozen):
    """The step cache a job runs with: its method and threshold (the method's default when none was asked)."""

    method: str
    threshold: float


class LoraLimits(_Frozen):
    """LoRA adapters a request may apply (`loras`): at most `max_per_request`, each scale in [scale_min,
    scale_max]; `max_rank`: the largest adapter rank the pool's table holds (docs/lora.md)."""

    max_per_request: int
    max_rank: int
    scale_min: float
    scale_max: float
    # Present (true) only for Wan 2.2's two experts: an adapter may be added into `transformer_2`, the
    # low-noise expert (diffusers' `load_lora_weights(..., load_into_transformer_2=True)`); left out otherwise.
    load_into_transformer_2: bool | None = None

    @model_serializer(mode="wrap")
    def _leave_out_absent_fields(self, handler):
        data = handler(self)
        if self.load_into_transformer_2 is None:
            data.pop("load_into_transformer_2", None)
        return data


class LoraSpec(_Frozen):
    """Where an adapter comes from (service/lora_sources.py's rules) and which part of the denoiser it adapts:
    `transformer` (or the model's one denoiser), or Wan 2.2's low-noise expert `transformer_2` when
    `load_into_transformer_2` (diffusers' argument). pools.yaml may write a bare source for the first."""

    source: str
    load_into_transformer_2: bool = False


class AdapterInfo(_Frozen):
    """A LoRA adapter a pool registered for a model: `origin` config (pools.yaml) or api (`POST /v1/loras`);
    `error` set when the pool could not load it (then requests may not name it)."""

    name: str
    source: str
    load_into_transformer_2: bool = False
    origin: Literal["config", "api"] = "config"
    rank: int | None = None
    bytes: int | None = None
    error: str | None = None

    @property
    def spec(self) -> LoraSpec:
        return LoraSpec(source=self.source, load_into_transformer_2=self.load_into_transformer_2)


class LoraRef(_Frozen):
    """One adapter a job applies, and its scale."""

    name: str
    scale: float = 1.0


# SDXL's micro-conditioning request fields (diffusers' names; ModelLimits.micro_conditioning says who takes them).
MICRO_CONDITIONING = (
    "original_size",
    "crops_coords_top_left",
    "target_size",
    "negative_original_size",
    "negative_crops_coords_top_left",
    "negative_target_size",
)


class ModelLimits(_Frozen):
    """What a request may ask of a model (the pipeline's `limits`). `buckets`, when given, are the only sizes."""

    size_multiple: int = 8
    min_size: int
    max_size: int
    min_steps: int = 1
    max_steps: int
    max_n: int
    schedulers: list[str] = Field(default_factory=list)
    buckets: list[tuple[int, int]] | None = None  # (width, height)
    # The formats a worker can write the model's outputs in, its default first (left out: IMAGE_FORMATS, or
    # VIDEO_FORMATS for a video model).
    output_formats: list[str] = Field(default_factory=lambda: list(IMAGE_FORMATS))
    frames: FrameLimits | None = None  # None: an image model (num_frames must be absent)
    # The inputs a model takes (text-to-image, image-to-image, inpaint; text-to-video, image-to-video; left
    # out: text-to-image, or text-to-video for a video model) and, when one takes a strength, its range.
    tasks: list[str] = Field(default_factory=list)
    strength: StrengthLimits | None = None
    # LoRA adapters per request (None: the model takes none).
    loras: LoraLimits | None = None
    # Step cache methods and their default thresholds (None: the model has no step cache; docs/step-cache.md).
    cache: dict[str, CacheMethodLimits] | None = None
    # Whether the model's second text encoder takes texts of its own: diffusers' prompt_2 / negative_prompt_2
    # (SDXL's OpenCLIP-G, Flux's T5). False: the API refuses the fields (422 not_supported).
    prompt_2: bool = False
    # diffusers' clip_skip, 0 to this (SDXL: its encoders' layers - 1); None: the model takes none (422).
    max_clip_skip: int | None = None
    # Whether the model takes SDXL's micro-conditioning (original_size, crops_coords_top_left, target_size and
    # their negatives); False: the API refuses them (422 not_supported).
    micro_conditioning: bool = False
    # A video model that takes `last_image` besides `image`: Wan 2.1 FLF2V needs it; Wan 2.2's image-to-video
    # experts take it or not (`last_image_optional`).
    last_image: bool = False
    last_image_optional: bool = False
    # A model steered by a control image it needs on every job (FLUX.1 Canny / Depth: `control_image`, an edge
    # or depth map the client made); False: the API refuses the field (422 not_supported).
    control_image: bool = False
    # diffusers' custom sigmas / timesteps and DDIM's eta, by scheduler name ("default": the model's own
    # scheduler, when a request names none); a scheduler left out takes none of them (422 not_supported).
    scheduler_arguments: dict[str, SchedulerArguments] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _video_formats_by_default(cls, data):
        if isinstance(data, dict) and data.get("output_formats") is None and data.get("frames") is not None:
            data = {**data, "output_formats": list(VIDEO_FORMATS)}
        if isinstance(data, dict) and not data.get("tasks"):
            data = {**data, "tasks": ["text-to-video" if data.get("frames") is not None else "text-to-image"]}
        return data


class ModelInfo(_Frozen):
    """One model as a pool serves it. `id` is the name clients put in `model`."""

    id: str
    family: str
    task: str = "text-to-image"
    defaults: ModelDefaults
    limits: ModelLimits
    # The LoRA adapters this pool holds for the model (requests name them in `loras`).
    adapters: list[AdapterInfo] = Field(default_factory=list)


class PoolInfo(_Frozen):
    """A pool's entry in the registry (`{prefix}:pools`). `last_seen` is refreshed by `Store.heartbeat_pool`."""

    name: str
    models: list[ModelInfo]
    buckets: list[tuple[int, int]] = Field(default_factory=list)  # compiled (width, height) shapes
    mesh: dict[str, int] = Field(default_factory=dict)  # axis name -> size, e.g. {"data": 1, "cfg": 2, ...}
    max_batch: int = 1
    ready: bool = False
    last_seen: float = 0.0  # unix seconds
    host: str = ""
    pid: int = 0


# ---------------------------------------------------------------------------------------------------------------
# The job.


# The JobParams fields that name stored image inputs (service/input_store.py references).
IMAGE_INPUT_FIELDS = ("image", "mask", "last_image", "control_image")


class JobParams(_Frozen):
    """A request after per-model normalisation: every field has its final value (the seed used, the real size)."""

    model: str
    prompt: str
    negative_prompt: str | None = None
    # The second text encoder's texts (None: the prompt's, the negative prompt's: diffusers' fallback).
    prompt_2: str | None = None
    negative_prompt_2: str | None = None
    clip_skip: int | None = None  # SDXL: diffusers' clip_skip (None: the penultimate layer's states, as 0)
    # SDXL's micro-conditioning, diffusers' names and (height, width) / (top, left) pairs (None: its defaults).
    original_size: tuple[int, int] | None = None
    crops_coords_top_left: tuple[int, int] | None = None
    target_size: tuple[int, int] | None = None
    negative_original_size: tuple[int, int] | None = None
    negative_crops_coords_top_left: tuple[int, int] | None = None
    negative_target_size: tuple[int, int] | None = None
    width: int
    height: int
    num_frames: int | None = None
    num_inference_steps: int
    # diffusers' custom schedule (None: the scheduler's own of num_inference_steps steps, which they set).
    sigmas: tuple[float, ...] | None = None
    timesteps: tuple[int, ...] | None = None
    eta: float | None = None  # DDIM's noise weight, TCD's gamma (None: 0, diffusers' default)
    guidance_scale: float
    true_cfg_scale: float | None = None  # the model's true-CFG scale (None: the model has none)
    guidance_rescale: float | None = None  # SDXL's CFG rescale (None: the model has none)
    guidance_scale_2: float | None = None  # Wan 2.2's low-noise CFG scale (None: the model has one expert)
    aesthetic_score: float | None = None  # the SDXL refiner's (None: the model has none)
    negative_aesthetic_score: float | None = None
    controlnet_conditioning_scale: float | None = None  # a ControlNet's (None: the model has none)
    control_guidance_start: float | None = None  # a ControlNet's window of steps (None: the model has none)
    control_guidance_end: float | None = None
    guess_mode: bool | None = None  # a ControlNet's guess mode (None: the model has none)
    fps: int | None = None  # video models: the outputs' frame rate (None: an image model)
    scheduler: str | None = None
    seed: int
    n: int = 1
    output_format: str = "png"
    output_compression: int | None = None  # lossy formats' quality, 0-100 (None: the encoder's default, 90)
    metadata: dict[str, Any] = Field(default_factory=dict)
    preview_every: int = 0  # live previews every this many steps (0: none; docs/previews.md)
    # Image inputs: references to the stored, re-encoded input (`redis:<token>` / `store:<token>`,
    # service/input_store.py), never the bytes; the strength used (the task's default when none was asked).
    image: str | None = None
    mask: str | None = None
    last_image: str | None = None  # a first-last-frame video's last frame (the same kind of reference)
    control_image: str | None = None  # a control model's edge or depth map (the same kind of reference)
    strength: float | None = None
    # Inpaint the mask's region only, this many pixels around it, laid back into the image (the outputs then have
    # the image's size; models/components/mask_crop.py).
    padding_mask_crop: int | None = None
    # LoRA adapters applied to every output of the job, with their scales (the job ran with exactly these).
    loras: list[LoraRef] = Field(default_factory=list)
    # The step cache the job runs with (None: every step runs the whole denoiser).
    cache: CacheSettings | None = None


class Output(_Frozen):
    """One stored output of a finished job; its bytes are at `url`."""

    index: int
    url: str
    content_type: str
    width: int
    height: int
    seed: int | None = None
    num_frames: int | None = None


class OutputBlob(BaseModel):
    """What a worker hands to `Store.complete` for each output: encoded bytes and what they are."""

    index: int
    data: bytes
    content_type: str
    width: int
    height: int
    seed: int | None = None
    num_frames: int | None = None


class JobError(_Frozen):
    """Why a job failed; `code` is machine-readable (e.g. "too_many_deliveries", "pipeline_error")."""

    code: str
    message: str


class Progress(_Frozen):
    step: int = 0
    total_steps: int = 0


class WebhookState(_Frozen):
    """Where the job's webhook stands (service/webhooks/): `pending` (queued, or retrying after a failure),
    `delivered` (a 2xx), `failed` (gave up: 410, a refused address, or `webhook_max_attempts` /
    `webhook_max_age_s` spent). `attempts` counts POSTs begun; `last_error` says why the last one failed."""

    status: Literal["pending", "delivered", "failed"]
    attempts: int = 0
    last_error: str | None = None


class Timings(_Frozen):
    """Seconds: queued -> started, started -> finished, created -> finished; `stages` as the worker measured them
    (text_encode, denoise, vae_decode, encode)."""

    queue_s: float | None = None
    inference_s: float | None = None
    total_s: float | None = None
    stages: dict[str, float] = Field(default_factory=dict)


class Job(BaseModel):
    """A job as stored in `{prefix}:job:{id}`. `attempt` is the delivery fence; `worker` the consumer running it."""

    id: str
    model: str
    priority: Priority = Priority.NORMAL
    status: JobStatus
    params: JobParams
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    progress: Progress = Field(default_factory=Progress)
    outputs: list[Output] = Field(default_factory=list)
    error: JobError | None = None
    timings: Timings = Field(default_factory=Timings)
    attempt: int = 0
    worker: str | None = None
    cancel_requested: bool = False
    # Unix seconds after which the job may no longer start (queued: ends `expired`; running: canceled between
    # steps); None: no deadline.
    deadline_at: float | None = None
    # Present once a webhook was asked for and the job ended with an event it subscribes to.
    webhook: WebhookState | None = None
    # A succeeded job that asked for a step cache (`params.cache`): the denoising steps that reused cached
    # features instead of running the denoiser's blocks (docs/step-cache.md). None otherwise.
    cached_steps: int | None = None
    # Not stored: jobs ahead of this one while queued, filled by `Store.submit` / `Store.queue_position`.
    queue_position: int | None = None
    # Not stored: True when `Store.submit` returned an earlier job for the same Idempotency-Key (no job created).
    replayed: bool = Field(False, exclude=True)


class Delivery(BaseModel):
    """One delivery of a job to a worker consumer, as `Store.claim` returns it.

    `attempt` is the job's attempt number taken by this delivery: every later write by the worker (start,
    heartbeat, progress, complete, fail, mark_canceled, release) is refused once another delivery has taken a
    higher attempt. `delivery_count` is Redis's count for the stream entry (1 on first delivery). `tenant`: who
    submitted the job (the pool keeps each tenant's cached prompt embeddings apart)."""

    job: Job
    stream: str
    message_id: str
    delivery_count: int
    attempt: int
    consumer: str
    tenant: str | None = None
    # Taken over from a worker whose lease lapsed (it died or stalled), not first read nor given back by a pool.
    taken_over: bool = False


class Event(_Frozen):
    """One entry of `{prefix}:events:{id}`; `id` is the Redis stream id, used as the SSE `id:`."""

    id: str
    type: EventType
    data: dict[str, Any] = Field(default_factory=dict)


class QueueFull(Exception):
    """Admission refused: the model's queue holds `depth` undelivered jobs, the limit is `limit`."""

    def __init__(self, model: str, depth: int, limit: int):
        super().__init__(f"queue for model {model!r} is full ({depth} queued, limit {limit})")
        self.model, self.depth, self.limit = model, depth, limit


class IdempotencyConflict(Exception):
    """The Idempotency-Key was used before with a different request body."""

    def __init__(self, key: str, job_id: str):
        super().__init__(f"Idempotency-Key {key!r} was used for job {job_id} with a different request body")
        self.key, self.job_id = key, job_id

"""HTTP request and response bodies, by role: what clients send, what they get back, the one error shape.

The per-model rules (sizes, steps, n, schedulers, formats) depend on what the pools serve and are checked in
`service/catalog.py`; here only the rules that hold for every model.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from meshserve.service.contract import (
    CONTENT_TYPES,
    Job,
    JobError,
    JobParams,
    JobStatus,
    ModelDefaults,
    ModelInfo,
    ModelLimits,
    Output,
    PoolInfo,
    Priority,
    Progress,
    WebhookState,
)
from meshserve.service.lora_sources import MAX_SOURCE_CHARS, NAME_PATTERN
from meshserve.service.webhooks.spec import WebhookRequest

MAX_SEED = 2**32 - 1
# SDXL's micro-conditioning sizes and crop corners (pixels); the UNet embeds them as numbers, any value runs.
MAX_CONDITIONING_PIXELS = 16384
# padding_mask_crop's bound, in pixels: any pad past an image's sides crops the same (the box stops at them).
MAX_PADDING_MASK_CROP = 16384
# The longest custom schedule a request may send (a model's max_steps, plus Euler's end sigma, bounds it below).
MAX_SCHEDULE_VALUES = 1001
# Lists of two (a strict model takes no JSON array as a tuple); the job holds them as tuples.
_Size = Annotated[
    list[Annotated[int, Field(ge=1, le=MAX_CONDITIONING_PIXELS)]], Field(min_length=2, max_length=2)
]
_Corner = Annotated[
    list[Annotated[int, Field(ge=0, le=MAX_CONDITIONING_PIXELS)]], Field(min_length=2, max_length=2)
]
_MICRO = (
    "diffusers' micro-conditioning (SDXL paper, section 2.2); only models whose `limits.micro_conditioning` is "
    "true take it, any other answers 422. "
)
# A model id (a pools.yaml key or a Hub id, owner/name: 96 + 1 + 96 at most on the Hub). Unbounded, a 900 KB id
# came back whole in its 404 (an audit, 2026-11-28).
MAX_MODEL_ID_CHARS = 200
OUTPUT_COMPRESSION = (
    "The quality of lossy outputs, 0-100 (OpenAI's gpt-image-1 name): jpeg and webp images and webp videos only "
    "(a 422 with png or mp4). Higher keeps more detail in more bytes; null: 90."
)
# Every format some model may produce (which ones a model takes is its `limits.output_formats`).
OutputFormat = Literal[tuple(CONTENT_TYPES)]
# Metadata is echoed back, stored with the job and bounded like everything a client sends (OWASP API4): flat (no
# nesting), at most 32 entries, keys up to 64 characters, strings up to 1024, integers within JSON's exact range
# (+-2**53), floats finite (GenerateRequest's allow_inf_nan=False). Checked by `_check_metadata`.
MetadataValue = str | int | float | bool | None
MAX_METADATA_KEY = 64
MAX_METADATA_STRING = 1024
MAX_METADATA_INT = 2**53
# An 8 x 8 red PNG and an all-white mask of its size, as data URLs: the schema's examples (the fuzzer sends them).
EXAMPLE_IMAGE = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAgAAAAICAIAAABLbSncAAAAFUlEQVR42mM8ISfHgA0wMeAAg1MCANDKARQfGKMRA"
    "AAAAElFTkSuQmCC"
)
EXAMPLE_MASK = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAgAAAAICAAAAADhZOFXAAAAEElEQVR42mP8zwABTAwUMQBJQQEPkWFcdwAAAABJR"
    "U5ErkJggg=="
)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _unicode_text(value: Any) -> Any:
    """A field's value whose every string (dict keys, lists and nested request models included) is Unicode text.
    JSON may escape a lone UTF-16 surrogate (`"\\ud800"`), which Python's parser reads into a str that cannot
    be encoded: stored in a job it made the API answer 500 (an audit, 2026-11-29: `negative_prompt`, a metadata
    value) or came back mangled (a metadata key)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):  # a search, not an encode: a data-URL image is a 24 MiB string
                raise PydanticCustomError(
                    "string_unicode", "a string holds a lone UTF-16 surrogate: it is not Unicode text"
                )
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list | tuple):
            stack += item
        elif isinstance(item, BaseModel):
            stack += list(item.__dict__.values())
    return value


class _TextRequest(BaseModel):
    """A request body whose strings are all Unicode text (`_unicode_text`), checked field by field."""

    @field_validator("*", mode="after")
    @classmethod
    def _unicode(cls, value: Any) -> Any:
        return _unicode_text(value)


def _check_metadata(metadata: dict[str, MetadataValue]) -> dict[str, MetadataValue]:
    for key, value in metadata.items():
        if not 1 <= len(key) <= MAX_METADATA_KEY:
            raise PydanticCustomError(
                "metadata_key_length",
                "metadata keys must be 1 to {limit} characters, got {got}",
                {"limit": MAX_METADATA_KEY, "got": len(key)},
            )
        if isinstance(value, str) and len(value) > MAX_METADATA_STRING:
            raise PydanticCustomError(
                "string_too_long",
                "metadata[{key}] must be at most {limit} characters, got {got}",
                {"key": repr(key), "limit": MAX_METADATA_STRING, "got": len(value)},
            )
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_METADATA_INT:
            raise PydanticCustomError(
                "out_of_range",
                "metadata[{key}] must be within +-2**53, got {digits} digits",
                {"key": repr(key), "digits": len(str(abs(value)))},
            )
    return metadata


# -- requests -----------------------------------------------------------------------------------------------

# Adapters in one request whatever the model (each model's own bound, `limits.loras.max_per_request`, is checked
# against what its pools publish: service/api/catalog.py).
MAX_LORAS = 16


class LoraRequest(BaseModel):
    """One LoRA adapter to apply to every output of the job."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    name: str = Field(pattern=NAME_PATTERN, description="An adapter of the model (`/v1/models`: `adapters`).")
    scale: float = Field(
        1.0, description="Its weight, within the model's `limits.loras` [scale_min, scale_max]."
    )


class CacheRequest(BaseModel):
    """A step cache for the job (docs/step-cache.md): the model's `limits.cache` lists its methods."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    method: str = Field(
        min_length=1,
        max_length=64,
        description="A method the model lists in `limits.cache` (`deep_features`, `first_block`, `teacache`).",
    )
    threshold: float | None = Field(
        None,
        ge=0,
        le=1,
        description="How much the method's signal (the first block's residual or output; for `teacache` its "
        "modulated input, summed over steps) may change (relative mean) before a step runs every block again: "
        "higher skips more steps. 0 never skips. Left out: the method's `default_threshold`.",
    )


def _unique_loras(loras: list[LoraRequest] | None) -> list[LoraRequest] | None:
    names = [lora.name for lora in loras or []]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise PydanticCustomError(
            "not_unique", "loras names each adapter once; repeated: {names}", {"names": ", ".join(repeated)}
        )
    return loras


class GenerateRequest(_TextRequest):
    """`POST /v1/generate`. Fields left out take the model's defaults; `seed` null picks a random seed, which the
    job's `params.seed` then shows."""

    # allow_inf_nan=False: NaN, Infinity and 1e309 (JSON that Python reads as inf) are 422s in every float field.
    # strict: a JSON value of the wrong type is a 422 (`"n": true`, `"width": "64"`, `"steps": 2.0`), not coerced;
    # an int is still a float. The request models below are strict the same way.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    model: str | None = Field(
        None,
        max_length=MAX_MODEL_ID_CHARS,
        description="A served model id; may be left out when exactly one is served.",
    )
    # Lengths are bounded at admission by the `max_prompt_chars` setting (422 string_too_long).
    prompt: str = Field(min_length=1, description="At most `max_prompt_chars` characters (4000 by default).")
    negative_prompt: str | None = None
    prompt_2: str | None = Field(
        None,
        description="diffusers' prompt_2 (SDXL: the second CLIP encoder's text; Flux: T5's): the prompt when left "
        "out or empty. Only models whose `limits.prompt_2` is true take it; for any other model it is a 422.",
    )
    negative_prompt_2: str | None = Field(
        None,
        description="diffusers' negative_prompt_2: the second text encoder's negative text, the negative prompt "
        "when left out or empty (and, as in diffusers, it acts only where the negative prompt does). Only models "
        "whose `limits.prompt_2` is true take it.",
    )
    clip_skip: int | None = Field(
        None,
        ge=0,
        description="diffusers' clip_skip (SDXL): the prompt's text states come from this many layers before the "
        "penultimate one of both CLIP encoders (0, like leaving it out: the penultimate). At most the model's "
        "`limits.max_clip_skip`; a model without it answers 422.",
    )
    original_size: _Size | None = Field(
        None,
        description=_MICRO
        + "[height, width] the picture is conditioned as upscaled from (default: the size).",
    )
    crops_coords_top_left: _Corner | None = Field(
        None, description=_MICRO + "[top, left] of the crop it is conditioned as cut from (default [0, 0])."
    )
    target_size: _Size | None = Field(None, description=_MICRO + "[height, width] (default: the size).")
    negative_original_size: _Size | None = Field(
        None,
        description=_MICRO
        + "The negative prompt's original_size. Text-to-image uses the negative triple only "
        "when both negative sizes are given (as diffusers); image-to-image and inpaint default each to the prompt's "
        "and, as diffusers' pipelines do, use the prompt's crop for the negative (negative_crops_coords_top_left "
        "acts in text-to-image only).",
    )
    negative_crops_coords_top_left: _Corner | None = Field(None, description=_MICRO + "The negative's crop.")
    negative_target_size: _Size | None = Field(
        None, description=_MICRO + "The negative prompt's target_size."
    )
    width: int | None = Field(None, gt=0)
    height: int | None = Field(None, gt=0)
    num_frames: int | None = Field(None, gt=0, description="Video models only.")
    fps: int | None = Field(
        None,
        ge=1,
        le=120,
        description="Video models only: the frame rate of the MP4/WebP written (default: the model's, 16 for Wan).",
    )
    num_inference_steps: int | None = Field(
        None,
        gt=0,
        description="Denoising steps (the model's default when left out), within the model's limits.min_steps and "
        "max_steps, and at most limits.scheduler_arguments[scheduler].max_steps where the scheduler caps them "
        "(lcm: its original_inference_steps).",
    )
    sigmas: list[float] | None = Field(
        None,
        min_length=1,
        max_length=MAX_SCHEDULE_VALUES,
        description="diffusers' custom sigmas (SDXL with euler or euler_karras: one per step plus the last step's "
        "end, e.g. [14.6, 6.0, 1.1, 0.0] for 3 steps; Flux: one per step in (0, 1], shifted for the size as its "
        "own). Strictly decreasing; they set the step count (num_inference_steps, when given too, must equal it). "
        "The schedulers that take them have `sigmas: true` in the model's `limits.scheduler_arguments`; others "
        "answer 422.",
    )
    eta: float | None = Field(
        None,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="diffusers' eta (SDXL with the ddim or tcd scheduler): the weight of the fresh noise each step "
        "adds (0, the default, is deterministic; DDIM at 1 is DDPM-like; TCD's gamma, 0.3 in its recipe), drawn "
        "from the job's seed. The schedulers that "
        "take it have `eta: true` in the model's `limits.scheduler_arguments`; any other answers 422 unless it is "
        "0.",
    )
    timesteps: list[int] | None = Field(
        None,
        min_length=1,
        max_length=MAX_SCHEDULE_VALUES,
        description="diffusers' custom timesteps (SDXL with euler, ddpm, dpmpp_2m, dpmpp_2m_sde, dpmpp_2s, lcm or "
        "tcd: where limits.scheduler_arguments[scheduler].timesteps is true): one per step, "
        "strictly decreasing, in [0, limits.scheduler_arguments[scheduler].max_timestep]; they set the step count. "
        "Not with sigmas.",
    )
    guidance_scale: float | None = Field(None, ge=0, le=100)
    true_cfg_scale: float | None = Field(
        None,
        ge=1,
        le=100,
        allow_inf_nan=False,
        description="True classifier-free guidance (Flux): a second pass on `negative_prompt`, mixed as "
        "negative + true_cfg_scale * (positive - negative). It acts only when > 1 AND a negative_prompt is "
        "given (1, the default, is off). Only models whose `defaults` list `true_cfg_scale` take it; for any "
        "other model it is a 422.",
    )
    guidance_rescale: float | None = Field(
        None,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="diffusers' guidance_rescale (SDXL): the guided prediction is rescaled to the conditional "
        "one's standard deviation and mixed in by this fraction (0, the default, is off); it acts only when "
        "guidance_scale > 1. Only models whose `defaults` list `guidance_rescale` take it; for any other model "
        "it is a 422.",
    )
    controlnet_conditioning_scale: float | None = Field(
        None,
        ge=0,
        le=10,
        allow_inf_nan=False,
        description="diffusers' controlnet_conditioning_scale: how strongly a ControlNet's residuals steer the UNet "
        "(0: not at all; 1.0, the default). Only models whose `defaults` list it (SDXL with a ControlNet) take it; "
        "for any other model it is a 422.",
    )
    control_guidance_start: float | None = Field(
        None,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="diffusers' control_guidance_start: the fraction of the steps after which a ControlNet starts "
        "steering (0, the default: from the first step). Step i of L runs it unless i / L < start or "
        "(i + 1) / L > end. Must be below control_guidance_end. Only models whose `defaults` list it (SDXL with a "
        "ControlNet) take it; for any other model it is a 422.",
    )
    control_guidance_end: float | None = Field(
        None,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="diffusers' control_guidance_end: the fraction of the steps after which a ControlNet stops "
        "steering (1, the default: to the last step). Only models whose `defaults` list it take it.",
    )
    guess_mode: bool | None = Field(
        None,
        description="diffusers' guess_mode: the ControlNet steers without the prompt's help (its residuals ramp "
        "from 0.1 at the finest level to 1.0 at the coarsest, and the unconditional CFG pass gets none); "
        "diffusers suggests a guidance_scale of 3 to 5. Only models whose `defaults` list it take it.",
    )
    guidance_scale_2: float | None = Field(
        None,
        ge=0,
        le=100,
        allow_inf_nan=False,
        description="diffusers' guidance_scale_2 (Wan 2.2's two-expert models): the CFG scale of the steps the "
        "low-noise expert runs (left out: the request's guidance_scale, as diffusers). Only models whose "
        "`defaults` list `guidance_scale_2` take it; for any other model it is a 422.",
    )
    aesthetic_score: float | None = Field(
        None,
        ge=0,
        le=10,
        allow_inf_nan=False,
        description="diffusers' aesthetic_score (the SDXL refiner's micro-conditioning, default 6): only models "
        "whose `defaults` list it take it; for any other model it is a 422.",
    )
    negative_aesthetic_score: float | None = Field(
        None,
        ge=0,
        le=10,
        allow_inf_nan=False,
        description="diffusers' negative_aesthetic_score (the refiner's negative conditioning, default 2.5), as "
        "`aesthetic_score`.",
    )
    scheduler: str | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    n: int = Field(1, ge=1, description="Images (or videos) to generate from the prompt.")
    output_format: OutputFormat | None = None
    output_compression: int | None = Field(None, ge=0, le=100, description=OUTPUT_COMPRESSION)
    priority: Priority = Field(
        Priority.NORMAL,
        strict=False,  # JSON gives the enum its value, a string
        description="Pools read high before normal before low; a waiting job counts one priority higher for "
        "every `priority_aging_s` (60 s by default) it has waited, so a lower priority waits longer, not for ever.",
    )
    metadata: Annotated[dict[str, MetadataValue], AfterValidator(_check_metadata)] = Field(
        default_factory=dict, max_length=32
    )
    previews: bool = Field(
        False,
        description="Live previews: the job's SSE stream gets `preview` events (a small WebP data URL of the "
        "current latents, per output) about ten times over the run (docs/previews.md).",
    )
    preview_every: int | None = Field(
        None, ge=1, le=1000, description="Live previews every this many steps (implies `previews`)."
    )
    # Image inputs (docs/security.md, "Image inputs"): the bytes are checked, re-encoded and stored by the API
    # before the job is accepted; the job carries a reference (service/input_store.py).
    image: str | None = Field(
        None,
        min_length=1,
        description="An input image: a data URL (`data:image/png;base64,...`) or an http(s) URL the API fetches "
        "(public addresses only). PNG, JPEG or WebP, one still frame, at most `max_image_bytes` and "
        "`max_image_pixels`; resized to the job's width x height. With it the job is image-to-image (an edit "
        "with the image as context for a FLUX.1 Kontext model: no strength), or image-to-video for such a model "
        "(the model's `tasks` in /v1/models).",
        examples=[EXAMPLE_IMAGE, "https://example.com/photo.jpg"],
    )
    mask: str | None = Field(
        None,
        min_length=1,
        description="Inpainting mask, in the same forms as `image` and of its size: white is repainted, black "
        "kept (read as grayscale). Needs `image`; the model must list the `inpaint` task.",
        examples=[EXAMPLE_MASK],
    )
    last_image: str | None = Field(
        None,
        min_length=1,
        description="The video's last frame, in the same forms as `image`, which is the first, for a model whose "
        "`limits.last_image` is true: a first-last-frame model (Wan 2.1 FLF2V) needs both; Wan 2.2's image-to-video "
        "experts (`limits.last_image_optional`) take it or not; any other model answers 422.",
    )
    control_image: str | None = Field(
        None,
        min_length=1,
        description="A control image, in the same forms as `image` (an edge map for FLUX.1 Canny, a depth map for "
        "FLUX.1 Depth, made by the client), resized to the job's width x height: required by a model whose "
        "`limits.control_image` is true, refused (422) by any other. It steers text-to-image; no `image` needed.",
    )
    strength: float | None = Field(
        None,
        gt=0,
        le=1,
        description="How much of the schedule runs from the noised image, in (0, 1]: 1 repaints from noise. "
        "Needs `image`; left out: the task's default (the model's `limits.strength.defaults`).",
    )
    padding_mask_crop: int | None = Field(
        None,
        ge=0,
        le=MAX_PADDING_MASK_CROP,
        description="Inpaint only the masked region (diffusers' `padding_mask_crop`): the mask's bounding box, "
        "this many pixels larger on each side and grown to the request's aspect, is cut out of the image and "
        "the mask, inpainted at the request's `width` x `height`, and laid back into the image through the "
        "mask. The outputs then have the image's size. Needs `mask`.",
    )
    webhook: WebhookRequest | None = Field(
        None, description="POST the job's end here, signed (Standard Webhooks; docs/webhooks.md)."
    )
    deadline_s: float | None = Field(
        None,
        gt=0,
        description="Seconds from submission: a job not started by then ends `expired`, one still running is "
        "canceled (error `deadline_exceeded`). The `Cancel-After` header says the same (it wins when both are "
        "given).",
    )
    cache: CacheRequest | None = Field(
        None,
        description='Step caching: `{"method": "first_block", "threshold": 0.08}` skips most of the denoiser on '
        "steps where its first block's output changed little (faster, slightly different pictures). The "
        "model's `limits.cache` lists its methods and default thresholds; a model without one answers 422.",
    )
    loras: Annotated[list[LoraRequest] | None, AfterValidator(_unique_loras)] = Field(
        None,
        max_length=MAX_LORAS,
        description='LoRA adapters to apply, each once: `[{"name", "scale"}]` (docs/lora.md). The model\'s '
        "`adapters` and `limits.loras` (how many per request, the scale range) are in /v1/models; an unknown name "
        "is a 422 listing the available ones.",
    )


class ImagesRequest(_TextRequest):
    """OpenAI-compatible `POST /v1/images/generations` (fields OpenAI clients send that do not apply here, such
    as `quality`, `style` or `user`, are accepted and ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    prompt: str = Field(min_length=1, description="At most `max_prompt_chars` characters (4000 by default).")
    model: str | None = Field(None, max_length=MAX_MODEL_ID_CHARS)
    # OpenAI marks n, size and response_format nullable (clients such as LiteLLM send null): null is the default.
    n: int | None = Field(1, ge=1, description="null: 1.")
    size: str | None = Field(
        None,
        pattern=r"^(\d{1,5}x\d{1,5}|auto)$",
        description='"WIDTHxHEIGHT", e.g. "1024x1024"; "auto" or null: the model\'s default size.',
    )
    response_format: Literal["url", "b64_json"] | None = Field("url", description="null: url.")
    output_format: Literal["png", "jpeg", "webp"] | None = Field(
        None,
        description="gpt-image-1's: the images' format, one the model lists in `limits.output_formats` (null: "
        "the model's first).",
    )
    output_compression: int | None = Field(None, ge=0, le=100, description=OUTPUT_COMPRESSION)
    stream: bool | None = Field(
        None,
        description="Streaming partial images is not offered: true is a 422 `not_supported` (a job's previews "
        "stream over `GET /v1/jobs/{id}/events`).",
    )


# -- responses ----------------------------------------------------------------------------------------------


class TimingsOut(BaseModel):
    queue_s: float | None = None
    inference_s: float | None = None
    total_s: float | None = None
    # Seconds per stage as the worker measured them (text_encode, denoise, decode, ...), as the `succeeded`
    # event gives them; empty until the job succeeded.
    stages: dict[str, float] = Field(default_factory=dict)


class JobResponse(BaseModel):
    """A job as clients see it. Times are unix seconds; `queue_position` (jobs ahead) only while queued."""

    id: str
    object: Literal["job"] = "job"
    model: str
    status: JobStatus
    priority: Priority
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    queue_position: int | None = None
    progress: Progress
    params: JobParams
    outputs: list[Output] = Field(default_factory=list)
    error: JobError | None = None
    timings: TimingsOut
    deadline_at: float | None = Field(
        None, description="Unix seconds; set by `Cancel-After` or `deadline_s`."
    )
    webhook: WebhookState | None = Field(
        None, description="The webhook's delivery, once the job ended with an event it subscribes to."
    )
    cached_steps: int | None = Field(
        None,
        description="A succeeded job that asked for a step cache (`params.cache`): the denoising steps that "
        "reused cached features instead of running the denoiser's blocks (the fewest of its images: each decides "
        "alone; docs/step-cache.md).",
    )

    @classmethod
    def from_job(cls, job: Job) -> JobResponse:
        return cls(
            id=job.id,
            model=job.model,
            status=job.status,
            priority=job.priority,
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            queue_position=job.queue_position if job.status == JobStatus.QUEUED else None,
            progress=job.progress,
            params=job.params,
            outputs=job.outputs,
            error=job.error,
            timings=TimingsOut(
                queue_s=job.timings.queue_s,
                inference_s=job.timings.inference_s,
                total_s=job.timings.total_s,
                stages=job.timings.stages,
            ),
            deadline_at=job.deadline_at,
            webhook=job.webhook,
            cached_steps=job.cached_steps,
        )


class JobList(BaseModel):
    """A page of the caller's jobs, newest first (`GET /v1/jobs`)."""

    object: Literal["list"] = "list"
    data: list[JobResponse]
    has_more: bool = Field(description="Older jobs may follow: ask again with `cursor` = `next_cursor`.")
    next_cursor: str | None = Field(None, description="Where the next page starts; null on the last page.")


class PoolSummary(BaseModel):
    name: str
    ready: bool
    max_batch: int
    mesh: dict[str, int]
    buckets: list[tuple[int, int]]

    @classmethod
    def from_pool(cls, pool: PoolInfo) -> PoolSummary:
        return cls(
            name=pool.name, ready=pool.ready, max_batch=pool.max_batch, mesh=pool.mesh, buckets=pool.buckets
        )


class AdapterSummary(BaseModel):
    name: str
    rank: int | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    family: str
    task: str
    tasks: list[str] = Field(
        description="The inputs the model takes: text-to-image, image-to-image (`image`), inpaint (`image` and "
        "`mask`), text-to-video, image-to-video (`image`)."
    )
    defaults: ModelDefaults
    limits: ModelLimits
    adapters: list[AdapterSummary] = Field(
        default_factory=list,
        description="The LoRA adapters requests may name in `loras` (loaded by every ready pool of the model).",
    )
    pools: list[PoolSummary]

    @classmethod
    def build(cls, info: ModelInfo, pools: list[PoolInfo]) -> ModelCard:
        return cls(
            id=info.id,
            family=info.family,
            task=info.task,
            tasks=list(info.limits.tasks),
            defaults=info.defaults,
            limits=info.limits,
            adapters=[AdapterSummary(name=a.name, rank=a.rank) for a in info.adapters if a.error is None],
            pools=[PoolSummary.from_pool(p) for p in pools],
        )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ImageData(BaseModel):
    url: str | None = None
    b64_json: str | None = None
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]


class HealthResponse(BaseModel):
    status: str
    detail: dict[str, Any] = Field(default_factory=dict)


class ErrorBody(BaseModel):
    code: str = Field(description="Machine-readable: the rule that failed (e.g. not_multiple, queue_full).")
    message: str
    field: str | None = Field(None, description="The request field at fault, when there is one.")
    param: str | None = Field(None, description="`field` again, under OpenAI's name (its SDKs read `param`).")
    type: Literal["invalid_request_error", "server_error"] = Field(
        "invalid_request_error", description="OpenAI's error kind: `server_error` for 5xx answers."
    )


class ErrorResponse(BaseModel):
    error: ErrorBody


# -- LoRA administration (admin key) ------------------------------------------------------------------------


class LoraCreate(_TextRequest):
    """`POST /v1/loras`: register an adapter for a model on every pool serving it."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=MAX_MODEL_ID_CHARS)
    name: str = Field(pattern=NAME_PATTERN)
    source: str = Field(
        min_length=1,
        max_length=MAX_SOURCE_CHARS,
        description="A file or folder under the LoRA root (`MESHSERVE_LORA_ROOT`; relative to it, or absolute "
        "inside it) or a Hub id `owner/name[/file.safetensors]`; never a URL.",
    )
    load_into_transformer_2: bool = Field(
        False,
        strict=True,
        description="diffusers' argument for Wan 2.2's two experts: the file adapts `transformer_2`, the "
        "low-noise expert, instead of `transformer` (a model whose `limits.loras` lists "
        "`load_into_transformer_2`; for any other model it is a 422).",
    )

    @field_validator("model")
    @classmethod
    def _no_slash(cls, v: str) -> str:
        if "/" in v:
            raise PydanticCustomError("invalid_model", "a model id has no '/'")
        return v


class LoraPoolState(BaseModel):
    pool: str
    status: Literal["loaded", "failed", "pending"]
    rank: int | None = None
    bytes: int | None = None
    error: str | None = None


class LoraEntry(BaseModel):
    """One adapter of a model and where it stands in each ready pool of the model."""

    model: str
    name: str
    source: str
    load_into_transformer_2: bool = Field(False, description="It adapts Wan 2.2's low-noise `transformer_2`.")
    origin: Literal["config", "api"]
    rank: int | None = None
    bytes: int | None = None
    usable: bool = Field(description="Loaded by every ready pool of the model: requests may name it.")
    pools: list[LoraPoolState]


class LoraList(BaseModel):
    object: Literal["list"] = "list"
    data: list[LoraEntry]

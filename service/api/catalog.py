"""What the ready pools serve, and a request normalised against it.

Workers publish each model's defaults and limits in the pool registry (`PoolInfo.models`); the API validates a
request against them, so a new model or a new bucket needs no change here. The registry is read at most once per
`pool_cache_s` (a submit must not cost an extra Redis round trip).

Sizes: a pool lists the (width, height) buckets it compiled as the only sizes it serves (`limits.buckets`; None
for an `any_size` pool). All pools of a model read one stream, so any of them may run any job: the API admits a
size only when EVERY ready pool of the model serves it (the intersection of their buckets), and nothing compiles
on the request path. Pools of one model should therefore share their buckets; a pool with other buckets narrows
what the model serves to the common ones (an empty intersection admits no size, and says so). A video model's
frame counts are served the same way: `limits.frames.served`, intersected over its pools, refused otherwise
(422 `frames_not_supported` naming `num_frames`).
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass, field

from meshserve.limits import (
    DEFAULT_SCHEDULER,
    LimitError,
    check_request,
    check_scheduler_arguments,
    min_strength,
)
from meshserve.service import metrics
from meshserve.service.api.errors import ApiError, FieldError
from meshserve.service.contract import (
    DEFAULT_FPS,
    MICRO_CONDITIONING,
    AdapterInfo,
    CacheSettings,
    JobParams,
    LoraRef,
    ModelInfo,
    PoolInfo,
)
from meshserve.service.schemas import MAX_SEED, GenerateRequest
from meshserve.service.settings import Settings
from meshserve.service.store import Store


@dataclass
class ServedModel:
    info: ModelInfo
    pools: list[PoolInfo] = field(default_factory=list)


class Catalog:
    """The live pools and the models their ready members serve, cached for `pool_cache_s`."""

    def __init__(self, store: Store, settings: Settings):
        self.store, self.settings = store, settings
        self._pools: list[PoolInfo] = []
        self._read_at = float("-inf")

    async def pools(self) -> list[PoolInfo]:
        """Pools seen within `pool_stale_s` (ready or not)."""
        if time.monotonic() - self._read_at >= self.settings.pool_cache_s:
            self._pools = await self.store.list_pools()
            self._read_at = time.monotonic()
        return self._pools

    async def served(self) -> dict[str, ServedModel]:
        """Model id -> its info (from the first ready pool that lists it, with the sizes every ready pool of it
        serves) and every ready pool serving it."""
        infos: dict[str, list[ModelInfo]] = {}
        pools: dict[str, list[PoolInfo]] = {}
        for pool in await self.pools():
            if not pool.ready:
                continue
            for info in pool.models:
                infos.setdefault(info.id, []).append(info)
                pools.setdefault(info.id, []).append(pool)
        return {m: ServedModel(common_sizes(infos[m]), pools[m]) for m in infos}

    async def resolve(self, model: str | None) -> ServedModel:
        """The served model a request names (or the only one, when it names none).

        503 when no pool is ready at all; 404 listing the served ones when `model` is not among them."""
        served = await self.served()
        retry = {"Retry-After": str(self.settings.retry_after_s)}
        if not served:
            metrics.JOBS_REJECTED.labels("no_ready_pool").inc()
            raise ApiError(
                503, "no_ready_pool", "no worker pool is ready to serve requests yet", "model", retry
            )
        if model is None:
            if len(served) == 1:
                return next(iter(served.values()))
            metrics.JOBS_REJECTED.labels("invalid").inc()
            raise FieldError(
                "model", "missing", f"model is required when several are served: {sorted(served)}"
            )
        if model not in served:
            metrics.JOBS_REJECTED.labels("model_not_found").inc()
            raise ApiError(
                404,
                "model_not_found",
                f"model {model!r} is not served; served models: {sorted(served)}",
                "model",
            )
        return served[model]


def common_sizes(infos: list[ModelInfo]) -> ModelInfo:
    """The first info, with `limits.buckets` the sizes every one of `infos` serves (None only when all serve any
    size) and the default size moved to the first common bucket when the first pool's default is not one; for a
    video model the same for its frame counts (`limits.frames.served`, `limits.frames.default`), and the request
    fields every pool takes (adapters, prompt_2, clip_skip, micro-conditioning, custom schedules)."""
    first = infos[0]
    if len(infos) == 1:
        return first
    limits, defaults = first.limits, first.defaults
    listed = [[tuple(b) for b in info.limits.buckets] for info in infos if info.limits.buckets is not None]
    if listed:
        common = [b for b in dict.fromkeys(listed[0]) if all(b in other for other in listed[1:])]
        if common and (defaults.width, defaults.height) not in common:
            defaults = defaults.model_copy(update={"width": common[0][0], "height": common[0][1]})
        limits = limits.model_copy(update={"buckets": common})
    adapters = common_adapters(infos)
    lora_limits = [info.limits.loras for info in infos if info.limits.loras is not None]
    if len(lora_limits) < len(infos):  # a pool that takes no adapters: the model takes none
        limits = limits.model_copy(update={"loras": None})
    elif lora_limits:
        limits = limits.model_copy(
            update={
                "loras": lora_limits[0].model_copy(
                    update={
                        "max_per_request": min(x.max_per_request for x in lora_limits),
                        "max_rank": min(x.max_rank for x in lora_limits),
                        "scale_min": max(x.scale_min for x in lora_limits),
                        "scale_max": min(x.scale_max for x in lora_limits),
                        "load_into_transformer_2": all(x.load_into_transformer_2 for x in lora_limits)
                        or None,
                    }
                )
            }
        )
    # The text encoders' and micro-conditioning fields: taken only when every pool takes them (a pool of an
    # older worker publishes none, and would ignore them: its job params drop fields it does not know).
    skips = [info.limits.max_clip_skip for info in infos]
    limits = limits.model_copy(
        update={
            "prompt_2": all(info.limits.prompt_2 for info in infos),
            "micro_conditioning": all(info.limits.micro_conditioning for info in infos),
            # Pools of one model should agree; a mix (a misconfiguration) takes no last_image, so a job with one
            # never reaches a pool that drops it.
            "last_image": all(info.limits.last_image for info in infos),
            "last_image_optional": all(info.limits.last_image_optional for info in infos),
            # Required where it is taken: a mix would send jobs without one to a pool that needs it.
            "control_image": all(info.limits.control_image for info in infos),
            "max_clip_skip": None if None in skips else min(skips),
            # A scheduler's custom schedules where every pool takes them by the same rules.
            "scheduler_arguments": {
                name: rules
                for name, rules in limits.scheduler_arguments.items()
                if all(info.limits.scheduler_arguments.get(name) == rules for info in infos)
            },
        }
    )
    served = [info.limits.frames.served for info in infos if info.limits.frames is not None]
    served = [s for s in served if s is not None]
    if limits.frames is not None and served:
        frames = [n for n in dict.fromkeys(served[0]) if all(n in other for other in served[1:])]
        default = limits.frames.default if limits.frames.default in frames or not frames else frames[0]
        limits = limits.model_copy(
            update={"frames": limits.frames.model_copy(update={"served": frames, "default": default})}
        )
    return first.model_copy(update={"defaults": defaults, "limits": limits, "adapters": adapters})


def common_adapters(infos: list[ModelInfo]) -> list[AdapterInfo]:
    """The adapters every one of `infos` loaded (any pool may take the job), in the first's order; an adapter
    some pool failed to load, or holds from another source, is left out: requests may not name it."""
    loaded = [{a.name: a.source for a in info.adapters if a.error is None} for info in infos]
    return [
        a
        for a in infos[0].adapters
        if a.error is None and all(other.get(a.name) == a.source for other in loaded[1:])
    ]


def _check_loras(req: GenerateRequest, info: ModelInfo) -> list[LoraRef]:
    """The request's adapters against what the model's pools hold (422 naming `loras` and the rule)."""
    if not req.loras:
        return []
    lim = info.limits.loras
    if lim is None:
        raise FieldError("loras", "not_supported", f"{info.id} ({info.family}) takes no LoRA adapters")
    if len(req.loras) > lim.max_per_request:
        raise FieldError(
            "loras",
            "too_many",
            f"at most {lim.max_per_request} LoRA adapters per request for {info.id}, got {len(req.loras)}",
        )
    available = sorted(a.name for a in info.adapters if a.error is None)
    for i, lora in enumerate(req.loras):
        if lora.name not in available:
            raise FieldError(
                f"loras[{i}].name",
                "unknown_adapter",
                f"{info.id} has no LoRA adapter {lora.name!r}; available: {', '.join(available) or 'none'}",
            )
        if not lim.scale_min <= lora.scale <= lim.scale_max:
            raise FieldError(
                f"loras[{i}].scale",
                "out_of_range",
                f"the scale of {lora.name!r} must be in [{lim.scale_min:g}, {lim.scale_max:g}], got {lora.scale}",
            )
    return [LoraRef(name=lora.name, scale=lora.scale) for lora in req.loras]


def _check_prompts(req: GenerateRequest, max_chars: int) -> None:
    for name in ("prompt", "negative_prompt", "prompt_2", "negative_prompt_2"):
        text = getattr(req, name)
        if text is not None and len(text) > max_chars:
            raise FieldError(
                name, "string_too_long", f"{name} must be at most {max_chars} characters, got {len(text)}"
            )


def _normalise(req: GenerateRequest, info: ModelInfo, max_prompt_chars: int) -> JobParams:
    d, lim = info.defaults, info.limits
    _check_prompts(req, max_prompt_chars)
    width = req.width if req.width is not None else d.width
    height = req.height if req.height is not None else d.height
    steps = req.num_inference_steps if req.num_inference_steps is not None else d.num_inference_steps
    fmt = req.output_format or lim.output_formats[0]
    frames = req.num_frames if req.num_frames is not None or lim.frames is None else lim.frames.default
    request = {
        "width": width,
        "height": height,
        "num_inference_steps": steps,
        "n": req.n,
        "scheduler": req.scheduler,
        "output_format": fmt,
        "output_compression": req.output_compression,
        "num_frames": frames,
        "fps": req.fps,
    }
    try:  # the one limits check the pools and the pipelines run too (meshserve/limits.py)
        check_request(lim, request, model=info.id)
        custom = {
            "sigmas": req.sigmas,
            "timesteps": req.timesteps,
            "eta": req.eta,
            "scheduler": req.scheduler,
        }
        steps = (
            check_scheduler_arguments(
                lim,
                {**custom, "num_inference_steps": req.num_inference_steps},
                model=info.id,
                default_steps=steps,
            )
            or steps
        )
    except LimitError as e:
        raise FieldError(e.field, e.rule, str(e)) from None
    # Fields a model takes only when its published defaults list them (Flux's true CFG, SDXL's guidance_rescale,
    # Wan 2.2's guidance_scale_2, the SDXL refiner's aesthetic scores); any other model refuses them.
    published = {
        "true_cfg_scale": "has no true CFG; true_cfg_scale must be left out (guidance_scale is its guidance)",
        "guidance_rescale": "takes no guidance_rescale; it must be left out",
        "guidance_scale_2": "has one denoiser; guidance_scale_2 (Wan 2.2's two experts) must be left out",
        "aesthetic_score": "takes no aesthetic_score; leave it out",
        "negative_aesthetic_score": "takes no negative_aesthetic_score; leave it out",
        "controlnet_conditioning_scale": "has no ControlNet; controlnet_conditioning_scale must be left out",
        "control_guidance_start": "has no ControlNet; control_guidance_start must be left out",
        "control_guidance_end": "has no ControlNet; control_guidance_end must be left out",
        "guess_mode": "has no ControlNet; guess_mode must be left out",
    }
    given = {}
    for name, refusal in published.items():
        if getattr(req, name) is not None and getattr(d, name) is None:
            raise FieldError(name, "not_supported", f"{info.id} ({info.family}) {refusal}")
        given[name] = getattr(req, name) if getattr(req, name) is not None else getattr(d, name)
    window = given["control_guidance_start"], given["control_guidance_end"]
    if None not in window and not window[0] < window[1]:
        field = "control_guidance_end" if req.control_guidance_end is not None else "control_guidance_start"
        raise FieldError(
            field,
            "out_of_range",
            f"control_guidance_start must be below control_guidance_end, got {window[0]} and {window[1]}",
        )
    guidance = req.guidance_scale if req.guidance_scale is not None else d.guidance_scale
    if req.guidance_scale_2 is None and d.guidance_scale_2 is not None:
        given["guidance_scale_2"] = guidance  # diffusers: left out, it is the call's guidance_scale
    for name in ("prompt_2", "negative_prompt_2"):
        if getattr(req, name) is not None and not lim.prompt_2:
            raise FieldError(
                name,
                "not_supported",
                f"{info.id} ({info.family}) has one text encoder; {name} must be left out",
            )
    if req.clip_skip is not None:
        if lim.max_clip_skip is None:
            raise FieldError("clip_skip", "not_supported", f"{info.id} ({info.family}) takes no clip_skip")
        if req.clip_skip > lim.max_clip_skip:
            raise FieldError(
                "clip_skip",
                "out_of_range",
                f"clip_skip must be between 0 and {lim.max_clip_skip} for {info.id}, got {req.clip_skip}",
            )
    micro = {name: getattr(req, name) for name in MICRO_CONDITIONING if getattr(req, name) is not None}
    if micro and not lim.micro_conditioning:
        name = next(iter(micro))
        raise FieldError(
            name, "not_supported", f"{info.id} ({info.family}) takes no micro-conditioning ({name})"
        )
    strength = _image_task_strength(req, info, steps)
    loras = _check_loras(req, info)
    cache = _check_cache(req, info)
    return JobParams(
        model=info.id,
        prompt=req.prompt,
        negative_prompt=req.negative_prompt,
        prompt_2=req.prompt_2 or None,  # "" is the prompt's (diffusers' `prompt_2 or prompt`)
        negative_prompt_2=req.negative_prompt_2 or None,
        clip_skip=req.clip_skip,
        **micro,
        **given,
        width=width,
        height=height,
        num_frames=frames,
        num_inference_steps=steps,
        sigmas=req.sigmas,
        timesteps=req.timesteps,
        eta=req.eta or None,  # 0 is diffusers' default: the same job as none
        guidance_scale=guidance,
        fps=None if lim.frames is None else (req.fps if req.fps is not None else d.fps or DEFAULT_FPS),
        scheduler=req.scheduler,
        seed=req.seed if req.seed is not None else secrets.randbelow(MAX_SEED + 1),
        n=req.n,
        output_format=fmt,
        output_compression=req.output_compression,
        metadata=req.metadata,
        strength=strength,
        padding_mask_crop=req.padding_mask_crop,
        # `previews: true` alone: about ten previews over the run (models/engine/previews.py's default_every).
        preview_every=req.preview_every or (max(1, steps // 10) if req.previews else 0),
        loras=loras,
        cache=cache,
    )


def _check_cache(req: GenerateRequest, info: ModelInfo) -> CacheSettings | None:
    """The step cache a job runs with: a method the model lists (422 naming `cache.method` otherwise), its
    threshold or the method's default."""
    if req.cache is None:
        return None
    methods = info.limits.cache
    if not methods:
        raise FieldError(
            "cache", "not_supported", f"{info.id} ({info.family}) has no step cache; leave cache out"
        )
    if req.cache.method not in methods:
        raise FieldError(
            "cache.method",
            "not_supported",
            f"cache method must be one of {sorted(methods)} for {info.id}, got {req.cache.method!r}",
        )
    threshold = req.cache.threshold
    if threshold is None:
        threshold = methods[req.cache.method].default_threshold
    return CacheSettings(method=req.cache.method, threshold=threshold)


def image_task(has_image: bool, has_mask: bool, tasks: list[str]) -> str:
    """The task a request's inputs ask for: inpaint (image and mask), image-to-image, or image-to-video for a
    model that takes that; without an image the model's text task."""
    if has_mask:
        return "inpaint"
    if has_image:
        return "image-to-video" if "image-to-video" in tasks else "image-to-image"
    return "text-to-video" if "text-to-video" in tasks or "image-to-video" in tasks else "text-to-image"


def _image_task_strength(req: GenerateRequest, info: ModelInfo, steps: int) -> float | None:
    """Check the image inputs against the model's tasks (422 naming the field); the strength the job runs with
    (the task's default when none was asked), None for a task without one."""
    tasks, lim = list(info.limits.tasks), info.limits
    if req.control_image is not None and not lim.control_image:
        raise FieldError("control_image", "not_supported", f"{info.id} is not a control model: it takes none")
    if lim.control_image and req.control_image is None:
        raise FieldError(
            "control_image",
            "missing",
            f"{info.id} is a control model: it needs control_image (its edge or depth map)",
        )
    if req.mask is not None and req.image is None:
        raise FieldError("mask", "mask_without_image", "mask needs an image to inpaint: give image too")
    if req.last_image is not None and not lim.last_image:
        raise FieldError(
            "last_image",
            "not_supported",
            f"{info.id} is not a first-last-frame model: it takes no last_image",
        )
    if req.strength is not None and req.image is None:
        raise FieldError(
            "strength", "strength_without_image", "strength applies to an image input: give image"
        )
    if req.padding_mask_crop is not None and req.mask is None:
        raise FieldError(
            "padding_mask_crop",
            "padding_mask_crop_without_mask",
            "padding_mask_crop crops around an inpainting mask: give image and mask",
        )
    task = image_task(req.image is not None, req.mask is not None, tasks)
    if task not in tasks:
        if req.image is None:
            raise FieldError("image", "missing", f"{info.id} needs an image: it takes {tasks}")
        if task == "image-to-image" and "inpaint" in tasks:  # an inpainting model (a Fill or 9-channel one)
            raise FieldError("mask", "missing", f"{info.id} inpaints: it needs a mask besides the image")
        field = "mask" if req.mask is not None else "image"
        raise FieldError(
            field, "task_not_supported", f"{info.id} does not take {task} ({field} given); it takes {tasks}"
        )
    if lim.last_image and not lim.last_image_optional and req.last_image is None:
        raise FieldError(
            "last_image",
            "missing",
            f"{info.id} is a first-last-frame model: it needs last_image besides image",
        )
    defaults = lim.strength.defaults if lim.strength is not None else {}
    if task not in defaults:
        if req.strength is not None:
            raise FieldError("strength", "not_supported", f"{info.id} takes no strength for {task}")
        return None
    strength = defaults[task] if req.strength is None else req.strength
    low, high = lim.strength.min, lim.strength.max
    if req.strength is not None and not low < strength <= high:
        raise FieldError(
            "strength",
            "out_of_range",
            f"strength must be in ({low:g}, {high:g}] for {info.id}, got {strength}",
        )
    if lim.strength.rule == "int" and int(steps * strength) < 1:
        # SDXL's rule (diffusers' get_timesteps) runs int(steps * strength) steps: none is not a generation. With
        # the task's default strength it is the step count the client chose that is too small: in
        # num_inference_steps, or in a custom schedule's values.
        source = next(
            (f for f in ("sigmas", "timesteps") if getattr(req, f) is not None), "num_inference_steps"
        )
        if req.strength is None:
            need = math.ceil(1 / strength)
            if source == "num_inference_steps":
                what = f"{need} num_inference_steps"
            else:  # Euler's sigmas hold the last step's end too
                rules = lim.scheduler_arguments.get(req.scheduler or DEFAULT_SCHEDULER)
                values = need + 1 if source == "sigmas" and rules is not None and rules.sigmas_end else need
                what = f"{need} steps ({values} {source})"
            raise FieldError(
                source,
                "no_steps",
                f"{task}'s default strength {strength:g} of {steps} steps runs no step on {info.id}: at least "
                f"{what} (or a larger strength)",
            )
        raise FieldError(
            "strength",
            "no_steps",
            f"strength {strength} of {steps} steps runs no step on {info.id}: at least {min_strength(steps):g} "
            f"(or more steps)",
        )
    return strength


def normalise(req: GenerateRequest, info: ModelInfo, max_prompt_chars: int) -> JobParams:
    """The request with the model's defaults filled in and its limits checked (422 `FieldError` naming the field
    and the rule: `not_multiple`, `out_of_range`, `size_not_supported`, `not_supported`, `string_too_long` past
    the `max_prompt_chars` setting; for video `frames_not_supported`, a `num_frames` its pools did not compile)."""
    try:
        return _normalise(req, info, max_prompt_chars)
    except FieldError:
        metrics.JOBS_REJECTED.labels("invalid").inc()
        raise

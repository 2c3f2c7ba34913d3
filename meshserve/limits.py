"""The one check of a request against a model's limits, for every side that checks one.

    check_request(limits, {"width": 64, "height": 48, "num_inference_steps": 4, "n": 1}, model="tiny-sdxl")

raises `LimitError(field, rule, message)` for the first field that breaks a rule. Its callers: the API
(service/api/catalog.py: a 422 naming the field and the rule), the pools (workers/pool.py: a bucket or a frame
count the model cannot run, at start-up) and the pipelines (models/engine/pipeline.py: a library call, as a
PipelineError). Pure Python, no imports: `service/` never imports JAX or `models/`, and `models/` never imports
`service/`; both import this.

`limits` is the pipeline's `limits` mapping or the service's `ModelLimits` (attributes): size_multiple,
min_size, max_size, min_steps, max_steps, max_n, schedulers, output_formats, and when present buckets (the only
sizes), frames ({min_frames, max_frames, step, offset, default, served}: a video model), max_sequence_length (a
model with a text length), tasks (what inputs the model takes: text-to-image, image-to-image, inpaint,
text-to-video, image-to-video; absent: its text task) and strength ({min (exclusive), max, defaults: {task:
strength}}: a model with an image-to-image or inpaint task). Fields absent from the request, or None, are not
checked. The rules, as the API's 422 `code`: int_type, number_type, not_multiple, out_of_range,
size_not_supported, frames_not_supported, not_supported.

`check_scheduler_arguments` checks a custom schedule (diffusers' `sigmas` / `timesteps` call arguments),
DDIM's `eta` and a scheduler's own step cap against limits["scheduler_arguments"] and gives the schedule's step
count; its own rules: conflict, not_decreasing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from numbers import Integral, Real

# What a model may take as inputs (limits["tasks"]); a model that names none takes text only.
TASKS: tuple[str, ...] = ("text-to-image", "image-to-image", "inpaint", "text-to-video", "image-to-video")
# The tasks that take a `strength` (how much of the schedule runs from the noised image).
STRENGTH_TASKS: tuple[str, ...] = ("image-to-image", "inpaint")

# Output formats: an image model's, its default first, and a video model's (an animated WebP is either).
IMAGE_FORMATS: tuple[str, ...] = ("png", "jpeg", "webp")
VIDEO_FORMATS: tuple[str, ...] = ("mp4", "webp")
# The formats `output_compression` (their encoder's quality) applies to.
LOSSY_FORMATS: tuple[str, ...] = ("jpeg", "webp")


class LimitError(ValueError):
    """A request field outside the model's limits: `field` (as the caller names it), `rule` (a 422 code)."""

    def __init__(self, field: str, rule: str, message: str):
        super().__init__(message)
        self.field, self.rule = field, rule


def _get(limits, name: str, default=None):
    if isinstance(limits, Mapping):
        value = limits.get(name, default)
    else:
        value = getattr(limits, name, default)
    return default if value is None else value


def output_formats(limits) -> list[str]:
    """The formats a model's outputs can be written in, its default first (by task when limits name none)."""
    formats = _get(limits, "output_formats")
    if formats:
        return list(formats)
    return list(VIDEO_FORMATS if _get(limits, "frames") is not None else IMAGE_FORMATS)


def tasks(limits) -> list[str]:
    """The tasks a model takes: its limits' `tasks`, else its text task (text-to-video with frames)."""
    named = _get(limits, "tasks")
    if named:
        return list(named)
    return ["text-to-video" if _get(limits, "frames") is not None else "text-to-image"]


def check_request(
    limits, request: Mapping, *, model: str = "the model", names: Mapping[str, str] | None = None
) -> None:
    """Raises LimitError for the first field of `request` that `limits` refuses. `names` renames fields in the
    errors (a pipeline call says num_images_per_prompt where the API says n)."""
    names = names or {}

    def integer(field: str, low: int, high: int) -> int | None:
        value = request.get(field)
        if value is None:
            return None
        name = names.get(field, field)
        if not isinstance(value, Integral) or isinstance(value, bool):
            raise LimitError(name, "int_type", f"{name} must be an integer, got {value!r}")
        if not low <= value <= high:
            raise LimitError(
                name, "out_of_range", f"{name} must be an integer between {low} and {high}, got {value}"
            )
        return int(value)

    _check_task(limits, request, model)
    _check_size(limits, request, model, names)
    integer("num_inference_steps", _get(limits, "min_steps", 1), _get(limits, "max_steps"))
    integer("n", 1, _get(limits, "max_n"))
    scheduler, schedulers = request.get("scheduler"), _get(limits, "schedulers")
    if scheduler is not None and schedulers and scheduler not in schedulers:
        raise LimitError(
            "scheduler",
            "not_supported",
            f"scheduler must be one of {list(schedulers)} for {model}, got {scheduler!r}",
        )
    fmt = request.get("output_format")
    if fmt is not None and fmt not in output_formats(limits):
        raise LimitError(
            "output_format",
            "not_supported",
            f"output_format {fmt!r} is not one of {output_formats(limits)} for {model}",
        )
    if integer("output_compression", 0, 100) is not None and fmt not in LOSSY_FORMATS:
        raise LimitError(
            "output_compression",
            "not_supported",
            f"output_compression applies to {' and '.join(LOSSY_FORMATS)} outputs; this job writes {fmt}",
        )
    frames = _get(limits, "frames")
    if frames is None:
        for field in ("num_frames", "fps"):
            if request.get(field) is not None:
                raise LimitError(field, "not_supported", f"{model} makes images; {field} must be left out")
    else:
        count = integer("num_frames", _get(frames, "min_frames"), _get(frames, "max_frames"))
        step, offset, served = _get(frames, "step", 1), _get(frames, "offset", 0), _get(frames, "served")
        if count is not None and (count - offset) % step:
            raise LimitError(
                "num_frames", "not_multiple", f"num_frames must be {step}k+{offset}, got {count}"
            )
        if count is not None and served is not None and count not in served:
            raise LimitError(
                "num_frames",
                "frames_not_supported",
                f"{count} frames is not a frame count {model} serves; served: "
                + (", ".join(map(str, served)) or "none (its pools share no frame count)"),
            )
    length = _get(limits, "max_sequence_length")
    if length is None and request.get("max_sequence_length") is not None:
        raise LimitError("max_sequence_length", "not_supported", f"{model} has no text length; leave it out")
    if length is not None:
        integer("max_sequence_length", 1, length)


def min_strength(steps: int) -> float:
    """The smallest strength, at 3 significant digits rounded up, whose int(steps * strength) runs a step
    (SDXL's rule, diffusers' get_timesteps): 0.334 for 3 steps, where 1/3 printed as 0.333 would run none."""
    exact = 1 / steps
    scale = 10 ** (2 - math.floor(math.log10(exact)))
    value = math.ceil(exact * scale - 1e-9) / scale
    return value if int(steps * value) >= 1 else math.ceil(exact * scale) / scale


def _check_task(limits, request: Mapping, model: str) -> None:
    """`task` among the model's tasks; `strength` a number in (min, max] for a task that takes one."""
    task = request.get("task")
    if task is not None and task not in tasks(limits):
        raise LimitError("task", "not_supported", f"{model} does not take {task}; it takes {tasks(limits)}")
    strength = request.get("strength")
    if strength is None:
        return
    if task is not None and task not in STRENGTH_TASKS:
        raise LimitError(
            "strength", "not_supported", f"strength applies to {list(STRENGTH_TASKS)}, not {task}"
        )
    bounds = _get(limits, "strength")
    if bounds is None:
        raise LimitError(
            "strength", "not_supported", f"{model} takes no strength (no image-to-image or inpaint)"
        )
    if not isinstance(strength, Real) or isinstance(strength, bool) or not math.isfinite(strength):
        raise LimitError("strength", "number_type", f"strength must be a number, got {strength!r}")
    low, high = _get(bounds, "min", 0.0), _get(bounds, "max", 1.0)
    if not low < strength <= high:
        raise LimitError("strength", "out_of_range", f"strength must be in ({low}, {high}], got {strength}")


def _check_size(limits, request: Mapping, model: str, names: Mapping[str, str]) -> None:
    width, height = request.get("width"), request.get("height")
    for field, value in (("width", width), ("height", height)):
        if value is not None and (not isinstance(value, Integral) or isinstance(value, bool)):
            name = names.get(field, field)
            raise LimitError(name, "int_type", f"{name} must be an integer, got {value!r}")
    buckets = _get(limits, "buckets")
    if buckets is not None and width is not None and height is not None:
        buckets = [tuple(b) for b in buckets]
        if (width, height) in buckets:
            return
        # Name the field at fault: the width when no served size has it, else the height.
        field = "height" if any(w == width for w, _ in buckets) else "width"
        sizes = ", ".join(f"{w}x{h}" for w, h in buckets) or "none (its pools share no size)"
        raise LimitError(
            field,
            "size_not_supported",
            f"{width}x{height} (width x height) is not a size {model} serves; served sizes: {sizes}",
        )
    m = _get(limits, "size_multiple", 1)
    low, high = _get(limits, "min_size", m), _get(limits, "max_size")
    for field, value in (("width", width), ("height", height)):
        if value is None:
            continue
        name = names.get(field, field)
        if value % m or value < m:
            raise LimitError(name, "not_multiple", f"{name} must be a positive multiple of {m}, got {value}")
        if not low <= value <= high:
            raise LimitError(
                name, "out_of_range", f"{name} must be an integer between {low} and {high}, got {value}"
            )


# limits["scheduler_arguments"]' key for the model's own scheduler (a request that names none).
DEFAULT_SCHEDULER = "default"
# The smallest sigma a step may start from: Euler divides by it, and below float32's normal range (1.2e-38)
# XLA:CPU flushes it to 0 (a NaN image, where torch still computes one: an audit, 2026-11-29). diffusers'
# own sigma-to-timestep clamps at this value.
MIN_STEP_SIGMA = 1e-10


def check_scheduler_arguments(
    limits, request: Mapping, *, model: str = "the model", default_steps: int | None = None
) -> int | None:
    """The steps of the request's custom schedule, diffusers' `sigmas` or `timesteps` (None: it has none), after
    checking it against limits["scheduler_arguments"][scheduler] (absent: the model takes none), as diffusers'
    `retrieve_timesteps` and `set_timesteps` take them: {"sigmas", "timesteps": whether the scheduler takes
    each; "sigmas_end": whether sigmas include the last step's end (Euler: N + 1 values for N steps, the last
    0 or more; flow matching: N, a 0 appended); "max_sigma": the largest sigma (flow matching: 1) or None;
    "max_timestep": the largest timestep}. Values run strictly downwards (from noise to the image); a sigma a
    step starts from is at least MIN_STEP_SIGMA (Euler divides by it). `request`: sigmas, timesteps, scheduler
    and, when the caller gave one, num_inference_steps, which must then equal the schedule's steps. Also checks
    the request's `eta`, diffusers' DDIM noise weight (TCD's gamma) in [0, 1]: a scheduler whose rules have
    "eta" takes it; any takes 0 (diffusers' default, which changes nothing). And, without a custom schedule, the
    step count (the request's num_inference_steps, else `default_steps`) against the scheduler's own
    "max_steps" (LCM's schedule is a subset of its distillation's 50 steps; diffusers' set_timesteps raises
    past them) and "min_steps" (PNDM's Runge-Kutta start takes 3 steps and one more)."""
    scheduler = request.get("scheduler")
    rules = _get(_get(limits, "scheduler_arguments", {}), scheduler or DEFAULT_SCHEDULER)
    named = f"scheduler {scheduler!r}" if scheduler else "its default scheduler"
    eta = request.get("eta")
    if eta is not None:
        if not isinstance(eta, Real) or isinstance(eta, bool) or not math.isfinite(eta):
            raise LimitError("eta", "number_type", f"eta must be a number, got {eta!r}")
        if not 0 <= eta <= 1:
            raise LimitError("eta", "out_of_range", f"eta must be in [0, 1], got {eta}")
        if eta != 0 and (rules is None or not _get(rules, "eta", False)):
            raise LimitError(
                "eta",
                "not_supported",
                f"{model} takes no eta with {named} (DDIM's noise weight, TCD's gamma)",
            )
    sigmas, timesteps = request.get("sigmas"), request.get("timesteps")
    if sigmas is None and timesteps is None:
        steps = request.get("num_inference_steps")
        steps = default_steps if steps is None else steps
        cap = None if rules is None else _get(rules, "max_steps")
        if cap is not None and isinstance(steps, Integral) and steps > cap:
            raise LimitError(
                "num_inference_steps",
                "out_of_range",
                f"num_inference_steps must be at most {cap} with {named} for {model}, got {steps}",
            )
        floor = None if rules is None else _get(rules, "min_steps")
        if floor is not None and isinstance(steps, Integral) and steps < floor:
            raise LimitError(
                "num_inference_steps",
                "out_of_range",
                f"num_inference_steps must be at least {floor} with {named} for {model}, got {steps}",
            )
        return None
    if sigmas is not None and timesteps is not None:
        raise LimitError("timesteps", "conflict", "only one of sigmas or timesteps can be given")
    field, values = ("sigmas", sigmas) if sigmas is not None else ("timesteps", timesteps)
    if rules is None or not _get(rules, field, False):
        raise LimitError(field, "not_supported", f"{model} takes no custom {field} with {named}")
    values = list(values)
    for v in values:
        if field == "timesteps" and (not isinstance(v, Integral) or isinstance(v, bool)):
            raise LimitError(field, "int_type", f"timesteps must be integers, got {v!r}")
        if not isinstance(v, Real) or isinstance(v, bool) or not math.isfinite(v):
            raise LimitError(field, "number_type", f"{field} must be finite numbers, got {v!r}")
    end = field == "sigmas" and _get(rules, "sigmas_end", False)
    steps = len(values) - 1 if end else len(values)
    low, high = _get(limits, "min_steps", 1), _get(limits, "max_steps")
    if not low <= steps <= high:
        extra = " plus the last step's end" if end else ""
        raise LimitError(
            field,
            "out_of_range",
            f"{field} must hold one value per step{extra}, {low} to {high} steps for {model}; got {len(values)} "
            "values",
        )
    if any(a <= b for a, b in itertools.pairwise(values)):
        raise LimitError(field, "not_decreasing", f"{field} must decrease strictly, from noise to the image")
    # Decreasing: the first value is the largest, the last the smallest.
    if field == "sigmas":
        top = _get(rules, "max_sigma")
        last_start = values[-2] if end else values[-1]  # the smallest sigma a step starts from
        bad = (
            values[-1] if values[-1] < 0
            else last_start if last_start < MIN_STEP_SIGMA
            else values[0] if top is not None and values[0] > top
            else None
        )  # fmt: skip
        if bad is not None:
            span = f"[{MIN_STEP_SIGMA:g}, {top}]" if top is not None else f"at least {MIN_STEP_SIGMA:g}"
            ends = " (the last step's end: 0 or more)" if end else ""
            raise LimitError(field, "out_of_range", f"sigmas must be {span}{ends}; got {bad}")
    else:
        top = _get(rules, "max_timestep")
        if values[-1] < 0 or values[0] > top:
            bad = values[-1] if values[-1] < 0 else values[0]
            raise LimitError(field, "out_of_range", f"timesteps must be in [0, {top}]; got {bad}")
    given = request.get("num_inference_steps")
    if given is not None and given != steps:
        raise LimitError(
            "num_inference_steps",
            "conflict",
            f"num_inference_steps ({given}) differs from the {steps} steps of {field}; leave it out",
        )
    return steps

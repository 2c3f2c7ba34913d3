"""OpenAI-compatible `POST /v1/images/generations` and `POST /v1/images/edits` (multipart: an uploaded image,
an optional mask): the same jobs as /v1/generate, answered when they end."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import time
from collections.abc import Iterator
from typing import Annotated, Literal
from urllib.parse import urlsplit

from fastapi import APIRouter, File, Form, Request, UploadFile
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.datastructures import UploadFile as StarletteUploadFile

from meshserve.service import metrics
from meshserve.service.api.catalog import ServedModel, normalise
from meshserve.service.api.deps import CatalogDep, SettingsDep, StoreDep, TenantDep
from meshserve.service.api.errors import ApiError, FieldError
from meshserve.service.api.image_requests import drop_unused_inputs, with_image_inputs
from meshserve.service.api.routes.generate import ERRORS, idempotency_key, outcome_unknown
from meshserve.service.api.wait_slots import ClientGone, client_gone, wait_unless_gone
from meshserve.service.auth import Tenant
from meshserve.service.contract import Job, JobParams, JobStatus, Priority
from meshserve.service.job_queue import SubmitOutcomeUnknown
from meshserve.service.schemas import (
    MAX_MODEL_ID_CHARS,
    MAX_PADDING_MASK_CROP,
    OUTPUT_COMPRESSION,
    ErrorResponse,
    GenerateRequest,
    ImageData,
    ImagesRequest,
    ImagesResponse,
)
from meshserve.service.settings import Settings
from meshserve.service.store import Store, request_hash

router = APIRouter(tags=["openai"])

# OpenAI's SDKs retry 408, 409, 429 and every 5xx twice by default, each time as a new submit, unless the answer
# says `x-should-retry: false`: a failed, canceled or timed-out job was submitted three times (a client audit,
# 2026-11-29; a canceled one came back twice). An answer about a job that exists says not to retry; the job's
# Location says where to follow it. An `Idempotency-Key` makes a retry return the same job.
NO_RETRY = {"x-should-retry": "false"}
IDEMPOTENCY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "schema": {"type": "string"},
    "description": "As on /v1/generate: the same key and request return the same job (and its result).",
}

RESPONSES = {
    **ERRORS,
    409: {"model": ErrorResponse, "description": "The job was canceled."},
    410: {"model": ErrorResponse, "description": "`b64_json`: an output expired before it was read."},
    502: {"model": ErrorResponse, "description": "The job failed; `code` is the job's error code."},
    504: {
        "model": ErrorResponse,
        "description": "Not done within the timeout; the job goes on (id in message).",
    },
}
SIZE_PATTERN = r"^(\d{1,5}x\d{1,5}|auto)$"


def _params(served: ServedModel, settings: Settings, size: str | None, **fields) -> JobParams:
    """The OpenAI fields as a /v1/generate request, normalised (422s name `size`, not width and height)."""
    if served.info.limits.frames is not None:  # the answer's `data` are images: a video has no place in it
        raise FieldError(
            "model", "not_supported", f"{served.info.id} makes videos, not images: use POST /v1/generate"
        )
    width = height = None
    if size and size != "auto":
        width, height = (int(v) for v in size.split("x"))
    try:
        req = GenerateRequest(model=served.info.id, width=width, height=height, **fields)
    except ValidationError as e:  # e.g. size "0x0": the pattern admits it, the sizes' rules do not
        first = e.errors()[0]
        field = (
            "size"
            if first["loc"] and first["loc"][0] in ("width", "height")
            else ".".join(map(str, first["loc"]))
        )
        metrics.JOBS_REJECTED.labels("invalid").inc()
        raise FieldError(field, first["type"], f"{field}: {first['msg']}") from None
    try:
        return normalise(req, served.info, settings.max_prompt_chars)
    except FieldError as e:
        if e.field in ("width", "height"):  # this route's clients sent `size`, not width and height
            e.field = "size"
        raise


@router.post(
    "/v1/images/generations",
    response_model=ImagesResponse,
    responses=RESPONSES,
    openapi_extra={"parameters": [IDEMPOTENCY]},
    summary="Create images (OpenAI shape)",
)
async def create_image(
    body: ImagesRequest,
    request: Request,
    store: StoreDep,
    catalog: CatalogDep,
    settings: SettingsDep,
    tenant: TenantDep,
) -> ImagesResponse:
    if body.stream:  # OpenAI's SDK would read a JSON answer as an event stream and fail on it
        raise FieldError(
            "stream",
            "not_supported",
            "streaming partial images is not offered; previews stream over GET /v1/jobs/{id}/events",
        )
    key = idempotency_key(request)
    served = await catalog.resolve(body.model)
    fields = {"prompt": body.prompt, "n": body.n or 1, "output_format": body.output_format}
    fields["output_compression"] = body.output_compression
    params = _params(served, settings, body.size, **fields)
    digest = request_hash({"route": "generations", **body.model_dump(exclude_defaults=True)}) if key else ""
    with _wait_slot(request, tenant.name):
        try:
            job = await _submit(store, params, key, digest, tenant)
        except SubmitOutcomeUnknown as e:
            raise _unknown(e, settings, key) from None
        return await _answer(job, body.response_format or "url", request, store, settings)


async def _submit(store: Store, params: JobParams, key: str | None, digest: str, tenant: Tenant) -> Job:
    """Queue the job at normal priority for the tenant, idempotently when the request has a key."""
    return await store.submit(
        params, Priority.NORMAL, key, request_digest=digest, owner=tenant.name, max_active=tenant.max_active
    )


def _unknown(e: SubmitOutcomeUnknown, settings: Settings, key: str | None) -> ApiError:
    """The submit's outcome is unknown: without a key a retry may make a second job, so the SDK is told not to."""
    error = outcome_unknown(e, settings, key)
    if key is None:
        error.headers = {**(error.headers or {}), **NO_RETRY}
    return error


@contextlib.contextmanager
def _wait_slot(request: Request, tenant: str) -> Iterator[None]:
    """This route answers the result, so it waits: a wait slot (service/api/wait_slots.py) before it submits,
    or a refusal that leaves nothing accepted."""
    slots = request.app.state.wait_slots
    with slots.slot(tenant) as got:
        if not got:
            raise slots.refused(tenant, "too_many_waiting")
        yield


async def _upload(file: UploadFile, field: str, settings: Settings) -> bytes:
    data = await file.read(settings.max_image_bytes + 1)
    if len(data) > settings.max_image_bytes:
        metrics.JOBS_REJECTED.labels("invalid").inc()
        raise FieldError(field, "too_large", f"{field} is larger than {settings.max_image_bytes} bytes")
    return data


@router.post(
    "/v1/images/edits",
    response_model=ImagesResponse,
    responses=RESPONSES,
    openapi_extra={"parameters": [IDEMPOTENCY]},
    summary="Edit an image (OpenAI shape, multipart)",
    description="Image-to-image, or inpainting with a mask. As OpenAI's: the mask's transparent pixels are "
    "repainted (a mask without alpha is read as grayscale: white repaints). Without a `mask`, as dall-e-2's, "
    "an image with transparent pixels is its own mask (inpaint); an opaque one is edited whole (image-to-image). "
    "Bodies up to `max_image_body_bytes`; each file up to `max_image_bytes` and `max_image_pixels`; PNG, JPEG "
    "or WebP.",
)
async def edit_image(
    request: Request,
    store: StoreDep,
    catalog: CatalogDep,
    settings: SettingsDep,
    tenant: TenantDep,
    prompt: Annotated[str, Form(min_length=1, description="At most `max_prompt_chars` characters.")],
    image: Annotated[
        UploadFile | None,
        File(
            description="The image to edit: PNG, JPEG or WebP, one frame (or one `image[]` part, the SDKs' "
            "list form)."
        ),
    ] = None,
    mask: Annotated[
        UploadFile | None, File(description="Where to repaint (transparent), the image's size.")
    ] = None,
    model: Annotated[str | None, Form(max_length=MAX_MODEL_ID_CHARS)] = None,
    n: Annotated[int, Form(ge=1)] = 1,
    size: Annotated[
        str | None, Form(pattern=SIZE_PATTERN, description='"WIDTHxHEIGHT"; "auto": the model\'s default.')
    ] = None,
    response_format: Annotated[Literal["url", "b64_json"], Form()] = "url",
    output_format: Annotated[
        Literal["png", "jpeg", "webp"] | None, Form(description="As /v1/images/generations'.")
    ] = None,
    strength: Annotated[
        float | None, Form(gt=0, le=1, allow_inf_nan=False, description="As /v1/generate's (an extension).")
    ] = None,
    output_compression: Annotated[int | None, Form(ge=0, le=100, description=OUTPUT_COMPRESSION)] = None,
    padding_mask_crop: Annotated[
        int | None,
        Form(
            ge=0,
            le=MAX_PADDING_MASK_CROP,
            description="As /v1/generate's (an extension): inpaint only the masked region and lay it back into "
            "the image, whose size the outputs then have. Needs a mask (or an image with transparent pixels).",
        ),
    ] = None,
) -> ImagesResponse:
    image = _one_file_each(await request.form())
    key = idempotency_key(request)
    served = await catalog.resolve(model)
    # The task and strength are checked on the fields' presence; the bytes come next.
    marker = "uploaded"
    fields = dict(prompt=prompt, n=n, strength=strength, output_format=output_format, image=marker)
    fields["output_compression"] = output_compression
    # Without a mask part, whether the image is its own mask (dall-e-2's rule) is known once it is read: the
    # crop is checked with the inpaint's fields then.
    crop = {"padding_mask_crop": padding_mask_crop}
    first = fields | crop if mask is not None else fields
    params = _params(served, settings, size, **first, mask=marker if mask is not None else None)
    with _wait_slot(request, tenant.name):  # before the inputs are stored: a refusal leaves none
        image_bytes = await _upload(image, "image", settings)
        mask_bytes = await _upload(mask, "mask", settings) if mask is not None else None
        digest = ""
        if key:  # the request's fields and its files' bytes
            hashed = {"route": "edits", "prompt": prompt, "model": model, "n": n, "size": size}
            hashed["output_format"] = output_format
            # Extensions are hashed only when given, so keys of earlier releases keep their digest.
            for name, value in (("output_compression", output_compression), *crop.items()):
                if value is not None:
                    hashed[name] = value
            hashed |= {"response_format": response_format, "strength": strength}
            for name, data in (("image", image_bytes), ("mask", mask_bytes)):
                hashed[name] = None if data is None else hashlib.sha256(data).hexdigest()
            digest = request_hash(hashed)
        params = await with_image_inputs(
            store,
            settings,
            params,
            image_bytes,
            mask_bytes,
            decode_slots=request.app.state.decode_slots,
            mask_from_alpha=True,
            # dall-e-2's rule: without a mask, the image's transparent pixels are where it is repainted.
            alpha_as_mask=mask is None and "inpaint" in served.info.limits.tasks,
        )
        if mask is None and params.mask is not None:  # so it is an inpaint: its task and default strength
            refs = {"image": params.image, "mask": params.mask}
            params = _params(served, settings, size, **fields, **crop, mask=marker).model_copy(update=refs)
        elif mask is None and padding_mask_crop is not None:  # an opaque image: an image-to-image has no mask
            await drop_unused_inputs(store, params, None)
            metrics.JOBS_REJECTED.labels("invalid").inc()
            raise FieldError(
                "padding_mask_crop",
                "padding_mask_crop_without_mask",
                "padding_mask_crop crops around an inpainting mask: give a mask, or an image with transparent "
                "pixels",
            )
        job, unknown = None, None
        try:
            job = await _submit(store, params, key, digest, tenant)
        except SubmitOutcomeUnknown as e:
            unknown = e
        finally:
            if unknown is None:  # a job that may exist keeps its inputs (they expire with it)
                await drop_unused_inputs(store, params, job)
        if unknown is not None:
            raise _unknown(unknown, settings, key)
        return await _answer(job, response_format, request, store, settings)


def _one_file_each(form) -> StarletteUploadFile:
    """The edit's image: an edit takes one image and at most one mask, each as a part of its name or as OpenAI's
    list form (`image[]`, what the SDKs send for a list); a second part of either is refused, where the form
    reader kept one of them silently (and a lone `image[]` was answered "image: Field required"); so is a second
    value of any other field."""
    for field in ("image", "mask"):
        parts = len(form.getlist(field)) + len(form.getlist(f"{field}[]"))
        if parts > 1:
            raise FieldError(field, "too_many", f"{field}: one file per edit, got {parts}")
    for field in set(form.keys()):  # two prompts (or sizes...): the reader kept the last one silently
        if (parts := len(form.getlist(field))) > 1:
            raise FieldError(field, "too_many", f"{field}: one value per edit, got {parts}")
    image = form.get("image") or form.get("image[]")
    if image is None:
        raise FieldError("image", "missing", "image: Field required (missing)")
    if not isinstance(image, StarletteUploadFile):  # (the form's parts are Starlette's, FastAPI's subclass)
        raise FieldError("image", "not_a_file", "image must be a file part of the form, not a text field")
    return image


async def _answer(
    job: Job, response_format: str, request: Request, store: Store, settings: Settings
) -> ImagesResponse:
    """Wait for the job and answer in OpenAI's shape (urls or base64), or the error its end calls for."""
    if not job.replayed:  # an idempotent replay created nothing
        metrics.JOBS_SUBMITTED.labels(job.model, job.priority.value).inc()
    try:
        # A client that leaves gives its wait slot back at once (service/api/wait_slots.py); its job goes on.
        waited = await wait_unless_gone(store.wait(job.id, settings.openai_timeout_s), request)
    except ClientGone:
        raise client_gone(job.id) from None
    except RedisError:
        # Accepted and running on: say which job, so a client follows it instead of submitting it again.
        raise ApiError(
            503,
            "store_unavailable",
            f"job {job.id} was accepted, but the job store stopped answering while waiting for it; "
            f"follow it at /v1/jobs/{job.id}",
            headers={
                "Location": f"/v1/jobs/{job.id}",
                "Retry-After": str(settings.retry_after_s),
                **NO_RETRY,
            },
        ) from None
    if waited is None and not request.app.state.draining.is_set():  # deleted by its owner while we waited
        raise ApiError(404, "job_not_found", f"job {job.id} was deleted while this request waited for it")
    if waited is None:  # the API is stopping (service/api/draining.py)
        raise ApiError(
            503,
            "shutting_down",
            f"job {job.id} was accepted, but this API process is stopping; follow it at /v1/jobs/{job.id}",
            headers={
                "Location": f"/v1/jobs/{job.id}",
                "Retry-After": str(settings.retry_after_s),
                **NO_RETRY,
            },
        )
    job = waited
    about = {"Location": f"/v1/jobs/{job.id}", **NO_RETRY}
    if job.status == JobStatus.FAILED:
        err = job.error
        raise ApiError(
            502, err.code if err else "job_failed", err.message if err else "the job failed", headers=about
        )
    if job.status == JobStatus.CANCELED:
        raise ApiError(409, "job_canceled", f"job {job.id} was canceled", headers=about)
    if job.status != JobStatus.SUCCEEDED:
        raise ApiError(
            504,
            "timeout",
            f"job {job.id} did not finish within {settings.openai_timeout_s:g} s; "
            f"follow it at /v1/jobs/{job.id}",
            headers=about,
        )
    data = []
    for out in job.outputs:
        if response_format == "b64_json":
            blob = await store.output(job.id, out.index)
            if blob is None:
                raise ApiError(410, "output_expired", f"output {out.index} of job {job.id} has expired")
            data.append(ImageData(b64_json=base64.b64encode(blob).decode()))
        else:
            data.append(ImageData(url=_absolute(out.url, request)))
    return ImagesResponse(created=int(job.created_at or time.time()), data=data)


def _absolute(url: str, request: Request) -> str:
    """An output URL clients can fetch: the API's own `/v1/jobs/...` path under this request's base, or as it is
    when already absolute (outputs served by an object store or CDN, `output_url_base`)."""
    if urlsplit(url).scheme:
        return url
    return str(request.base_url).rstrip("/") + url

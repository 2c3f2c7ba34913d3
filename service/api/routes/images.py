"""OpenAI-compatible `POST /v1/images/generations`: the same jobs, answered when they end."""

from __future__ import annotations

import base64
import time
from urllib.parse import urlsplit

from fastapi import APIRouter, Request
from pydantic import ValidationError

from meshserve.service import metrics
from meshserve.service.api.catalog import normalise
from meshserve.service.api.deps import CatalogDep, SettingsDep, StoreDep, TenantDep
from meshserve.service.api.errors import ApiError, FieldError
from meshserve.service.api.routes.generate import ERRORS
from meshserve.service.contract import JobStatus
from meshserve.service.schemas import ErrorResponse, GenerateRequest, ImageData, ImagesRequest, ImagesResponse

router = APIRouter(tags=["openai"])


@router.post(
    "/v1/images/generations",
    response_model=ImagesResponse,
    responses={
        **ERRORS,
        409: {"model": ErrorResponse, "description": "The job was canceled."},
        502: {"model": ErrorResponse, "description": "The job failed; `code` is the job's error code."},
        504: {
            "model": ErrorResponse,
            "description": "Not done within the timeout; the job goes on (id in message).",
        },
    },
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
    served = await catalog.resolve(body.model)
    width = height = None
    if body.size:
        width, height = (int(v) for v in body.size.split("x"))
    try:
        req = GenerateRequest(model=served.info.id, prompt=body.prompt, n=body.n, width=width, height=height)
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
        params = normalise(req, served.info, settings.max_prompt_chars)
    except FieldError as e:
        if e.field in ("width", "height"):  # this route's clients sent `size`, not width and height
            e.field = "size"
        raise
    job = await store.submit(params, owner=tenant.name, max_active=tenant.max_active)
    metrics.JOBS_SUBMITTED.labels(job.model, job.priority.value).inc()
    job = await store.wait(job.id, settings.openai_timeout_s) or job
    if job.status == JobStatus.FAILED:
        err = job.error
        raise ApiError(502, err.code if err else "job_failed", err.message if err else "the job failed")
    if job.status == JobStatus.CANCELED:
        raise ApiError(409, "job_canceled", f"job {job.id} was canceled")
    if job.status != JobStatus.SUCCEEDED:
        raise ApiError(
            504,
            "timeout",
            f"job {job.id} did not finish within {settings.openai_timeout_s:g} s; "
            f"follow it at /v1/jobs/{job.id}",
        )
    data = []
    for out in job.outputs:
        if body.response_format == "b64_json":
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

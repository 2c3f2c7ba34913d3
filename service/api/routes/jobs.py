"""`/v1/jobs`: list a tenant's jobs; `/v1/jobs/{job_id}`: read, delete, cancel, follow (SSE) and download."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from redis.exceptions import RedisError

from meshserve.service.api.byte_ranges import output_response
from meshserve.service.api.deps import JobDep, LastEventId, SettingsDep, StoreDep, TenantDep
from meshserve.service.api.draining import unless_draining
from meshserve.service.api.errors import COMMON_RESPONSES, ApiError, FieldError
from meshserve.service.api.routes.generate import job_reply
from meshserve.service.contract import CONTENT_TYPES, JobStatus
from meshserve.service.job_reads import parse_cursor
from meshserve.service.schemas import MAX_MODEL_ID_CHARS, ErrorResponse, JobList, JobResponse

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=COMMON_RESPONSES)
NOT_FOUND = {404: {"model": ErrorResponse, "description": "No such job (or it expired)."}}
_STREAM_ID = r"^\d{1,20}-\d{1,20}$"
# How often an open stream checks that its key still exists (one EXISTS; no rate-limit token).
KEY_RECHECK_S = 30.0
# The query parameters of `GET /v1/jobs` (`list_jobs`'s, by the names clients use).
LIST_PARAMETERS = frozenset({"limit", "cursor", "status", "model", "tenant"})
# Far above any job's outputs (n <= a model's max_n): a bound so that a huge index is a 422, not a parse of
# thousands of digits.
MAX_OUTPUT_INDEX = 65535


@router.get(
    "",
    response_model=JobList,
    responses={
        403: {"model": ErrorResponse, "description": "`tenant` names another tenant: admin keys only."}
    },
    summary="List your jobs",
)
async def list_jobs(
    request: Request,
    store: StoreDep,
    tenant: TenantDep,
    limit: Annotated[int, Query(ge=1, le=100, description="Jobs per page.")] = 20,
    cursor: Annotated[
        str | None, Query(max_length=100, description="A previous page's `next_cursor`: the jobs after it.")
    ] = None,
    status: Annotated[
        list[JobStatus] | None,
        Query(description="Only jobs in these statuses (repeat the parameter for more)."),
    ] = None,
    model: Annotated[
        str | None, Query(max_length=MAX_MODEL_ID_CHARS, description="Only this model's jobs.")
    ] = None,
    owner: Annotated[
        str | None,
        Query(
            alias="tenant",
            min_length=1,
            max_length=200,
            description="Another tenant's jobs (an admin key's; default: yours).",
        ),
    ] = None,
) -> Response:
    """The jobs you submitted that still exist (a job lives `job_ttl_s` after it ends), newest first. A page
    reads at most 1,000 of your jobs: with a narrow filter it can hold fewer than `limit` and still have
    `has_more`; follow `next_cursor` until it is null. Jobs are listed without `queue_position` (read a job for
    it)."""
    # A misspelt filter (`stauts=`) would list every job as if asked for all: an unknown parameter is a 422.
    unknown = sorted(set(request.query_params) - LIST_PARAMETERS)
    if unknown:
        raise FieldError(
            unknown[0],
            "extra_forbidden",
            f"{unknown[0]!r} is not a parameter of this route; it takes {', '.join(sorted(LIST_PARAMETERS))}",
        )
    if owner is not None and owner != tenant.name and not tenant.admin:
        raise ApiError(403, "admin_required", "listing another tenant's jobs needs an admin key", "tenant")
    try:
        if cursor is not None:
            parse_cursor(cursor)
    except ValueError as e:
        raise ApiError(422, "invalid_cursor", f"cursor: {e}", "cursor") from None
    page = await store.list_jobs(
        owner or tenant.name, limit=limit, cursor=cursor, statuses=status or (), model=model
    )
    listed = JobList(
        data=[JobResponse.from_job(job) for job in page.jobs],
        has_more=page.next_cursor is not None,
        next_cursor=page.next_cursor,
    )
    return Response(listed.model_dump_json(), 200, media_type="application/json")


@router.get("/{job_id}", response_model=JobResponse, responses=NOT_FOUND, summary="Read a job")
async def read_job(job: JobDep, store: StoreDep) -> Response:
    job.queue_position = await store.queue_position(job)
    return job_reply(JobResponse.from_job(job), 200)


@router.delete(
    "/{job_id}",
    status_code=204,
    response_class=Response,
    responses={
        204: {"description": "Deleted: the job, its outputs, its image inputs and its events."},
        **NOT_FOUND,
        409: {"model": ErrorResponse, "description": "The job is queued or running: cancel it first."},
        503: {"model": ErrorResponse, "description": "The store (Redis or the output location) refused."},
    },
    summary="Delete an ended job",
)
async def delete_job(job: JobDep, store: StoreDep) -> Response:
    """Deletes a job that has ended (succeeded, failed, canceled, expired) before its `job_ttl_s`: its outputs
    (in Redis or the output location), the image inputs it was given, its events and its record. Afterwards
    every route answers 404 for it, as for an unknown id; a webhook not yet sent is not sent (one already on its
    way still arrives). A queued
    or running job is a 409: cancel it, then delete it once it ended."""
    if not job.status.terminal or await store.delete_ended(job.id) == "active":
        raise ApiError(
            409,
            "job_not_ended",
            f"job {job.id} is {job.status.value}: cancel it, then delete it once it has ended",
            "job_id",
        )
    return Response(status_code=204)


@router.post("/{job_id}/cancel", response_model=JobResponse, responses=NOT_FOUND, summary="Cancel a job")
async def cancel_job(job: JobDep, store: StoreDep) -> Response:
    """A queued job ends canceled at once; a running one stops at its next step (poll or follow the events);
    an ended job is returned unchanged."""
    updated = await store.cancel(job.id) or job
    return job_reply(JobResponse.from_job(updated), 200)


@router.get(
    "/{job_id}/events",
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "Server-sent events."},
        **NOT_FOUND,
    },
    response_class=StreamingResponse,
    summary="Follow a job's events (SSE)",
)
async def stream_job_events(
    job: JobDep,
    store: StoreDep,
    settings: SettingsDep,
    tenant: TenantDep,
    request: Request,
    last_event_id: LastEventId = None,
) -> StreamingResponse:
    """Events `queued`, `started`, `progress` (and, for a job asked with `previews` / `preview_every`,
    `preview`: `{step, total_steps, index, image}`, the image a small WebP data URL; docs/previews.md), then one
    of `succeeded`, `failed`, `canceled`, `expired`, after which the stream ends. Each has an `id:`;
    reconnecting with `Last-Event-ID` resumes after it. A comment line is sent every `sse_keepalive_s` while
    nothing happens."""
    start = last_event_id if last_event_id and _valid_stream_id(last_event_id) else "0-0"
    draining, slots = request.app.state.draining, request.app.state.wait_slots
    if not slots.take(tenant.name):  # service/api/wait_slots.py
        raise slots.refused(tenant.name, "too_many_streams")

    keys = request.app.state.keys if settings.auth == "keys" and tenant.key_digest else None

    async def body() -> AsyncIterator[str]:
        last = start
        keepalive_ms = int(settings.sse_keepalive_s * 1000)
        checked, ended = time.monotonic(), job.status.terminal
        try:
            while True:
                block_ms = None if ended else keepalive_ms
                events = await unless_draining(store.events(job.id, last, block_ms=block_ms), draining)
                if (
                    events is None
                ):  # the process is stopping (service/api/draining.py): another replica resumes
                    yield ": this API process is stopping; reconnect with Last-Event-ID\n\n"
                    return
                if keys is not None and time.monotonic() - checked >= KEY_RECHECK_S:
                    # A key revoked while its stream is open: the stream ends (an audit saw one go on to the end).
                    checked = time.monotonic()
                    if not await keys.still_valid(tenant.key_digest):
                        message = {"code": "invalid_api_key", "message": "the API key was revoked"}
                        yield f"event: error\ndata: {json.dumps(message)}\n\n"
                        return
                if not events:
                    if ended:
                        return
                    current = await store.get(job.id)
                    if current is None:  # expired while we followed it
                        return
                    # Ended: the next read does not wait; it has the terminal event, or nothing when the client
                    # resumed after it (an audit's stream then sent keep-alives for the job's lifetime).
                    ended = current.status.terminal
                    if not ended:
                        yield ": keep-alive\n\n"
                    continue
                # The events read together go out as one write: one per event (a resumed stream replays a job's
                # dozens of progress events) wrote on after the client left, each write logging a warning.
                chunk = []
                for e in events:
                    last = e.id
                    chunk.append(f"id: {e.id}\nevent: {e.type.value}\ndata: {json.dumps(e.data)}\n\n")
                    if e.type.terminal:
                        break
                yield "".join(chunk)
                if events[len(chunk) - 1].type.terminal:
                    return
        except RedisError as e:
            # The headers are sent: say why the stream ends; the client resumes with its last id.
            yield f"event: error\ndata: {json.dumps({'code': 'store_unavailable', 'message': str(e)})}\n\n"

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return _SlotStream(
        body(), release=lambda: slots.give_back(tenant.name), media_type="text/event-stream", headers=headers
    )


class _SlotStream(StreamingResponse):
    """A stream that gives its wait slot back when it ends, however it ends (the client gone before its first
    event included: a generator that never started has no `finally` to run)."""

    def __init__(self, content, *, release, **kwargs):
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def _valid_stream_id(value: str) -> bool:
    # Redis stream ids are two unsigned 64-bit integers: a larger one passes the pattern but Redis refuses it.
    return re.match(_STREAM_ID, value) is not None and all(int(part) < 2**64 for part in value.split("-"))


@router.get(
    "/{job_id}/outputs/{index}",
    responses={
        200: {
            "content": {content_type: {} for content_type in CONTENT_TYPES.values()},
            "description": "The output's bytes.",
        },
        206: {
            "description": "One byte range of the output (`Range: bytes=...`; `Content-Range` says which)."
        },
        304: {
            "description": "`If-None-Match` names the output's `ETag`: it has not changed (it never does)."
        },
        **NOT_FOUND,
        410: {"model": ErrorResponse, "description": "The output expired."},
        416: {"description": "The range starts past the output's end (`Content-Range: bytes */<size>`)."},
    },
    response_class=Response,
    summary="Download an output",
)
async def read_job_output(
    request: Request, job: JobDep, store: StoreDep, index: int = Path(ge=0, le=MAX_OUTPUT_INDEX)
) -> Response:
    if job.status != JobStatus.SUCCEEDED:
        raise ApiError(
            404,
            "output_not_found",
            f"job {job.id} is {job.status.value}; outputs exist once it succeeded",
            "index",
        )
    record = next((o for o in job.outputs if o.index == index), None)
    if record is None:
        raise ApiError(
            404, "output_not_found", f"job {job.id} has outputs 0..{len(job.outputs) - 1}", "index"
        )
    data = await store.output(job.id, index)
    if data is None:
        raise ApiError(410, "output_expired", f"output {index} of job {job.id} has expired", "index")
    ext = record.content_type.split("/")[-1]
    headers = {
        "Content-Disposition": f'inline; filename="{job.id}-{index}.{ext}"',
        "Cache-Control": "private",
    }
    # Conditional and ranged downloads (service/api/byte_ranges.py): an output never changes, so its id tags it.
    return output_response(request, data, record.content_type, f'"{job.id}-{index}"', headers)

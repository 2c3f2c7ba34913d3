"""`POST /v1/generate`: validate against the model's limits, queue, answer 202 (or 200 once ended, with
`Prefer: wait=N`)."""

from __future__ import annotations

import logging
import re

from fastapi import APIRouter, Request, Response
from redis.exceptions import RedisError

from meshserve.service import metrics
from meshserve.service.api.catalog import normalise
from meshserve.service.api.deps import current_tenant
from meshserve.service.api.errors import ApiError, FieldError
from meshserve.service.api.image_requests import drop_unused_inputs, read_image_fields, with_image_inputs
from meshserve.service.api.job_options import deadline_at, webhook_spec
from meshserve.service.api.wait_slots import ClientGone, client_gone, wait_unless_gone
from meshserve.service.contract import JobStatus
from meshserve.service.job_queue import SubmitOutcomeUnknown
from meshserve.service.schemas import ErrorResponse, GenerateRequest, JobResponse
from meshserve.service.settings import Settings
from meshserve.service.store import request_hash

log = logging.getLogger(__name__)
router = APIRouter(tags=["generate"])

MAX_IDEMPOTENCY_KEY = 255
_WAIT = re.compile(r"\s*wait\s*=\s*\"?(\d+)\"?\s*", re.IGNORECASE)
ERRORS = {
    404: {
        "model": ErrorResponse,
        "description": "Unknown or unserved model (the message lists the served ones).",
    },
    422: {"model": ErrorResponse, "description": "A field breaks a rule; `field` names it, `code` the rule."},
    429: {
        "model": ErrorResponse,
        "description": "The model's queue is full, the key is past its requests per minute, or the tenant has "
        "its limit of queued + running jobs; retry after `Retry-After` seconds.",
    },
    503: {
        "model": ErrorResponse,
        "description": "No ready pool, the store is down, or the API holds as many request bodies as it may "
        "(`server_busy`); see `Retry-After`. A `store_unavailable` with a `Location` means the store did not "
        "answer the submit in time and the outcome is unknown: the job there may exist (follow it before "
        "retrying; a /v1/generate sent with an `Idempotency-Key` is safely retried with the same key).",
    },
}


def outcome_unknown(
    e: SubmitOutcomeUnknown, settings: Settings, idempotency_key: str | None = None
) -> ApiError:
    """The answer to a submit whose script Redis did not answer in time (service/job_queue.py): 503 like any store
    failure, but with the Location of the job it may have made, and what to do about it."""
    metrics.JOBS_REJECTED.labels("store_unavailable").inc()
    retry = (
        "retrying with the same Idempotency-Key returns it if it exists"
        if idempotency_key
        else "retrying without an Idempotency-Key may make a second job: follow Location first, or retry with "
        "an Idempotency-Key"
    )
    return ApiError(
        503,
        "store_unavailable",
        f"the job store did not answer in time, so the outcome is unknown: job {e.job_id} may have been "
        f"created (it is if the store ran the submit late). Follow Location, /v1/jobs/{e.job_id}: a 404 there "
        f"once the store answers again means it was not; {retry}",
        headers={"Location": f"/v1/jobs/{e.job_id}", "Retry-After": str(settings.retry_after_s)},
    )


def prefer_wait(prefer: str | list[str] | None, limit: int) -> int:
    """Seconds asked for by `Prefer: wait=N`, capped at `limit` (RFC 7240: a preference the server cannot honour
    in full is honoured in part, an unreadable one is ignored). `prefer`: the Prefer headers' values; a request
    may send several, and a header several preferences separated by commas, each with `;` parameters after it
    (`handling=strict; wait=3` names no wait preference: wait is a parameter of handling there)."""
    values = [prefer] if isinstance(prefer, str) else prefer or []
    for preference in ",".join(values).split(","):
        m = _WAIT.fullmatch(preference.split(";", 1)[0])
        if m:
            digits = m.group(1).lstrip("0")
            # Python refuses int() of over 4,300 digits: a long number asks for more than any limit anyway.
            return limit if len(digits) > 9 else min(int(digits or "0"), limit)
    return 0


def job_reply(job: JobResponse, response_status: int, headers: dict[str, str] | None = None) -> Response:
    # Serialised by pydantic-core directly: the response_model round trip costs ~15% of a submit.
    return Response(job.model_dump_json(), response_status, headers=headers, media_type="application/json")


# The submit path takes only the body and the request: every FastAPI dependency or Header parameter is solved
# per request (~25 us each on this machine), so the two headers are read directly and documented here.
HEADERS = [
    {
        "name": "Idempotency-Key",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "maxLength": MAX_IDEMPOTENCY_KEY},
        "description": "The same key and body return the same job; the same key with another body is a 422.",
    },
    {
        "name": "Prefer",
        "in": "header",
        "required": False,
        "schema": {"type": "string"},
        "description": "RFC 7240. `wait=N` (N <= 60): wait up to N seconds and answer 200 with the ended job.",
    },
    {
        "name": "Cancel-After",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "maxLength": 64},
        "description": "A deadline, as Replicate's: seconds (`90`) or a duration (`45s`, `5m`, `1h30m`). A job "
        "not started by then ends `expired`; one still running is canceled. Wins over `deadline_s`.",
    },
]


def idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is not None and not 1 <= len(key) <= MAX_IDEMPOTENCY_KEY:
        metrics.JOBS_REJECTED.labels("invalid").inc()
        raise FieldError(
            "Idempotency-Key",
            "string_too_long" if key else "string_too_short",
            f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} characters, got {len(key)}",
        )
    return key


@router.post(
    "/v1/generate",
    status_code=202,
    response_model=JobResponse,
    responses={200: {"model": JobResponse, "description": "The job ended within `Prefer: wait`."}, **ERRORS},
    openapi_extra={"parameters": HEADERS},
    summary="Queue a generation job",
)
async def create_job(body: GenerateRequest, request: Request) -> Response:
    state = request.app.state
    store, settings = state.store, state.settings
    tenant = await current_tenant(request)
    key = idempotency_key(request)
    served = await state.catalog.resolve(body.model)
    params = normalise(body, served.info, settings.max_prompt_chars)
    deadline = deadline_at(request.headers.get("cancel-after"), body.deadline_s, settings)
    webhook = await webhook_spec(body.webhook, tenant, settings, store.redis, store.prefix)
    wait_s = prefer_wait(request.headers.getlist("prefer"), settings.max_wait_s)  # read before the job exists
    # Fields at their defaults left out: a retry that spells a default out is the same request.
    digest = request_hash(body.model_dump(mode="json", exclude_defaults=True)) if key else ""
    if body.image is not None or body.control_image is not None:
        # fetched, decoded and stored now: a bad input is a 422, not a failed job
        hold = getattr(request.state, "hold_bytes", None)  # (service/api/body_limit.py)
        fields = {"image": body.image, "mask": body.mask, "last_image": body.last_image}
        read = await read_image_fields({**fields, "control_image": body.control_image}, settings, hold)
        params = await with_image_inputs(
            store,
            settings,
            params,
            read.get("image"),
            read.get("mask"),
            decode_slots=request.app.state.decode_slots,
            last_image=read.get("last_image"),
            control_image=read.get("control_image"),
        )
    job, unknown = None, None
    try:
        job = await store.submit(
            params,
            body.priority,
            key,
            request_digest=digest,
            owner=tenant.name,
            max_active=tenant.max_active,
            deadline_at=deadline,
            webhook=webhook,
        )
    except SubmitOutcomeUnknown as e:
        unknown = e
    finally:
        # A job that may exist keeps its inputs (they expire with it, `job_ttl_s`); and the store is not answering.
        if params.image is not None and unknown is None:
            await drop_unused_inputs(store, params, job)
    if unknown is not None:
        raise outcome_unknown(unknown, settings, key)
    if not job.replayed:  # an idempotent replay created nothing
        metrics.JOBS_SUBMITTED.labels(job.model, body.priority.value).inc()
    headers = {"Location": f"/v1/jobs/{job.id}"}
    # Without a wait slot (service/api/wait_slots.py: too many requests waiting) the preference is not honoured:
    # the job is answered at once, as RFC 7240 allows.
    with request.app.state.wait_slots.slot(tenant.name) as waiting:
        if wait_s and waiting and not job.status.terminal:
            try:
                # A stopping API answers at once (service/api/draining.py): the job as it is, with its Location.
                # A client that leaves gives its slot back at once (service/api/wait_slots.py); its job goes on.
                waited = await wait_unless_gone(store.wait(job.id, wait_s), request)
                if waited is None and not request.app.state.draining.is_set():
                    # Its owner deleted it meanwhile (DELETE /v1/jobs/{id}).
                    raise ApiError(404, "job_not_found", f"job {job.id} was deleted during the wait")
                job = waited or job
                headers["Preference-Applied"] = f"wait={wait_s}"
                if job.status == JobStatus.QUEUED:
                    job.queue_position = await store.queue_position(job)
            except ClientGone:
                raise client_gone(job.id) from None
            except RedisError as e:
                # The job is accepted: answer it (202, its Location) as without the wait, never a 503 without
                # its id, which a client would retry into a second job.
                log.warning("job %s: waiting for it failed (%s); answered as accepted", job.id, e)
    return job_reply(JobResponse.from_job(job), 200 if job.status.terminal else 202, headers)

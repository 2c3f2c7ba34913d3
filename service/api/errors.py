"""The one error shape, `{"error": {"code", "message", "field"}}` (with OpenAI's `param` and `type`), for every
failure the API can answer.

Bad input is a 422 naming the field and the rule (`code` is the rule: pydantic's error type such as
`greater_than_equal` or `missing`, `invalid_json` for malformed JSON, or a per-model rule such as `not_multiple`);
unknown things are 404s (another tenant's job too: exactly the answer an unknown id gets); a missing or bad API
key is a 401 (`service/api/authentication.py`), a body over the limit a 413; a full queue, a key past its rate or
a tenant at its active-job limit is a 429 and an unavailable Redis or no ready pool a 503, all with `Retry-After`.
Nothing reaches the client as a 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from meshserve.service import metrics
from meshserve.service.contract import IdempotencyConflict, QueueFull
from meshserve.service.output_store import OutputStoreError
from meshserve.service.schemas import ErrorResponse
from meshserve.service.store import TooManyActiveJobs

log = logging.getLogger(__name__)


# OpenAPI entries for the answers every route may give (FastAPI's own 422 shape is not what clients get).
COMMON_RESPONSES: dict[int | str, dict] = {
    422: {
        "model": ErrorResponse,
        "description": "A parameter breaks a rule; `field` names it, `code` the rule.",
    },
    503: {"model": ErrorResponse, "description": "The job store (Redis) is unavailable; see `Retry-After`."},
}


class ApiError(Exception):
    """An answer other than success, raised anywhere in a handler."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.code, self.message, self.field, self.headers = status, code, message, field, headers


class FieldError(ApiError):
    """A request field breaks a rule: 422."""

    def __init__(self, field: str, code: str, message: str):
        super().__init__(422, code, message, field)


def error_response(
    status: int, code: str, message: str, field: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    # `param` and `type` are the names OpenAI's error body gives the field and the kind of error, which its SDKs
    # read into `e.param` and `e.type` (the OpenAI-compatible routes' clients): the same body serves both.
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = {"code": code, "message": message, "field": field, "param": field, "type": kind}
    return JSONResponse({"error": body}, status, headers=headers)


def _field_name(loc: tuple[Any, ...]) -> str | None:
    # ("body", "width") -> "width"; ("header", "idempotency-key") -> "idempotency-key"; ("body",) -> "body"
    parts = [str(p) for p in loc]
    if len(parts) > 1 and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    return ".".join(parts) or None


def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"type": "invalid", "loc": (), "msg": "invalid request"}
    if first["type"] == "json_invalid":
        ctx = first.get("ctx", {}).get("error", "")
        return error_response(422, "invalid_json", _not_json(request, ctx), "body")
    if request.url.path.startswith("/v1/generate") or request.url.path.startswith("/v1/images"):
        metrics.JOBS_REJECTED.labels("invalid").inc()
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    json_body = content_type == "application/json" or content_type.endswith("+json")
    if (
        tuple(first.get("loc", ())) == ("body",)
        and first["type"] == "model_attributes_type"
        and not json_body
    ):
        # FastAPI reads a body as JSON only when its Content-Type says so (curl -d sends form-urlencoded): its
        # own message ("Input should be a valid dictionary") does not say that.
        got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        message = f"the body must be a JSON object sent with Content-Type: application/json (got {got})"
        return error_response(422, "invalid_json", message, "body")
    field = _field_name(tuple(first.get("loc", ())))
    parts = [
        f"{_field_name(tuple(e.get('loc', ()))) or 'request'}: {e['msg']} ({e['type']})" for e in errors[:5]
    ]
    return error_response(422, first["type"], "; ".join(parts), field)


def _not_json(request: Request, detail: str) -> str:
    """The message of a body that is not JSON, naming a content coding as its likely cause (the API reads
    bodies as sent: a gzip body is bytes that are not JSON)."""
    coding = request.headers.get("content-encoding", "").strip().lower()
    if coding not in ("", "identity"):
        return f"the body is not valid JSON: it was sent with Content-Encoding {coding!r}; send it unencoded"
    return f"the body is not valid JSON: {detail}".rstrip(": ")


def _on_api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.code, exc.message, exc.field, exc.headers)


def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 400:
        # FastAPI's answer to a body it could not even decode (not UTF-8, digits past Python's int limit; for a
        # multipart form: no boundary, too many parts, a part too large): malformed input like any other, in the
        # documented shape and status, named for what the body was meant to be.
        if request.headers.get("content-type", "").lower().startswith("multipart/"):
            return error_response(
                422, "invalid_form", f"the multipart form could not be read: {exc.detail}", "body"
            )
        return error_response(422, "invalid_json", _not_json(request, exc.detail), "body")
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    headers = getattr(exc, "headers", None)
    if exc.status_code == 405:
        # Starlette's Allow names the methods of the first route with the path only; a path served by two
        # routes (GET and POST /v1/loras) must list both (RFC 9110).
        headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
    return error_response(exc.status_code, code, str(exc.detail), None, headers)


def _allowed_methods(request: Request) -> list[str]:
    """The methods some route answers on this path (asked of the routes themselves: FastAPI nests included
    routers, so their routes are not a flat list)."""
    from starlette.routing import Match

    methods = [
        method
        for method in ("DELETE", "GET", "PATCH", "POST", "PUT")
        if any(
            route.matches({**request.scope, "method": method})[0] == Match.FULL
            for route in request.app.router.routes
        )
    ]
    # Every GET route answers HEAD too (service/api/head_requests.py).
    return sorted([*methods, "HEAD"]) if "GET" in methods else methods


def _on_queue_full(request: Request, exc: QueueFull) -> JSONResponse:
    metrics.JOBS_REJECTED.labels("queue_full").inc()
    retry = str(request.app.state.settings.retry_after_s)
    return error_response(429, "queue_full", str(exc), "model", {"Retry-After": retry})


def _on_too_many_active(request: Request, exc: TooManyActiveJobs) -> JSONResponse:
    metrics.JOBS_REJECTED.labels("too_many_active_jobs").inc()
    retry = str(request.app.state.settings.retry_after_s)
    return error_response(429, "too_many_active_jobs", str(exc), None, {"Retry-After": retry})


def _on_idempotency(request: Request, exc: IdempotencyConflict) -> JSONResponse:
    metrics.JOBS_REJECTED.labels("idempotency_conflict").inc()
    return error_response(422, "idempotency_key_reused", str(exc), "Idempotency-Key")


def _on_redis(request: Request, exc: RedisError) -> JSONResponse:
    log.warning("redis unavailable: %s", exc)
    if request.url.path.startswith("/v1/generate") or request.url.path.startswith("/v1/images"):
        metrics.JOBS_REJECTED.labels("store_unavailable").inc()
    retry = str(request.app.state.settings.retry_after_s)
    return error_response(
        503, "store_unavailable", f"the job store is unavailable: {exc}", None, {"Retry-After": retry}
    )


def _on_output_store(request: Request, exc: OutputStoreError) -> JSONResponse:
    log.warning("output store unavailable: %s", exc)
    retry = str(request.app.state.settings.retry_after_s)
    return error_response(
        503,
        "output_store_unavailable",
        f"the output store is unavailable: {exc}",
        None,
        {"Retry-After": retry},
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(QueueFull, _on_queue_full)
    app.add_exception_handler(TooManyActiveJobs, _on_too_many_active)
    app.add_exception_handler(IdempotencyConflict, _on_idempotency)
    app.add_exception_handler(RedisError, _on_redis)
    app.add_exception_handler(OutputStoreError, _on_output_store)
    # OSError covers a Redis that refuses connections before redis-py wraps it (e.g. during DNS/connect).
    app.add_exception_handler(OSError, _on_redis)

"""The API application: `create_app()` for tests and servers, `run_api()` for `meshserve api`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from meshserve.service import metrics
from meshserve.service.api.authentication import OPEN_PATHS, Authentication
from meshserve.service.api.body_limit import BodySizeLimit
from meshserve.service.api.catalog import Catalog
from meshserve.service.api.draining import drain_on_signals
from meshserve.service.api.errors import install_error_handlers
from meshserve.service.api.head_requests import HeadAsGet
from meshserve.service.api.routes import generate, health, images, jobs, loras, models, playground
from meshserve.service.api.wait_slots import WaitSlots
from meshserve.service.auth import KeyStore
from meshserve.service.settings import Settings, get_settings
from meshserve.service.store import Store
from meshserve.service.webhooks.deliverer import deliver_in_background

log = logging.getLogger(__name__)

DESCRIPTION = (
    "Diffusion-model generation over a durable Redis queue. Submit with `POST /v1/generate`, then poll "
    "`/v1/jobs/{id}`, follow `/v1/jobs/{id}/events` (SSE) and download `/v1/jobs/{id}/outputs/{i}`. Every error "
    'is `{"error": {"code", "message", "field"}}`; a method a path does not serve is 405 with `Allow`. With `MESHSERVE_AUTH=keys` every route but `/livez`, '
    "`/readyz` and `/metrics` needs `Authorization: Bearer <key>` (`meshserve keys create`)."
)
_UNAUTHORIZED = {
    "description": "Missing, malformed, unknown or revoked API key (`WWW-Authenticate: Bearer`).",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}
_RATE_LIMITED = {
    "description": "Too many requests (per-key rate, active jobs, or queue); see `Retry-After` and `RateLimit`.",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}
_TOO_LARGE = {
    "description": "The request body is over the size limit (1 MiB by default).",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}
_HEADERS_TOO_LARGE = {
    "description": "The request line and headers are over `max_header_bytes` (64 KiB by default); answered before "
    "any route runs, and the connection is closed.",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}
_BODY_TIMEOUT = {
    "description": "The request body did not arrive whole within `body_timeout_s` (120 s by default).",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}


def _document_security(app: FastAPI) -> None:
    """Document what the middlewares enforce: the bearer scheme, and 401/429 (and 408/413 with a body) on every route
    that is not open. The schema is the same whatever `MESHSERVE_AUTH` says (openapi.yaml is one file)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = build()
        schema.setdefault("components", {})["securitySchemes"] = {
            "bearerAuth": {"type": "http", "scheme": "bearer", "description": "An API key: `msk_...`."}
        }
        for path, operations in schema["paths"].items():
            for op in operations.values():
                op["responses"].setdefault("431", _HEADERS_TOO_LARGE)  # the HTTP protocol's, every path
            if path in OPEN_PATHS:
                continue
            for method, op in operations.items():
                op["security"] = [{"bearerAuth": []}]
                op["responses"].setdefault("401", _UNAUTHORIZED)
                op["responses"].setdefault("429", _RATE_LIMITED)
                if method in ("post", "put", "patch"):
                    op["responses"].setdefault("413", _TOO_LARGE)
                    op["responses"].setdefault("408", _BODY_TIMEOUT)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def create_app(settings: Settings | None = None, store: Store | None = None) -> FastAPI:
    """The app; it opens a `Store` for `settings` (default: from the environment) unless one is given, which the
    caller then closes."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        own = store is None
        app.state.store = store or Store(settings)
        app.state.catalog = Catalog(app.state.store, settings)
        app.state.keys = KeyStore(app.state.store.redis, settings.key_prefix)
        if settings.auth == "keys" and settings.admin_key is not None:
            await _install_admin_key(app.state.keys, settings)
        app.state.draining = asyncio.Event()
        try:
            hook = (
                drain_on_signals(app.state.draining)
                if settings.drain_on_signals
                else contextlib.nullcontext()
            )
            with hook:
                async with deliver_in_background(app.state.store, settings):  # webhooks, deadlines
                    yield
        finally:
            if own:
                await app.state.store.close()

    docs = settings.api_docs  # the interactive pages load a CDN's scripts (settings.py): off by default
    app = FastAPI(
        title="meshserve",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
    )
    app.state.settings = settings
    app.state.draining = asyncio.Event()  # set when the process is told to stop (lifespan: drain_on_signals)
    app.state.wait_slots = WaitSlots(settings)  # requests that wait on a job, bounded
    app.state.decode_slots = asyncio.Semaphore(settings.image_decode_slots)  # image inputs decoded at once
    install_error_handlers(app)
    for module in (generate, jobs, models, loras, images, health, playground):
        app.include_router(module.router)
    _document_security(app)
    # Outermost first: metrics see every answer; the key is checked before the body is read.
    app.add_middleware(BodySizeLimit)
    app.add_middleware(Authentication)
    app.add_middleware(metrics.MetricsMiddleware)
    app.add_middleware(HeadAsGet)  # outermost: HEAD is a GET everywhere inside
    metrics.set_build_info()
    return app


async def _install_admin_key(keys: KeyStore, settings: Settings) -> None:
    """Install `MESHSERVE_ADMIN_KEY` (a Secret's value) as key `admin`. A Redis that is not up yet is not fatal: the
    API starts (and answers 503 until Redis is back); the key is installed at the next start."""
    from redis.exceptions import RedisError

    try:
        if await keys.install("admin", settings.admin_key.get_secret_value(), tenant="admin", admin=True):
            log.info("authentication: installed the admin key from MESHSERVE_ADMIN_KEY")
    except (RedisError, OSError) as e:
        log.warning("authentication: could not install MESHSERVE_ADMIN_KEY now (%s)", e)


def run_api(host: str = "0.0.0.0", port: int = 8000, workers: int = 1) -> None:
    """Serve the API with uvicorn (uvloop and httptools when installed), until SIGINT/SIGTERM.

    The production entry: API keys are required unless `MESHSERVE_AUTH=none` is set explicitly (the settings'
    own default, none, is for `create_app()` in tests and for `meshserve serve` on 127.0.0.1)."""
    import os

    import uvicorn

    from meshserve.service.api.http_protocol import BoundedHttpProtocol

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("MESHSERVE_AUTH", "keys")  # also read by uvicorn's worker processes (factory)
    os.environ.setdefault("MESHSERVE_DRAIN_ON_SIGNALS", "true")  # waits and streams end at SIGTERM
    get_settings.cache_clear()
    settings = get_settings()
    if settings.auth == "keys":
        log.info(
            "authentication: API keys required on every route but /livez, /readyz, /metrics "
            "(create one with `meshserve keys create NAME`)"
        )
    else:
        log.warning(
            "authentication: NONE (MESHSERVE_AUTH=none): anyone who reaches %s:%d may use the API", host, port
        )
    if workers > 1:
        uvicorn.run(
            "meshserve.service.app:create_app",
            factory=True,
            host=host,
            port=port,
            workers=workers,
            access_log=False,
            log_level="warning",
            timeout_graceful_shutdown=settings.shutdown_grace_s,
            http=BoundedHttpProtocol,  # header size and time bounds
        )
    else:
        uvicorn.run(
            create_app(),
            host=host,
            port=port,
            access_log=False,
            log_level="info",
            timeout_graceful_shutdown=settings.shutdown_grace_s,
            http=BoundedHttpProtocol,  # header size and time bounds
        )

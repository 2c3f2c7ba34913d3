"""The API application: `create_app()` for tests and servers, `run_api()` for `meshserve api`."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from meshserve.service import metrics
from meshserve.service.api.catalog import Catalog
from meshserve.service.api.errors import install_error_handlers
from meshserve.service.api.routes import generate, health, images, jobs, models
from meshserve.service.settings import Settings, get_settings
from meshserve.service.store import Store

DESCRIPTION = (
    "Diffusion-model generation over a durable Redis queue. Submit with `POST /v1/generate`, then poll "
    "`/v1/jobs/{id}`, follow `/v1/jobs/{id}/events` (SSE) and download `/v1/jobs/{id}/outputs/{i}`. Every error "
    'is `{"error": {"code", "message", "field"}}`.'
)


def create_app(settings: Settings | None = None, store: Store | None = None) -> FastAPI:
    """The app; it opens a `Store` for `settings` (default: from the environment) unless one is given, which the
    caller then closes."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        own = store is None
        app.state.store = store or Store(settings)
        app.state.catalog = Catalog(app.state.store, settings)
        try:
            yield
        finally:
            if own:
                await app.state.store.close()

    app = FastAPI(title="meshserve", version="0.1.0", description=DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings
    install_error_handlers(app)
    for module in (generate, jobs, models, images, health):
        app.include_router(module.router)
    app.add_middleware(metrics.MetricsMiddleware)
    metrics.set_build_info()
    return app


def run_api(host: str = "0.0.0.0", port: int = 8000, workers: int = 1) -> None:
    """Serve the API with uvicorn (uvloop and httptools when installed), until SIGINT/SIGTERM."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if workers > 1:
        uvicorn.run(
            "meshserve.service.app:create_app",
            factory=True,
            host=host,
            port=port,
            workers=workers,
            access_log=False,
            log_level="warning",
        )
    else:
        uvicorn.run(create_app(), host=host, port=port, access_log=False, log_level="info")

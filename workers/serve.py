"""`meshserve serve`: the whole service in one command - the API, one worker pool with one model, and (when no
Redis URL is given) a private `redis-server` child on a free loopback port.

    run_serve(port=8000, redis_url=None, model=None)   # model None: the embedded tiny SDXL model

API and worker share one process and one event loop (uvicorn's server runs as a task beside the worker), so
one /metrics shows both. The API is up at once; `/readyz` turns ready when the pool has compiled. On SIGTERM or
Ctrl-C the worker drains first while the API still answers polls, then the API stops, then the private Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import uvicorn

from meshserve.service.api.http_protocol import BoundedHttpProtocol
from meshserve.service.app import create_app
from meshserve.service.settings import get_settings
from meshserve.workers.config import single_model_config
from meshserve.workers.local_redis import local_redis
from meshserve.workers.main import Worker, install_signal_handlers

log = logging.getLogger(__name__)


def run_serve(
    port: int = 8000, redis_url: str | None = None, model: str | None = None, host: str | None = None
) -> None:
    """API + one worker (+ a local redis-server when `redis_url` is None) until SIGTERM/SIGINT.

    `model`: a diffusers folder, or None for the embedded default. `host`: the bind address, default
    `MESHSERVE_HOST` or 127.0.0.1 (a container sets 0.0.0.0)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host = host or os.environ.get("MESHSERVE_HOST", "127.0.0.1")
    with contextlib.ExitStack() as stack:
        url = redis_url or stack.enter_context(local_redis())
        asyncio.run(_serve(host, port, url, model))


async def _serve(host: str, port: int, redis_url: str, model: str | None) -> None:
    settings = get_settings().model_copy(update={"redis_url": redis_url})
    worker = Worker(single_model_config(model), settings)
    app = create_app(settings)
    server = _Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            access_log=False,
            log_level="info",
            timeout_graceful_shutdown=settings.shutdown_grace_s,
            http=BoundedHttpProtocol,  # header size and time bounds
        )
    )

    def stop() -> None:
        worker.stop()  # the API keeps answering (polls, downloads) while the worker drains

    install_signal_handlers(asyncio.get_running_loop(), stop)
    api = asyncio.create_task(server.serve(), name="api")
    work = asyncio.create_task(worker.run(), name="worker")
    log.info(
        "meshserve serve: API on http://%s:%d (playground: http://%s:%d/playground), Redis %s, model %s",
        host,
        port,
        host,
        port,
        redis_url,
        model or "embedded",
    )
    try:
        done, _ = await asyncio.wait([api, work], return_when=asyncio.FIRST_COMPLETED)
        if api in done:  # the API could not start (port taken): nothing to serve
            worker.stop()
            await work
            api.result()
            raise RuntimeError(f"the API server stopped unexpectedly on {host}:{port}")
        work.result()  # a worker that ended by itself (load error) raises here
    finally:
        app.state.draining.set()  # waits and SSE streams end now (service/api/draining.py)
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await api


class _Server(uvicorn.Server):
    """uvicorn's Server without its own signal handling: `serve` owns SIGTERM/SIGINT for the whole process
    (uvicorn would re-raise a captured signal after its shutdown and kill the draining worker)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

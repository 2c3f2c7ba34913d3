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
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import uvicorn

from meshserve.service.app import create_app
from meshserve.service.settings import get_settings
from meshserve.workers.config import single_model_config
from meshserve.workers.main import Worker, install_signal_handlers

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_redis(timeout_s: float = 10.0) -> Iterator[str]:
    """A throwaway redis-server (no persistence, loopback only) for the life of the block; yields its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError(
            "no Redis URL given and no redis-server on PATH: install Redis (apt install redis-server) or pass "
            "--redis-url redis://host:6379/0"
        )
    port = _free_port()
    workdir = tempfile.mkdtemp(prefix="meshserve-redis-")
    args = [
        exe,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        workdir,
    ]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {proc.returncode} on port {port}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer on port {port} within {timeout_s} s")
            time.sleep(0.05)
        log.info("started a local redis-server on 127.0.0.1:%d (pid %d)", port, proc.pid)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(workdir, ignore_errors=True)


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
    server = _Server(
        uvicorn.Config(create_app(settings), host=host, port=port, access_log=False, log_level="info")
    )

    def stop() -> None:
        worker.stop()  # the API keeps answering (polls, downloads) while the worker drains

    install_signal_handlers(asyncio.get_running_loop(), stop)
    api = asyncio.create_task(server.serve(), name="api")
    work = asyncio.create_task(worker.run(), name="worker")
    log.info(
        "meshserve serve: API on http://%s:%d, Redis %s, model %s", host, port, redis_url, model or "embedded"
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
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await api


class _Server(uvicorn.Server):
    """uvicorn's Server without its own signal handling: `serve` owns SIGTERM/SIGINT for the whole process
    (uvicorn would re-raise a captured signal after its shutdown and kill the draining worker)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

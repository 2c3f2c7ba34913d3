"""Draining: when the API process is told to stop (SIGTERM, SIGINT), the requests that wait on a job end at once
instead of holding the shutdown, each with what a client needs to go on.

uvicorn stops accepting connections on the signal but then waits for the open ones to close, and two kinds of
request stay open for as long as a job runs: an SSE stream (`GET /v1/jobs/{id}/events`, until the job's terminal
event) and a submit with `Prefer: wait` (up to `max_wait_s`). An audit saw a SIGTERMed API wait a minute for a
long job, past Kubernetes' grace period, so the pod died by SIGKILL and its clients got no answer. Now the
signal also sets `app.state.draining`: a `Prefer: wait` submit answers 202 with the job and its Location, an SSE
stream ends with a comment saying to reconnect (with `Last-Event-ID`, which resumes on another replica). uvicorn's
`timeout_graceful_shutdown` (`shutdown_grace_s`) bounds whatever is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Awaitable, Iterator
from typing import TypeVar

T = TypeVar("T")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def drain_on_signals(draining: asyncio.Event) -> Iterator[None]:
    """Set `draining` on SIGTERM/SIGINT, then pass the signal on to the handler installed before (uvicorn's,
    which starts the shutdown); the previous handlers are back on exit. Only the main thread may install
    handlers: elsewhere (an app run in a test's thread) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}

    def handle(sig, frame):
        loop.call_soon_threadsafe(draining.set)  # signal-safe: the loop sets it
        before = previous[sig]
        if callable(before):
            before(sig, frame)
        elif before == signal.SIG_DFL and sig == signal.SIGINT:
            raise KeyboardInterrupt

    for sig in SIGNALS:
        signal.signal(sig, handle)
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


async def unless_draining(work: Awaitable[T], draining: asyncio.Event) -> T | None:
    """`work`'s result, or None once `draining` is set first (`work` is then cancelled)."""
    if draining.is_set():
        if asyncio.iscoroutine(work):
            work.close()
        return None
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(draining.wait())
    try:
        done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task in done else None
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

"""The pool thread: where a pool's blocking model calls run, off the event loop.

One long-lived thread per pool keeps every JAX call of a pool on one thread (device placement and compilation
caches are per process, but a single caller keeps calls ordered and makes the thread easy to find in a stack
dump). It is a daemon thread: when a worker must exit past its drain deadline while a program still runs, the
process ends without joining it (a ThreadPoolExecutor's threads would be joined at exit and hang it).

The same class with `threads=N` is a pool's encoder (`EncoderThreads`): N daemon threads taking PNG / MP4
encodes off the pool thread (docs/outputs.md); Pillow's and PyAV's encoders release the GIL while they work.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

_STOP = object()


class PoolThread:
    def __init__(self, name: str, threads: int = 1, prefix: str = "pool"):
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(
                target=self._serve, name=f"{prefix}-{name}" + (f"-{i}" if threads > 1 else ""), daemon=True
            )
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Run fn(*args) on the pool thread; the returned future belongs to the calling event loop."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.put((fn, args, loop, fut))
        return fut

    def close(self) -> None:
        """Let the threads end after the calls already queued."""
        for _ in self._threads:
            self._queue.put(_STOP)

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, args, loop, fut = item
            try:
                outcome = (fn(*args), None)
            except BaseException as e:  # handed to the awaiting coroutine, never lost in this thread
                outcome = (None, e)
            try:
                loop.call_soon_threadsafe(_set, fut, *outcome)
            except RuntimeError:  # the loop closed: the worker exited without waiting for this call
                return


def EncoderThreads(name: str, threads: int) -> PoolThread:  # noqa: N802 - reads as the class it makes
    """A pool's encoder threads (threads > 1 encode several outputs at once)."""
    return PoolThread(name, threads, prefix="encode")


def _set(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)

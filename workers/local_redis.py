"""A redis-server child process on a loopback port: `meshserve serve`'s private Redis when no URL is given, and
the tests' own Redis for the scenarios that kill and restart it. One launcher for both.

    with local_redis() as url: ...                                     # throwaway: no persistence
    proc = start_redis_server(free_port(), folder, persistent=True)    # AOF, fsync always: survives SIGKILL
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis_server(
    port: int,
    folder: str | Path,
    *,
    persistent: bool = False,
    timeout_s: float = 10.0,
    die_with_parent: bool = False,
) -> subprocess.Popen:
    """redis-server on 127.0.0.1:`port` with its files in `folder`, returned once it answers PING.

    persistent: an append-only file with fsync on every write, so every acknowledged write survives a SIGKILL
    and a restart on the same port and folder replays it. Otherwise nothing is written to disk.
    die_with_parent: the server gets SIGTERM when the calling thread ends, a SIGKILL of this process included
    (Linux), so a killed `meshserve serve` leaves no redis-server behind. Only for a caller whose thread
    outlives the server (a `with` block: `local_redis`)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError(
            "no redis-server on PATH: install Redis (apt install redis-server) or pass --redis-url "
            "redis://host:6379/0"
        )
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", ""]
    args += ["--appendonly", "yes", "--appendfsync", "always"] if persistent else ["--appendonly", "no"]
    preexec = _die_with_parent() if die_with_parent else None
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=preexec)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {proc.returncode} on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_redis_server(proc)
            raise RuntimeError(f"redis-server did not answer on port {port} within {timeout_s} s")
        time.sleep(0.05)


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn asking Linux for SIGTERM when the parent thread ends (prctl PR_SET_PDEATHSIG); None on other
    systems. libc is looked up before the fork: the child only makes the call."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call: nothing would signal us
            os._exit(1)

    return preexec


def stop_redis_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 5 s."""
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@contextlib.contextmanager
def local_redis(timeout_s: float = 10.0) -> Iterator[str]:
    """A throwaway redis-server (no persistence, loopback only) for the life of the block; yields its URL. It
    writes no file, so its directory is the system's temporary one: nothing is left behind when this process
    is killed (a folder of its own was, an audit 2026-11-29)."""
    port = free_port()
    proc = start_redis_server(port, tempfile.gettempdir(), timeout_s=timeout_s, die_with_parent=True)
    try:
        log.info("started a local redis-server on 127.0.0.1:%d (pid %d)", port, proc.pid)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_redis_server(proc)

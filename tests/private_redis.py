"""A private redis-server for the tests that kill and restart Redis (the shared one on 6379 is never touched),
and the one free-port helper of the tests: both are the runtime's own launcher (`meshserve.workers.local_redis`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from meshserve.workers.local_redis import free_port, start_redis_server

__all__ = ["free_port", "start_redis"]


def start_redis(port: int, folder: Path) -> subprocess.Popen:
    """redis-server on `port` with its AOF in `folder`, answering PING. Restarted on the same port and folder it
    replays the AOF; appendfsync always, so every acknowledged write survives a SIGKILL."""
    return start_redis_server(port, folder, persistent=True)

"""A private redis-server for the tests that kill, stop and restart Redis (the shared one on 6379 is never
touched), and the one free-port helper of the tests: both are the runtime's own launcher
(`meshserve.workers.local_redis`). Tests take it as the `private_redis` fixture (tests/conftest.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from meshserve.workers.local_redis import free_port, start_redis_server

__all__ = ["PrivateRedis", "free_port"]


class PrivateRedis:
    """redis-server on a spare port with its AOF in `folder`, answering PING. Restarted on the same port and
    folder it replays the AOF; appendfsync always, so every acknowledged write survives a SIGKILL."""

    def __init__(self, folder: Path):
        self.port = free_port()
        self.folder = folder
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> None:
        self.proc = start_redis_server(self.port, self.folder, persistent=True)

    def kill(self) -> None:
        """SIGKILL: no shutdown save, only what the AOF already holds."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None

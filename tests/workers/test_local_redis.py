"""`meshserve serve`'s private redis-server (workers/local_redis.py) ends with the process that started it, also
when that process is killed with SIGKILL (no `finally` runs): no orphaned server keeps its port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.workers.helpers import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

HOLDER = """
import sys, time
from meshserve.workers.local_redis import local_redis
with local_redis() as url:
    print(url.rsplit(":", 1)[1].split("/")[0], flush=True)
    time.sleep(600)
"""


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def test_a_killed_holder_leaves_no_redis_server():
    folders = set(Path(tempfile.gettempdir()).glob("meshserve-redis-*"))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        assert answers(port)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while answers(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not answers(port), f"redis-server on {port} outlived its killed parent"
        assert set(Path(tempfile.gettempdir()).glob("meshserve-redis-*")) == folders  # nor a folder
    finally:
        proc.kill()
        proc.wait(10)

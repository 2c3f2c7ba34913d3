"""Load benchmark of the API's submit path: accepted `POST /v1/generate` per second and its latency p50/p99.

    python bench/load_api.py [--workers 1] [--connections 32] [--duration 10] [--redis-url URL]

uvicorn serves the app in a subprocess on loopback (uvloop and httptools when installed); a ready pool is
published in the registry under a private key prefix so requests pass validation, and no worker drains the queue
(the queue limit is raised so every request is admitted). The load comes from a small keep-alive HTTP/1.1 client
on raw asyncio sockets: an httpx client costs more CPU per request than the server does, and on a 2-core machine
the generator shares the CPU with the server. Prints one markdown table row; keys are removed afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshserve.service.contract import ModelDefaults, ModelInfo, ModelLimits, PoolInfo  # noqa: E402
from meshserve.service.settings import Settings  # noqa: E402
from meshserve.service.store import Store  # noqa: E402
from meshserve.workers.local_redis import free_port  # noqa: E402

BENCH_MODEL = ModelInfo(
    id="bench",
    family="sdxl",
    defaults=ModelDefaults(width=512, height=512, num_inference_steps=20, guidance_scale=5.0),
    limits=ModelLimits(min_size=64, max_size=2048, max_steps=100, max_n=4, schedulers=["euler"]),
)
BODY = json.dumps(
    {"model": "bench", "prompt": "a lighthouse at dusk, oil painting", "num_inference_steps": 20}
)


def request_bytes(port: int) -> bytes:
    body = BODY.encode()
    head = (
        f"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def read_response(reader: asyncio.StreamReader) -> int:
    """Read one HTTP/1.1 response with a Content-Length body; returns its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    await reader.readexactly(length)
    return status


async def connection(
    port: int, stop_at: float, measure_from: float, latencies: list[float], statuses: dict[int, int]
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    req = request_bytes(port)
    try:
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            writer.write(req)
            status = await read_response(reader)
            if t0 >= measure_from:
                latencies.append(time.perf_counter() - t0)
                statuses[status] = statuses.get(status, 0) + 1
    finally:
        writer.close()


async def load(
    port: int, connections: int, duration: float, warmup: float
) -> tuple[list[float], dict, float]:
    now = time.perf_counter()
    measure_from, stop_at = now + warmup, now + warmup + duration
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    await asyncio.gather(
        *(connection(port, stop_at, measure_from, latencies, statuses) for _ in range(connections))
    )
    return latencies, statuses, duration


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("uvicorn exited during start-up")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(f"GET /livez HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
                if b" 200 " in s.recv(1024):
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("uvicorn did not answer /livez")


async def publish_pool(settings: Settings) -> None:
    store = Store(settings)
    await store.register_pool(PoolInfo(name="bench-pool", models=[BENCH_MODEL], ready=True, max_batch=1))
    await store.close()


async def drop(store: Store) -> None:
    keys = [k async for k in store.redis.scan_iter(f"{store.prefix}:*", count=5000)]
    for i in range(0, len(keys), 5000):
        await store.redis.delete(*keys[i : i + 5000])
    await store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    ap.add_argument("--connections", type=int, default=32, help="concurrent keep-alive connections")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of load before measuring")
    ap.add_argument("--redis-url", default=os.environ.get("MESHSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    args = ap.parse_args()

    prefix = f"msbench-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "MESHSERVE_REDIS_URL": args.redis_url,
        "MESHSERVE_KEY_PREFIX": prefix,
        "MESHSERVE_QUEUE_MAX_LENGTH": "100000000",
        "MESHSERVE_POOL_STALE_S": "3600",
        "PYTHONPATH": str(ROOT),
    }
    settings = Settings(redis_url=args.redis_url, key_prefix=prefix)
    asyncio.run(publish_pool(settings))
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        "meshserve.service.app:create_app",
        "--factory",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        str(args.workers),
        "--no-access-log",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    try:
        wait_ready(port, proc)
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        latencies, statuses, duration = asyncio.run(load(port, args.connections, args.duration, args.warmup))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        asyncio.run(drop(Store(settings)))

    accepted = statuses.get(202, 0)
    lat = sorted(latencies)
    p50 = statistics.median(lat) * 1000 if lat else float("nan")
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000 if lat else float("nan")
    others = {k: v for k, v in statuses.items() if k != 202}
    try:
        import httptools  # noqa: F401
        import uvloop  # noqa: F401

        stack = "uvloop+httptools"
    except ImportError:
        stack = "asyncio+h11"
    print("| server | workers | connections | seconds | accepted req/s | p50 ms | p99 ms | non-202 |")
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| uvicorn {stack}, {platform.python_version()}, {os.cpu_count()} CPUs | {args.workers} | "
        f"{args.connections} | {duration:g} | {accepted / duration:,.0f} | {p50:.2f} | {p99:.2f} | "
        f"{others or 0} |"
    )
    return 0 if accepted else 1


if __name__ == "__main__":
    raise SystemExit(main())

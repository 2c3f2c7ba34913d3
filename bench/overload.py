"""Overload: the API driven at `--factor` (10) times what the workers drain, with API keys on.

    python bench/overload.py [--capacity 20] [--factor 10] [--duration 20] [--queue-cap 50] [--connections 16]

A private redis-server (so `used_memory` is this run's alone), the API in a uvicorn subprocess with
`MESHSERVE_AUTH=keys` and a small queue cap (`MESHSERVE_QUEUE_MAX_LENGTH`), and in this process a drainer that
plays the worker pools: it claims, starts and completes jobs (1 KiB outputs) at `--capacity` jobs per second.
Requests arrive open-loop at `capacity x factor` per second over keep-alive connections with one tenant's key.

Reports: accepted jobs and their rate, refusals by status with their p50/p99 latency (they must be quick), the
latency of accepted submits, Redis `used_memory` before the load, at its peak and after the drain, and checks that
every accepted job is in Redis and ended succeeded (no accepted job lost). Prints one markdown table row; exit
status 1 when an accepted job is missing or a 5xx other than 503 was answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshserve.service.auth import KeyStore  # noqa: E402
from meshserve.service.contract import ModelDefaults, ModelInfo, ModelLimits, OutputBlob, PoolInfo  # noqa: E402
from meshserve.service.settings import Settings  # noqa: E402
from meshserve.service.store import Store  # noqa: E402
from meshserve.workers.local_redis import free_port, start_redis_server, stop_redis_server  # noqa: E402

MODEL = ModelInfo(
    id="bench",
    family="sdxl",
    defaults=ModelDefaults(width=64, height=64, num_inference_steps=4, guidance_scale=5.0),
    limits=ModelLimits(min_size=64, max_size=64, max_steps=8, max_n=1),
)
BODY = json.dumps({"model": "bench", "prompt": "a lighthouse at dusk, oil painting"}).encode()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))] * 1000


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bool, bytes]:
    """(status, has Retry-After, body) of one HTTP/1.1 response with a Content-Length."""
    head = await reader.readuntil(b"\r\n\r\n")
    length, retry_after = 0, False
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
        retry_after |= line[:12].lower() == b"retry-after:"
    return int(head[9:12]), retry_after, await reader.readexactly(length)


async def client(port: int, key: str, interval: float, stop_at: float, results: list) -> None:
    """One keep-alive connection sending a submit every `interval` s (open loop: the schedule does not wait for
    slow answers beyond the one in flight on this connection)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = (
        f"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {len(BODY)}\r\n\r\n"
    ).encode() + BODY
    next_at = time.perf_counter()
    try:
        while next_at < stop_at:
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            t0 = time.perf_counter()
            writer.write(request)
            status, retry_after, body = await read_response(reader)
            results.append((status, time.perf_counter() - t0, body, retry_after))
            next_at += interval
    finally:
        writer.close()


async def drain(store: Store, capacity: float, stop: asyncio.Event, done: list[str]) -> None:
    """The worker pools: claim and complete one job every 1/capacity s."""
    period = 1.0 / capacity
    while not stop.is_set():
        t0 = time.perf_counter()
        for d in await store.claim(["bench"], "bench-drainer", 1, block_ms=50):
            if await store.start(d):
                blob = OutputBlob(
                    index=0, data=os.urandom(1024), content_type="image/png", width=64, height=64, seed=1
                )
                if await store.complete(d, [blob]):
                    done.append(d.job.id)
            await asyncio.sleep(max(0.0, period - (time.perf_counter() - t0)))


async def memory_sampler(store: Store, stop: asyncio.Event, samples: list[int]) -> None:
    while not stop.is_set():
        samples.append(int((await store.redis.info("memory"))["used_memory"]))
        await asyncio.sleep(0.25)


async def run(args: argparse.Namespace, redis_url: str, api_port: int, settings: Settings) -> dict:
    store = Store(settings)
    await store.register_pool(PoolInfo(name="bench-pool", models=[MODEL], ready=True, max_batch=1))
    key = await KeyStore(store.redis, store.prefix).create("bench", rate_per_minute=0, max_active=0)
    mem_before = int((await store.redis.info("memory"))["used_memory"])

    stop_load = time.perf_counter() + args.duration
    stop = asyncio.Event()
    done: list[str] = []
    samples: list[int] = []
    drainer = asyncio.create_task(drain(store, args.capacity, stop, done))
    sampler = asyncio.create_task(memory_sampler(store, stop, samples))
    results: list = []
    offered = args.capacity * args.factor
    interval = args.connections / offered
    started = time.perf_counter()
    await asyncio.gather(
        *(client(api_port, key, interval, stop_load, results) for _ in range(args.connections))
    )
    load_s = time.perf_counter() - started

    accepted = [json.loads(body)["id"] for status, _, body, _ in results if status == 202]
    # Let the drainer finish every accepted job, then check each one.
    deadline = time.monotonic() + len(accepted) / args.capacity + 30
    while len(set(done) & set(accepted)) < len(accepted) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.gather(drainer, sampler)
    jobs = [await store.get(job_id) for job_id in accepted]
    lost = sum(1 for j in jobs if j is None)
    unfinished = sum(1 for j in jobs if j is not None and j.status.value != "succeeded")
    mem_after = int((await store.redis.info("memory"))["used_memory"])
    await store.close()

    refused = [(s, t) for s, t, _, _ in results if s != 202]
    by_status: dict[int, int] = {}
    for s, _ in refused:
        by_status[s] = by_status.get(s, 0) + 1
    return {
        "offered_per_s": offered,
        "sent": len(results),
        "load_s": load_s,
        "accepted": len(accepted),
        "accepted_per_s": len(accepted) / load_s,
        "refused": by_status,
        "refusal_p50_ms": percentile([t for _, t in refused], 0.5),
        "refusal_p99_ms": percentile([t for _, t in refused], 0.99),
        "accepted_p50_ms": percentile([t for s, t, _, _ in results if s == 202], 0.5),
        "accepted_p99_ms": percentile([t for s, t, _, _ in results if s == 202], 0.99),
        "mem_before": mem_before,
        "mem_peak": max(samples, default=mem_before),
        "mem_after": mem_after,
        "lost": lost,
        "unfinished": unfinished,
        "refusals_without_retry_after": sum(1 for s, _, _, ra in results if s != 202 and not ra),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--capacity", type=float, default=20.0, help="jobs per second the drainer completes")
    ap.add_argument("--factor", type=float, default=10.0, help="offered load = capacity x factor")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load")
    ap.add_argument("--queue-cap", type=int, default=50, help="MESHSERVE_QUEUE_MAX_LENGTH")
    ap.add_argument("--connections", type=int, default=16)
    args = ap.parse_args()

    folder = tempfile.mkdtemp(prefix="ms-overload-")
    redis_port, api_port = free_port(), free_port()
    redis_proc = start_redis_server(redis_port, folder)
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    prefix = f"msbench-{uuid.uuid4().hex[:8]}"
    settings = Settings(redis_url=redis_url, key_prefix=prefix, pool_stale_s=3600)
    env = {
        **os.environ,
        "MESHSERVE_REDIS_URL": redis_url,
        "MESHSERVE_KEY_PREFIX": prefix,
        "MESHSERVE_AUTH": "keys",
        "MESHSERVE_QUEUE_MAX_LENGTH": str(args.queue_cap),
        "MESHSERVE_POOL_STALE_S": "3600",
        "PYTHONPATH": str(ROOT),
    }
    cmd = [sys.executable, "-m", "uvicorn", "meshserve.service.app:create_app", "--factory"]
    cmd += ["--host", "127.0.0.1", "--port", str(api_port), "--no-access-log", "--log-level", "warning"]
    api = subprocess.Popen(cmd, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                import socket

                with socket.create_connection(("127.0.0.1", api_port), timeout=0.5) as s:
                    s.sendall(f"GET /livez HTTP/1.1\r\nHost: x:{api_port}\r\n\r\n".encode())
                    if b" 200 " in s.recv(1024):
                        break
            except OSError:
                if api.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the API did not start") from None
                time.sleep(0.1)
        r = asyncio.run(run(args, redis_url, api_port, settings))
    finally:
        api.terminate()
        api.wait(timeout=30)
        stop_redis_server(redis_proc)

    mib = 1 / (1 << 20)
    load = os.getloadavg()[0]
    print(
        "| offered req/s | capacity jobs/s | queue cap | sent | accepted (per s) | refused by status "
        "| refusal p50 / p99 ms | accepted p50 / p99 ms | Redis used_memory before / peak / after MiB "
        "| lost | load avg |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {r['offered_per_s']:g} | {args.capacity:g} | {args.queue_cap} | {r['sent']} | {r['accepted']} "
        f"({r['accepted_per_s']:.1f}) | {r['refused']} | {r['refusal_p50_ms']:.1f} / {r['refusal_p99_ms']:.1f} "
        f"| {r['accepted_p50_ms']:.1f} / {r['accepted_p99_ms']:.1f} "
        f"| {r['mem_before'] * mib:.2f} / {r['mem_peak'] * mib:.2f} / {r['mem_after'] * mib:.2f} "
        f"| {r['lost']} (unfinished {r['unfinished']}) | {load:.1f} |"
    )
    print(f"refusals without Retry-After: {r['refusals_without_retry_after']}")
    bad_5xx = any(s >= 500 and s != 503 for s in r["refused"])
    sent_rate = r["sent"] / r["load_s"]
    if sent_rate < 0.8 * r["offered_per_s"]:
        print(f"note: the generator sent {sent_rate:.0f} req/s of the {r['offered_per_s']:g} offered")
    return 1 if r["lost"] or r["unfinished"] or bad_5xx or r["refusals_without_retry_after"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The serving path's own overhead per job: end-to-end latency of `POST /v1/generate` with `Prefer: wait`
minus the model's time, with the model-free fake runner (no JAX), on loopback.

    python bench/load_worker.py [--jobs 400] [--concurrency 1 8] [--workers 2] [--steps 1]

Starts a private redis-server, the API (uvicorn, one process) and N worker processes (one fake pool each), then
for each concurrency level sends `--jobs` requests that each wait for their result. Per job:
overhead = client latency - (text_encode + denoise + vae_decode) as the worker measured them; PNG encoding,
Redis round trips, the queue, HTTP and JSON all count as overhead. Prints one markdown row per concurrency level
(bench/README.md keeps the table). Target (issue 3): overhead p50 <= 10 ms.
"""

# ruff: noqa: T201 - a benchmark script prints its table

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshserve.workers.local_redis import free_port  # noqa: E402

MODEL_STAGES = ("text_encode", "denoise", "vae_decode")


def _spawn(code: str, env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT
    )


async def _wait_ready(client, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (await client.get("/readyz")).status_code == 200:
                return
        except Exception:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("the API never became ready (see the logs in the temp folder)")


async def _one(client, i: int) -> tuple[float, float, float, float]:
    t0 = time.perf_counter()
    r = await client.post(
        "/v1/generate",
        json={"model": "fake", "prompt": f"bench {i}", "seed": i},
        headers={"Prefer": "wait=30"},
    )
    latency = time.perf_counter() - t0
    job = r.json()
    if r.status_code != 200 or job["status"] != "succeeded":
        raise RuntimeError(f"job {i}: HTTP {r.status_code} {job}")
    t = job["timings"]
    stages = t.get("stages", {})
    return latency, sum(stages.get(s, 0.0) for s in MODEL_STAGES), t["queue_s"], t["inference_s"]


async def _level(client, jobs: int, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    results: list[tuple[float, float, float, float]] = []

    async def run(i: int) -> None:
        async with sem:
            results.append(await _one(client, i))

    t0 = time.perf_counter()
    await asyncio.gather(*(run(i) for i in range(jobs)))
    wall = time.perf_counter() - t0
    overhead = sorted((lat - model) * 1000 for lat, model, _, _ in results)
    latency = sorted(r[0] * 1000 for r in results)

    def pct(xs, p):
        return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]

    return {
        "jobs_per_s": jobs / wall,
        "latency_p50": statistics.median(latency),
        "latency_p99": pct(latency, 99),
        "overhead_p50": statistics.median(overhead),
        "overhead_p99": pct(overhead, 99),
        "model_ms": statistics.mean(r[1] * 1000 for r in results),
        # Where the time goes, from the job's own timestamps: submit -> start (queue, claim) and start -> stored.
        "queue_p50": statistics.median(r[2] * 1000 for r in results),
        "inference_p50": statistics.median(r[3] * 1000 for r in results),
    }


async def bench(args) -> None:
    import httpx

    from meshserve.workers.serve import local_redis

    tmp = Path(tempfile.mkdtemp(prefix="meshserve-bench-"))
    with local_redis() as url:
        env = {
            **os.environ,
            "MESHSERVE_REDIS_URL": url,
            "PYTHONPATH": str(ROOT),
            "MESHSERVE_QUEUE_MAX_LENGTH": "100000",
        }
        port = free_port()
        procs = [
            _spawn(f"from service.app import run_api; run_api('127.0.0.1', {port})", env, tmp / "api.log")
        ]
        for w in range(args.workers):
            cfg = tmp / f"pools-{w}.yaml"
            cfg.write_text(
                f"models:\n  fake: {{runner: fake, options: {{default_steps: {args.steps}}}}}\n"
                f"pools:\n  - {{name: bench, devices: '0', models: [fake], max_batch: {args.max_batch}, "
                f"batch_wait_ms: {args.batch_wait_ms}}}\n"
                "metrics_port: null\n"
            )
            code = f"from workers.main import run_worker; run_worker({str(cfg)!r})"
            procs.append(_spawn(code, env, tmp / f"worker-{w}.log"))
        try:
            limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", timeout=60, limits=limits
            ) as client:
                await _wait_ready(client)
                await asyncio.sleep(1.0)  # every worker registered
                await _level(client, min(50, args.jobs), 4)  # warm the connections and code paths
                print(
                    "| workers | concurrency | jobs | jobs/s | latency p50 / p99 (ms) | overhead p50 / p99 (ms) "
                    "| of which queued / running p50 (ms) |"
                )
                print("|---|---|---|---|---|---|---|")
                for c in args.concurrency:
                    r = await _level(client, args.jobs, c)
                    print(
                        f"| {args.workers} | {c} | {args.jobs} | {r['jobs_per_s']:.0f} | "
                        f"{r['latency_p50']:.1f} / {r['latency_p99']:.1f} | "
                        f"{r['overhead_p50']:.1f} / {r['overhead_p99']:.1f} | "
                        f"{r['queue_p50']:.1f} / {r['inference_p50']:.1f} |"
                    )
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--batch-wait-ms", type=float, default=0.0)
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()

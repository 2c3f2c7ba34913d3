"""The pool thread's idle gap between batches, with encoding on the pool thread (before) and off it (after).

    python bench/encode_gap.py [--models tiny-sdxl tiny-wan] [--jobs 8] [--rounds 3]

A real job loop (workers/job_loop.py) in this process, a private redis-server, and the embedded models through
the real PipelineRunner (warmed up for their default size: nothing compiles while measured). Each round
submits `--jobs` jobs at once (max_batch 1, so every job is a batch and the queue is never empty), runs the loop
until all have ended, and records when each pipeline call (text encode, denoise, decode: the device's work)
starts and ends on the pool thread. The gap is the time from the end of one call to the start of the next:

    before (JobLoop(encode_threads=0)): encoding on the pool thread, then the outputs stored and the job ended,
            then the next claim and start;
    after  (the default): the outputs handed to the encoder threads; only the next claim and start remain.

Rounds alternate before/after; medians over all gaps of a mode, with [min, max] of the per-round medians.
The tiny models' outputs encode in milliseconds, so their gap is mostly the Redis round trips between two
batches (claim, start, the progress task's last round), which this change leaves; `--real-sizes` times the
encoding of real outputs (a 1024x1024 PNG, a 81-frame 480p MP4) on this machine: what the pool thread waited
for per job before, and no longer does. Also prints each model's output bytes as float32 and as uint8 (what crosses to the host per batch) and the
bytes of an 81-frame 480p video (the issue's example). Output formats: PNG for images, MP4 for video.
"""

# ruff: noqa: T201 - a benchmark script prints its table

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


class TimedPipe:
    """The pipeline, recording (start, end) of every call: the pool thread's model work."""

    def __init__(self, pipe):
        self.__dict__["_pipe"] = pipe
        self.__dict__["spans"] = []

    def __getattr__(self, name):
        return getattr(self._pipe, name)

    def __setattr__(self, name, value):
        setattr(self._pipe, name, value)

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self._pipe(*args, **kwargs)
        self.spans.append((t0, time.perf_counter()))
        return out


async def one_round(
    runner, model: str, redis_url: str, jobs: int, encode_threads: int, fmt: str, info
) -> dict:
    from meshserve.service.contract import JobParams
    from meshserve.service.settings import Settings
    from meshserve.service.store import Store
    from meshserve.workers.job_loop import JobLoop
    from meshserve.workers.threads import PoolThread

    settings = Settings(redis_url=redis_url, key_prefix=f"gap-{uuid.uuid4().hex[:8]}", lease_s=60.0)
    store = Store(settings)
    thread = PoolThread("bench")
    d = info.defaults
    extra = {"num_frames": info.limits.frames.default, "fps": 16} if info.limits.frames else {}
    params = [
        JobParams(
            model=model,
            prompt=f"a red circle {i}",
            width=d.width,
            height=d.height,
            num_inference_steps=2,
            guidance_scale=d.guidance_scale,
            seed=i,
            n=1,
            output_format=fmt,
            **extra,
        )
        for i in range(jobs)
    ]
    loop = JobLoop(
        pool="bench",
        consumer="bench/bench",
        runners={model: runner},
        store=store,
        settings=settings,
        thread=thread,
        max_batch=1,
        batch_wait_ms=0,
        idle_block_ms=50,
        encode_threads=encode_threads,
    )
    ids = [(await store.submit(p)).id for p in params]
    runner.pipe.spans.clear()
    t0 = time.perf_counter()
    task = asyncio.create_task(loop.run())
    try:
        while True:
            done = [await store.get(i) for i in ids]
            if all(j.status.terminal for j in done):
                break
            await asyncio.sleep(0.005)
        wall = time.perf_counter() - t0
    finally:
        loop.request_stop(0.0)
        await task
        thread.close()
    bad = [j.status.value for j in done if j.status.value != "succeeded"]
    if bad:
        raise RuntimeError(f"jobs did not succeed: {bad}")
    spans = sorted(runner.pipe.spans)
    gaps = [(b[0] - a[1]) * 1000 for a, b in zip(spans, spans[1:], strict=False)]
    keys = await store.redis.keys(f"{settings.key_prefix}:*")
    if keys:
        await store.redis.delete(*keys)
    await store.close()
    encode = statistics.median(j.timings.stages.get("encode", 0.0) for j in done) * 1000
    model_ms = statistics.median((b - a) * 1000 for a, b in spans)
    return {"gaps": gaps, "jobs_per_s": jobs / wall, "encode_ms": encode, "model_ms": model_ms}


def output_bytes(info) -> tuple[int, int]:
    d = info.limits.frames.default if info.limits.frames else None
    shape = (
        (d, info.defaults.height, info.defaults.width, 3)
        if d
        else (info.defaults.height, info.defaults.width, 3)
    )
    n = 1
    for s in shape:
        n *= s
    return 4 * n, n


def real_sizes(rounds: int) -> None:
    """Encode times of real-size outputs (smooth moving content, as a generated picture or video is)."""
    from meshserve.workers.encoding import encode_output

    def frames(count: int, height: int, width: int):
        y, x = np.mgrid[0:height, 0:width].astype(np.float32)
        out = np.empty((count, height, width, 3), np.uint8)
        for t in range(count):
            for c in range(3):
                out[t, ..., c] = (
                    127.5 + 127.5 * np.sin((x + 3 * t) / (40 + 9 * c) + y / (55 + 7 * c))
                ).astype(np.uint8)
        return out

    cases = [
        ("png", frames(1, 1024, 1024)[0], "1024x1024 PNG"),
        ("mp4", frames(81, 480, 832), "81x480x832 MP4"),
    ]
    print("\n| output | encode median (s) [min, max] | uint8 bytes (MB) |")
    print("|---|---|---|")
    for fmt, array, name in cases:
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            encode_output(array, fmt)
            times.append(time.perf_counter() - t0)
        print(
            f"| {name} | {statistics.median(times):.3f} [{min(times):.3f}, {max(times):.3f}] | {array.nbytes / 1e6:.1f} |"
        )


async def main(args) -> None:
    from meshserve.workers.config import WorkerConfig
    from meshserve.workers.pool import load_runners
    from meshserve.workers.serve import local_redis

    print(
        f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} CPUs"
    )
    frames, height, width = 81, 480, 832
    print(
        f"81-frame 480p video ({frames} x {height} x {width} x 3): float32 {4 * frames * height * width * 3 / 1e6:.0f} "
        f"MB, uint8 {frames * height * width * 3 / 1e6:.0f} MB"
    )
    if args.real_sizes:
        real_sizes(args.rounds)
    with local_redis() as url:
        for model in args.models:
            cfg = WorkerConfig.model_validate(
                {
                    "models": {model: {"path": model}},
                    "pools": [{"name": "bench", "models": [model], "devices": "0"}],
                    "metrics_port": None,
                }
            )
            t0 = time.perf_counter()
            runners, infos = load_runners(cfg.pools[0], cfg.models)
            runner, info = runners[model], infos[model]
            runner.pipe = TimedPipe(runner.pipe)
            fmt = "mp4" if info.limits.frames else "png"
            f32, u8 = output_bytes(info)
            print(
                f"\n## {model}: {info.defaults.width}x{info.defaults.height}"
                + (f"x{info.limits.frames.default} frames" if info.limits.frames else "")
                + f", {fmt}, 2 steps, {args.jobs} jobs per round (loaded and warmed in {time.perf_counter() - t0:.0f} s)"
            )
            print(f"output per job: float32 {f32 / 1e3:.1f} kB, uint8 {u8 / 1e3:.1f} kB")
            results = {"before": [], "after": []}
            for r in range(args.rounds):
                for mode in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    threads = 0 if mode == "before" else 2
                    results[mode].append(await one_round(runner, model, url, args.jobs, threads, fmt, info))
            print(
                "| mode | gap p50 (ms) [per-round medians min, max] | gap max (ms) | model call p50 (ms) "
                "| encode p50 (ms) | jobs/s |"
            )
            print("|---|---|---|---|---|---|")
            for mode, rounds in results.items():
                gaps = [g for r in rounds for g in r["gaps"]]
                per_round = [statistics.median(r["gaps"]) for r in rounds]
                print(
                    f"| {mode} | {statistics.median(gaps):.1f} [{min(per_round):.1f}, {max(per_round):.1f}] | "
                    f"{max(gaps):.1f} | {statistics.median(r['model_ms'] for r in rounds):.0f} | "
                    f"{statistics.median(r['encode_ms'] for r in rounds):.1f} | "
                    f"{statistics.median(r['jobs_per_s'] for r in rounds):.2f} |"
                )
            runner.pipe = runner.pipe._pipe


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="*", default=["tiny-sdxl", "tiny-wan"])
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--real-sizes", action="store_true", help="also time encoding real-size outputs")
    asyncio.run(main(parser.parse_args()))

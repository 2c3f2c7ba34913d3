"""A pool's start with an empty and with a filled persistent compilation cache: load + warm-up, in seconds.

    python bench/warm_start.py                                  # the embedded models, 3 rounds
    python bench/warm_start.py --models tiny-flux --rounds 5 --model-arg scan_blocks=false

What a worker does when it starts a pool (workers/runner.py), in a fresh process each time so nothing is kept
in memory: `enable_compilation_cache(dir)` (the pool config's `compilation_cache_dir`), `load_pipeline(model)`,
then `warm_up(output_type="uint8")` (every stage of the default size, with and without CFG). Each round makes a
new empty cache directory, starts cold on it, then starts again on the cache the cold start filled (warm); the
script prints each start's load and warm-up seconds, the medians over rounds (min-max) and the warm/cold ratio,
with the date, CPU and load. docs/compilation.md has the results and how a deployment shares the cache.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from meshserve.models.engine.compile_cache import enable_compilation_cache
from meshserve.models import load_pipeline
enable_compilation_cache(sys.argv[1])
t1 = time.perf_counter()
pipe = load_pipeline(sys.argv[2], **json.loads(sys.argv[3]))
t2 = time.perf_counter()
pipe.warm_up(output_type="uint8")
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "load": t2 - t1, "warm_up": t3 - t2, "programs": pipe.compilations}))
"""


def start(cache: str, model: str, kwargs: dict) -> dict:
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, cache, model, json.dumps(kwargs)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} s ({min(values):.1f}-{max(values):.1f})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny-sdxl,tiny-flux,tiny-wan")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-arg", action="append", default=[], help="load_pipeline keyword: name=json")
    args = parser.parse_args()
    kwargs = {}
    for item in args.model_arg:
        name, _, value = item.partition("=")
        kwargs[name] = json.loads(value)
    print(
        f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()},"
        f" {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, load_pipeline kwargs {kwargs}",
        flush=True,
    )
    rows = []
    for model in args.models.split(","):
        cold, warm = [], []
        for r in range(args.rounds):
            cache = tempfile.mkdtemp(prefix="meshserve-warm-start-")
            try:
                for label, runs in (("cold", cold), ("warm", warm)):
                    result = start(cache, model, kwargs)
                    runs.append(result)
                    print(
                        f"  {model} round {r} {label}: load {result['load']:.1f} s, warm-up {result['warm_up']:.1f} s "
                        f"({result['programs']} programs), import {result['import']:.1f} s",
                        flush=True,
                    )
            finally:
                shutil.rmtree(cache, ignore_errors=True)

        def total(runs):
            return [x["load"] + x["warm_up"] for x in runs]

        ratios = [c / w for c, w in zip(total(cold), total(warm), strict=True)]
        rows.append(
            f"| {model} | {cold[0]['programs']} | {summary(total(cold))} | {summary(total(warm))} | "
            f"**{statistics.median(ratios):.1f}x** ({min(ratios):.1f}-{max(ratios):.1f}) |"
        )
    print(f"load after {os.getloadavg()[0]:.2f}")
    print("| model | programs | cold: load + warm-up | warm: load + warm-up | cold / warm |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

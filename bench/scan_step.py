"""Our Flux generation with the transformer's blocks scanned against unrolled, on the CPU: what the scan costs a step.

    python bench/scan_step.py                        # bench/flux_vs_diffusers.py's configuration: 2 + 4 blocks
    python bench/scan_step.py --double 6 --single 12 --rounds 5

Builds bench/flux_vs_diffusers.py's random checkpoint (512x512, width 256, `--double` + `--single` blocks, text
128, true CFG), loads it twice in one process, `scan_blocks=True` and `False` (models/components/
block_stack.py), and times 4-step and 1-step generations of each, the two alternating within each round (the
first alternates too). Prints the medians over rounds (min-max) of the whole 4-step generation and of a step
inside it ((4-step - 1-step) / 3), and the largest pixel difference between the two (the same program, so 0
is expected). Both pipelines share the process's cores: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import numpy as np  # noqa: E402

from bench import flux_vs_diffusers as flux_bench  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--double", type=int, default=2)
    ap.add_argument("--single", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from meshserve.models import load_pipeline

    config = argparse.Namespace(
        size=512, width=256, double=args.double, single=args.single, text_len=128, steps=4, seed=0
    )
    ckpt = flux_bench.build_checkpoint(Path(tempfile.mkdtemp(prefix="meshserve-scan-step-")), config)
    pipes = {
        mode: load_pipeline(ckpt, dtype="float32", scan_blocks=mode == "scan")
        for mode in ("scan", "unrolled")
    }
    kwargs, latents = flux_bench._generation_kwargs(config), flux_bench._latents(config.size)

    def generate(pipe, steps: int):
        return pipe("a red circle", num_inference_steps=steps, latents=latents, **kwargs).images

    def timed(pipe, steps: int) -> float:
        t0 = time.perf_counter()
        generate(pipe, steps)
        return time.perf_counter() - t0

    print(
        f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; {args.double} + {args.single} blocks",
        flush=True,
    )
    for pipe in pipes.values():  # compiles
        generate(pipe, 4), generate(pipe, 1)
    runs = {mode: {"whole": [], "step": []} for mode in pipes}
    for r in range(args.rounds):
        for mode in ("scan", "unrolled") if r % 2 == 0 else ("unrolled", "scan"):
            whole, one = timed(pipes[mode], 4), timed(pipes[mode], 1)
            runs[mode]["whole"].append(whole)
            runs[mode]["step"].append((whole - one) / 3)
    diff = float(np.abs(generate(pipes["scan"], 2) - generate(pipes["unrolled"], 2)).max())
    print(f"load after {os.getloadavg()[0]:.2f}; largest pixel difference scan - unrolled: {diff:.1e}")
    for mode, measures in runs.items():
        whole, step = measures["whole"], [s * 1000 for s in measures["step"]]
        print(
            f"{mode}: 4-step generation {statistics.median(whole):.3f} s ({min(whole):.3f}-{max(whole):.3f}), "
            f"step {statistics.median(step):.1f} ms ({min(step):.1f}-{max(step):.1f})"
        )


if __name__ == "__main__":
    main()

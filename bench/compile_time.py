"""Compile time of real-shape programs with the repeated blocks unrolled and under a scan (block_stack.py).

    python bench/compile_time.py                                   # the three programs, 1 device, 2 rounds
    python bench/compile_time.py --programs t5 --layouts 1,tensor4 --rounds 3

The programs are the memory benches' (nothing runs, nothing is allocated: the weights are abstract, placed as
`Placement.param_spec` places the real ones), compiled for XLA:CPU on N of 8 host devices:
- flux: FLUX.1-dev's denoise loop at 1024x1024, CFG off (bench/flux_memory.py `compile_denoise`: 19 double
  + 38 single blocks, bf16);
- wan: Wan2.1-T2V-14B's CFG denoise loop at 480p, 81 frames (bench/wan_memory.py `compile_denoise`: 40
  blocks, bf16);
- t5: T5 v1.1 XXL on [1, 512] tokens (bench/flux_memory.py `compile_t5`: 24 blocks, bf16).
Each is lowered and compiled with the blocks unrolled (`scan_blocks: false`) and stacked under one
lax.scan (the default), the two modes alternating within each round (the first mode alternates too). The
script prints each program's lowering and compile times per mode, their medians over rounds with min-max,
the ratio, and the compiled program's temporaries (`memory_analysis`), which the scan changes too. Compiled as
the memory benches compile for an accelerator (bench/memory_analysis.py ACCELERATOR_LIKE: no while-loop
invariant code motion, which on XLA:CPU hoists an f32 copy of a scanned bf16 stack). No persistent
compilation cache is used (JAX_COMPILATION_CACHE_DIR is ignored).

XLA:CPU's memory-minimizing scheduler, as the memory benches (`--default-scheduler`: the default one).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
import argparse  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

import bench.flux_memory as flux  # noqa: E402  (sets XLA_FLAGS before JAX starts)
import bench.wan_memory as wan  # noqa: E402
from bench.memory_analysis import ACCELERATOR_LIKE, layout_placement  # noqa: E402

MIB = 2**20

# name -> (mesh sizes, shard_over)
LAYOUTS = {
    "1": ({}, ()),
    "tensor4": ({"tensor": 4}, ()),
    "context4-fsdp": ({"context": 4}, ("context",)),
}


def lowered(program: str, placement, settings, scan: bool):
    """The program's jit(...).lower(...), unrolled or scanned."""
    if program == "flux":
        return flux.lower_denoise(flux.UNITS, placement, settings, 1, scan=scan)
    if program == "wan":
        latent = wan.video_size("480p", wan.WAN_14B)[2]
        return wan.lower_denoise(wan.WAN_14B, 40, placement, settings, latent, scan=scan)
    if program == "t5":
        return flux.lower_t5(placement, 1, scan=scan)
    raise ValueError(f"unknown program {program!r}: flux, wan or t5")


def measure(program: str, layout: str, scan: bool) -> dict:
    sizes, shard_over = LAYOUTS[layout]
    placement, settings = layout_placement(sizes, shard_over)
    t0 = time.perf_counter()
    low = lowered(program, placement, settings, scan)
    t1 = time.perf_counter()
    compiled = low.compile(compiler_options=ACCELERATOR_LIKE)
    t2 = time.perf_counter()
    temp = compiled.memory_analysis().temp_size_in_bytes
    return {"lower": t1 - t0, "compile": t2 - t1, "temp": temp}


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", default="flux,wan,t5")
    parser.add_argument("--layouts", default="1")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--default-scheduler", action="store_true")
    args = parser.parse_args()
    print(
        f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()},"
        f" {os.cpu_count()} cores, jax {jax.__version__}, load {os.getloadavg()[0]:.2f}, scheduler "
        + ("default" if args.default_scheduler else "memory-minimizing"),
        flush=True,
    )
    rows = []
    for program in args.programs.split(","):
        for layout in args.layouts.split(","):
            runs = {False: [], True: []}
            for r in range(args.rounds):
                for scan in (r % 2 == 1, r % 2 == 0):
                    result = measure(program, layout, scan)
                    runs[scan].append(result)
                    mode = "scan" if scan else "unrolled"
                    print(
                        f"  {program} {layout} round {r} {mode}: lower {result['lower']:.1f} s, compile "
                        f"{result['compile']:.1f} s, temporaries {result['temp'] / MIB:,.0f} MiB",
                        flush=True,
                    )

            def total(rs):
                return [x["lower"] + x["compile"] for x in rs]

            ratios = [u / s for u, s in zip(total(runs[False]), total(runs[True]), strict=True)]
            rows.append(
                f"| {program} | {layout} | {summary(total(runs[False]))} | {summary(total(runs[True]))} | "
                f"**{statistics.median(ratios):.1f}x** ({min(ratios):.1f}-{max(ratios):.1f}) | "
                f"{runs[False][0]['temp'] / MIB:,.0f} / {runs[True][0]['temp'] / MIB:,.0f} MiB |"
            )
    print(f"load after {os.getloadavg()[0]:.2f}")
    print(
        "| program | layout | unrolled: lower + compile, s | scan: lower + compile, s | speed-up | temporaries |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

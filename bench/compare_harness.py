"""The harness the "ours against diffusers" benchmarks share (sdxl_, flux_ and wan_vs_diffusers.py).

Each script builds one small random checkpoint with diffusers, then measures the two sides, meshserve (JAX)
and diffusers (PyTorch), each in its own process: XLA's CPU thread pool and torch's intra-op threads
otherwise compete (measured in one process, diffusers' SDXL generation took 34 s instead of 2 s). Both
children are pinned to the same `--threads` CPUs (sched_setaffinity: XLA sizes its pool from the affinity
mask; torch.set_num_threads as well). The sides alternate which goes first for `--rounds` rounds, because
this shared VM's speed drifts by 10-30 % over minutes, which one run per side would book to one side; every
figure is the median over rounds with its min-max, each speed-up the median of the per-round ratios (the two
sides of one round ran minutes apart, so their ratio is less exposed to the drift than a ratio of medians).

A script supplies the model-specific parts: its options, `build_checkpoint`, and one function per side that
takes (checkpoint folder, args) and returns (images, measurements) with at least "step", "vae", "gen",
"gen_1" in seconds ("gen", "gen_1" and "compile" from `time_generations`); the ours side may add "xla_flops",
"analytic_flops" and "matmul_rate" (`time_ours_flow_step` gives the first and last) for the achieved-FLOP/s
paragraph. This module runs the children (`compare`), compares their images (max abs pixel difference), and
prints the date/CPU/load header, the table per measure and the bench/README.md row (`report`).

bench/ is not a package: the scripts put the repository root on sys.path and
`from bench import compare_harness as harness`, so `python bench/X.py` runs from the repository root.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SIDES = ("ours", "diffusers")
Side = Callable[[Path, argparse.Namespace], tuple[object, dict]]


def add_harness_options(ap: argparse.ArgumentParser) -> None:
    """--repeats, --threads, --rounds, and the hidden options a child process is started with."""
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of each side; median and min-max")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--images", help=argparse.SUPPRESS)


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_generations(run, steps: int, repeats: int) -> tuple[object, dict]:
    """run(n) generates with n steps. Returns the first `steps` output and "gen", "gen_1" (medians of
    `repeats` whole generations of `steps` and of 1 step) and "compile" (first call - steady call: our
    compile time; near 0 for diffusers). The untimed 1-step call before "gen_1" compiles our 1-step program
    (the schedule differs)."""
    t0 = time.perf_counter()
    first = run(steps)
    first_s = time.perf_counter() - t0
    gen = median_time(lambda: run(steps), repeats)
    run(1)
    gen_1 = median_time(lambda: run(1), repeats)
    return first, {"gen": gen, "gen_1": gen_1, "compile": first_s - gen}


def warm_median(fn, repeats: int) -> float:
    """median_time after one untimed call (our compile, both sides' first-call caches)."""
    fn()
    return median_time(fn, repeats)


def load_ours(ckpt: Path) -> tuple[object, float]:
    """Our pipeline from the checkpoint folder in fp32, and the seconds the load took."""
    from meshserve.models import load_pipeline

    t0 = time.perf_counter()
    ours = load_pipeline(ckpt, dtype="float32")
    return ours, time.perf_counter() - t0


def ours_component(ours, name: str) -> tuple[object, object]:
    """(graph, state) of one of our pipeline's components, to jit a call of it with the state an argument."""
    from flax import nnx

    return nnx.split(nnx.merge(ours._graphs[name], ours._states[name]))


def ours_parameters(ours, name: str) -> int:
    import jax

    return int(sum(v.size for v in jax.tree.leaves(ours._states[name])))


def time_ours_flow_step(cfg_step, state, x, repeats: int) -> dict:
    """cfg_step(state, x, sigma, sigma_next): one CFG denoise step with a flow update, compiled at sigma 0.9
    -> 0.8. Its median time ("step", at least 5 calls), its FLOPs by XLA ("xla_flops") and the plain matmul
    rate of this process measured right before ("matmul_rate")."""
    import jax
    import jax.numpy as jnp

    sigma, sigma_next = jnp.float32(0.9), jnp.float32(0.8)
    compiled = jax.jit(cfg_step).lower(state, x, sigma, sigma_next).compile()
    compiled(state, x, sigma, sigma_next).block_until_ready()
    rate = matmul_rate()
    step = median_time(lambda: compiled(state, x, sigma, sigma_next).block_until_ready(), max(5, repeats))
    return {"step": step, "xla_flops": xla_flops(compiled), "matmul_rate": rate}


def time_ours_decode(ours, z, repeats: int) -> float:
    """Median time of our VAE decode of latents `z` (jitted, after one compiling call)."""
    import jax
    from flax import nnx

    graph, state = ours_component(ours, "vae")
    decode = jax.jit(lambda state, z: nnx.merge(graph, state).decode(z))
    return warm_median(lambda: decode(state, z).block_until_ready(), repeats)


def load_diffusers(pipeline_class, ckpt: Path):
    """diffusers' pipeline from the checkpoint folder in fp32, progress bar off."""
    import torch

    ref = pipeline_class.from_pretrained(str(ckpt), torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    return ref


def matmul_rate(n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of a plain jitted fp32 n x n matmul on this process's CPUs (median of `repeats`)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    mm = jax.jit(lambda a, b: a @ b)
    mm(a, b).block_until_ready()
    return 2.0 * n**3 / median_time(lambda: mm(a, b).block_until_ready(), repeats)


def xla_flops(compiled) -> float:
    """FLOPs of a compiled JAX program by XLA's cost_analysis() (nan where it gives none)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return float(cost.get("flops", float("nan"))) if cost else float("nan")


def _pin(threads: int) -> None:
    """Both sides on the same CPUs: XLA sizes its pool from the affinity mask, torch is told as well."""
    cpus = sorted(os.sched_getaffinity(0))
    if threads < len(cpus):
        os.sched_setaffinity(0, cpus[:threads])


def run_side(args: argparse.Namespace, run_ours: Side, run_diffusers: Side) -> bool:
    """In a child process (started with --side): pin, measure one side, save its images to --images (a side
    that returns None for them has none) and print its measurements as JSON on the last line; True. In the
    parent: False."""
    if not args.side:
        return False
    import numpy as np

    _pin(args.threads)
    if args.side == "ours":
        from meshserve.models.cpu.xla_cpu_flags import apply_cpu_defaults

        apply_cpu_defaults()  # as `meshserve` runs: before JAX starts its CPU backend
        images, result = run_ours(Path(args.ckpt), args)
        threads = len(os.sched_getaffinity(0))
    else:
        import torch

        torch.set_num_threads(args.threads)
        images, result = run_diffusers(Path(args.ckpt), args)
        threads = torch.get_num_threads()
    if images is not None:
        np.save(args.images, images)
    result.update(threads=threads, xla_flags=os.environ.get("XLA_FLAGS", ""))
    print(json.dumps(result))
    return True


@dataclasses.dataclass
class Rounds:
    ours: list[dict]  # one measurement dict per round
    ref: list[dict]  # diffusers'
    err: float  # max |ours - diffusers| over the pixels of the two sides' last outputs
    started: datetime.datetime
    load_before: float  # 1-minute load averages
    load_after: float


def compare(script: str, args: argparse.Namespace, build_checkpoint, flags: tuple[str, ...]) -> Rounds:
    """build_checkpoint(folder, args) -> checkpoint folder, in a new temporary folder; then `args.rounds`
    rounds of both sides of `script`, each a child process given --side and `flags` (names of args
    attributes), alternating which goes first. Adds "in_gen" to every measurement."""
    import numpy as np

    tmp = Path(tempfile.mkdtemp(prefix=f"meshserve-{Path(script).stem}-"))
    ckpt = build_checkpoint(tmp, args)
    runs, started, load_before, load_after = alternate_sides(script, args, ckpt, tmp, flags)
    # A step as the generation runs it: what one more step adds, loop overhead included.
    for rs in runs.values():
        for r in rs:
            r["in_gen"] = (r["gen"] - r["gen_1"]) / max(args.steps - 1, 1)
    err = float(np.abs(np.load(tmp / "ours.npy") - np.load(tmp / "diffusers.npy")).max())
    return Rounds(runs["ours"], runs["diffusers"], err, started, load_before, load_after)


def alternate_sides(
    script: str, args: argparse.Namespace, ckpt: Path, tmp: Path, flags: tuple[str, ...]
) -> tuple[dict[str, list[dict]], datetime.datetime, float, float]:
    """`args.rounds` rounds of both sides of `script` on `ckpt`, each a child process given --side, --images
    in `tmp` and `flags` (names of args attributes), alternating which goes first. Returns (each side's
    measurement dicts, start time, 1-minute load average before, after)."""
    started, load_before = datetime.datetime.now(datetime.UTC), os.getloadavg()[0]
    runs = {side: [] for side in SIDES}
    for r in range(args.rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            cmd = [sys.executable, script, "--side", side, "--ckpt", str(ckpt)]
            cmd += ["--images", str(tmp / f"{side}.npy")]
            for flag in flags:
                cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{side} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
            runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return runs, started, load_before, os.getloadavg()[0]


def report(rounds: Rounds, args: argparse.Namespace, model: str, step_label: str, config: str) -> None:
    """Prints the header (date, CPU, load; `model`: the script's description of model and sizes),
    the table per measure, our step's achieved FLOP/s where measured, and the README row (`config`: its first
    cell)."""
    ours, ref = rounds.ours, rounds.ref
    print(
        f"\n{rounds.started:%Y-%m-%d %H:%M} UTC, {cpu_name()}, {os.cpu_count()} cores, load average "
        f"{rounds.load_before:.2f} before / {rounds.load_after:.2f} after (1 min)\n"
        f"{model}; threads: ours {ours[0]['threads']}, diffusers {ref[0]['threads']}; each side in its own process, {args.rounds} alternating rounds (median, min-max over "
        f"rounds); our XLA_FLAGS={ours[0]['xla_flags']!r}; max |ours - diffusers| pixel = {rounds.err:.1e}; "
        f"our load {statistics.median(r['load'] for r in ours):.1f}s\n"
    )
    print("| measure | meshserve (JAX) | diffusers (PyTorch) | speed-up, per-round ratios |")
    print("|---|---|---|---|")
    rows = [
        (step_label, "step", 1e3, "ms"),
        ("one step inside a generation, (whole - 1-step whole) / (steps - 1)", "in_gen", 1e3, "ms"),
        (f"whole generation, {args.steps} steps (median of {args.repeats} per round)", "gen", 1, "s"),
        ("whole generation, 1 step", "gen_1", 1, "s"),
        ("VAE decode", "vae", 1e3, "ms"),
    ]
    cells = []
    for name, key, scale, unit in rows:
        a = [r[key] * scale for r in ours]
        b = [r[key] * scale for r in ref]
        ratio = [y / x for x, y in zip(a, b, strict=True)]
        fmt = ".2f" if unit == "s" else ".1f"
        print(f"| {name} | {spread(a, fmt)} {unit} | {spread(b, fmt)} {unit} | {spread(ratio, '.2f')}x |")
        cells.append(
            f"{statistics.median(a):{fmt}} / {statistics.median(b):{fmt}} {unit} "
            f"(**{statistics.median(ratio):.2f}x**, {min(ratio):.2f}-{max(ratio):.2f})"
        )
    compile_s = [r["compile"] for r in ours]
    print(f"| compile (first call - steady call) | {spread(compile_s, '.1f')} s | n/a | |")

    if "analytic_flops" in ours[0]:  # achieved FLOP/s of our step against the same process's matmul rate
        gflops = [r["xla_flops"] / r["step"] / 1e9 for r in ours]
        analytic = [r["analytic_flops"] / r["step"] / 1e9 for r in ours]
        mm = [r["matmul_rate"] / 1e9 for r in ours]
        share = [r["analytic_flops"] / r["step"] / r["matmul_rate"] for r in ours]
        print(
            f"\nOur step: {ours[0]['xla_flops'] / 1e9:.2f} GFLOP by XLA's cost_analysis, "
            f"{ours[0]['analytic_flops'] / 1e9:.2f} GFLOP analytic (matmuls + attention); achieved "
            f"{spread(gflops, '.1f')} GFLOP/s (cost_analysis) / {spread(analytic, '.1f')} GFLOP/s (analytic); "
            f"plain fp32 2048^3 matmul in the same process {spread(mm, '.1f')} GFLOP/s; step at "
            f"{spread([100 * s for s in share], '.0f')} % of the matmul rate (analytic FLOPs)."
        )
        cells.append(
            f"{statistics.median(analytic):.1f} GFLOP/s ({statistics.median(share) * 100:.0f} % of "
            f"{statistics.median(mm):.1f})"
        )
    print("\nbench/README.md row (ours / diffusers, median speed-up, its min-max over rounds):\n")
    print(
        f"| {config} | "
        + " | ".join(cells)
        + f" | {statistics.median(compile_s):.1f} s | {rounds.started:%Y-%m-%d}, "
        f"load {rounds.load_before:.1f}/{rounds.load_after:.1f} |"
    )


def spread(values: list[float], fmt: str) -> str:
    """'median (min-max)' over rounds."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()

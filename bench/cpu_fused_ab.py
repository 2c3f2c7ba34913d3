"""What the CPU's fused attention kernel buys a whole generation: one process, the same checkpoint loaded twice,
attention kernel "auto" (cpu_fused on the CPU) against "xla_chunked" (the kernel before it), alternating.

    python bench/cpu_fused_ab.py --rounds 6                  # sdxl, flux and wan, the CPU rows' checkpoints
    python bench/cpu_fused_ab.py --models flux --rounds 6

The comparisons against diffusers (sdxl_vs_diffusers.py and the others) put each side in its own process, minutes
apart, so a VM whose speed drifts between processes moves their ratios more than a kernel does (bench/README.md,
"One fused kernel"). Here both pipelines live in one process and alternate call by call, so the drift falls on
both alike. The checkpoints are the ones bench/README.md's CPU rows use (built by diffusers, random weights):
SDXL width 64 at 256x256, 10 Euler steps, CFG; Flux 2+4 blocks of width 256 at 512x512, 4 steps, true CFG;
Wan 4 blocks of dim 256, 9 frames of 320x256, 4 steps, CFG. Each round times every pipeline's whole
generation (`--repeats` calls, median) and its 1-step generation; "a step" is (whole - 1-step) / (steps - 1),
what one more trip of the compiled loop costs. Printed: the date, CPU and load, each measure's median over
rounds (min-max), the speed-up as the median of the per-round ratios (min-max), and the largest pixel
difference between the two kernels' outputs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import compare_harness as harness  # noqa: E402

KERNELS = ("auto", "xla_chunked")


def _sdxl(out: Path):
    from bench import sdxl_vs_diffusers as b

    ckpt, size = b.build_checkpoint(out, 64), 256
    kw = dict(height=size, width=size, guidance_scale=5.0, output_type="np")
    return ckpt, 10, lambda pipe, n: pipe(b.PROMPT, latents=b._latents(size), num_inference_steps=n, **kw)


def _flux(out: Path):
    from bench import flux_vs_diffusers as b

    args = argparse.Namespace(size=512, width=256, double=2, single=4, text_len=128, steps=4)
    ckpt, kw = b.build_checkpoint(out, args), b._generation_kwargs(args)
    return ckpt, 4, lambda pipe, n: pipe(b.PROMPT, latents=b._latents(512), num_inference_steps=n, **kw)


def _wan(out: Path):
    from bench import wan_vs_diffusers as b

    args = argparse.Namespace(height=256, width=320, frames=9, dim=256, layers=4, ffn=704, steps=4)
    ckpt = b.build_checkpoint(out, args)
    return ckpt, 4, lambda pipe, n: pipe(b.PROMPT, latents=b._latents(args), **b._gen_kwargs(args, n))


MODELS = {"sdxl": _sdxl, "flux": _flux, "wan": _wan}


def run_model(name: str, rounds: int, repeats: int) -> list[str]:
    import numpy as np

    from meshserve.models import load_pipeline

    ckpt, steps, generate = MODELS[name](Path(tempfile.mkdtemp(prefix=f"meshserve-ab-{name}-")))
    pipes = {k: load_pipeline(ckpt, dtype="float32", attention={"kernel": k}) for k in KERNELS}
    outputs = {k: np.asarray(generate(p, steps).images, np.float64) for k, p in pipes.items()}  # compiles
    for p in pipes.values():
        generate(p, 1)
    diff = float(np.abs(outputs["auto"] - outputs["xla_chunked"]).max())
    whole: dict[str, list[float]] = {k: [] for k in KERNELS}
    step: dict[str, list[float]] = {k: [] for k in KERNELS}
    for _ in range(rounds):
        for k, p in pipes.items():
            w = harness.median_time(lambda p=p: generate(p, steps), repeats)
            one = harness.median_time(lambda p=p: generate(p, 1), repeats)
            whole[k].append(w)
            step[k].append((w - one) / (steps - 1))
    lines = [f"{name}: max |auto - xla_chunked| pixel = {diff:.1e} (of 1)"]
    for label, values, scale, unit in (
        (f"whole generation, {steps} steps", whole, 1.0, "s"),
        ("one step inside it", step, 1e3, "ms"),
    ):
        fused, chunked = ([v * scale for v in values[k]] for k in KERNELS)
        ratios = [c / f for c, f in zip(chunked, fused, strict=True)]
        lines.append(
            f"| {name} | {label} | {harness.spread(fused, '.3g')} {unit} | {harness.spread(chunked, '.3g')} {unit} | "
            f"**{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="sdxl,flux,wan", help="comma-separated: sdxl, flux, wan")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3, help="calls per measure per round (median)")
    args = ap.parse_args()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    started, load_before = datetime.now(UTC), os.getloadavg()[0]
    t0 = time.perf_counter()
    lines = [line for name in names for line in run_model(name, args.rounds, args.repeats)]
    print(
        f"\n{started:%Y-%m-%d %H:%M} UTC, {harness.cpu_name()}, {os.cpu_count()} cores, load average "
        f"{load_before:.2f} before / {os.getloadavg()[0]:.2f} after, {time.perf_counter() - t0:.0f} s; "
        f"{args.rounds} alternating rounds of {args.repeats} calls per measure\n"
    )
    print("| model | measure | cpu_fused (auto) | xla_chunked | speed-up, per-round ratios |")
    print("|---|---|---|---|---|")
    print("\n".join(line for line in lines if line.startswith("|")))
    print("\n".join(line for line in lines if not line.startswith("|")))


if __name__ == "__main__":
    main()

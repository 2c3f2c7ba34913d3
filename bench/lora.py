"""LoRA per request (issue 21): what adapters cost per denoise step, and a batch of rows with different
adapters against one run per adapter.

    python bench/lora.py [--model tiny-sdxl] [--size 128] [--steps 8] [--rounds 5]

Three pipelines of one model: one whose calls never carry adapters (no LoRA support: the plain denoise
program, what every pipeline runs for a batch without adapters), and two LoRA pools of max_loras 4 at max rank
16 and 64. On each pool, random adapters of the pool's rank (the adapter's rank is padded to the pool's), and
calls with 0 adapters (the LoRA program with every slot at scale 0: what a row without adapters costs in a
batch where another row has some), 1 adapter and 4 adapters. The LoRA program's shapes are the pool's
(max_loras x max rank per layer), so 0, 1 and 4 adapters run the same matmuls: the figures should agree, and
the price is set by the pool's limits, not by the call.

Then, on the rank-16 pool, a batch of 4 rows each with its own adapter against 4 separate batch-1 calls, one
adapter each (the way a server that batches only equal adapters would run them).

Per round, in alternating order, every mode runs once: batch 1, `--steps` steps, CFG, output "latent" (the
VAE decode does not depend on the adapters); the figure is the pipeline's own denoise timing (blocked until
ready) divided by the steps. Medians over `--rounds` (min-max). The first call of every mode compiles and is not
timed; the script asserts that no timed call compiled. `--targets` (a regex over diffusers' module names, the
pools' `lora_targets`) defaults to the attention projections, what diffusers' SDXL DreamBooth LoRA script
adapts; "" adapts every Linear of the denoiser (a longer compile). `--convs` adds the UNet's 2-D convolutions
to the pools' tables (`lora_convs`: LoCon files, LCM-LoRA), so the LoRA program carries their adapters too.

Prints the date, the machine (CPU model, cores), the load average before and after, the compile seconds of each
mode's first call (the LoRA program's compile) and a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from meshserve.models.cpu.xla_cpu_flags import apply_cpu_defaults  # noqa: E402

apply_cpu_defaults()

import numpy as np  # noqa: E402

from meshserve.models import load_pipeline  # noqa: E402

ATTENTION = r"attn[12]\.(to_[qkv]|to_out\.0)$"
CONVS = r"(resnets\.\d+\.(conv1|conv2|conv_shortcut)|(down|up)samplers\.0\.conv)$"
PROMPT = "a red circle on a blue background"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def write_adapter(path: Path, shapes: dict, rank: int, seed: int) -> Path:
    """A random diffusers-format adapter for every layer of the pool's table (as tests/fixtures/tiny_lora.py)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, s in shapes.items():
        kernel = tuple(s.get("kernel", ()))  # a conv's: down [r, in, kh, kw], up [out, r, 1, 1]
        fan_in = s["in"] * int(np.prod(kernel))
        tensors[f"unet.{name}.lora_A.weight"] = rng.standard_normal((rank, s["in"], *kernel)).astype(
            np.float32
        ) / np.sqrt(fan_in)
        tensors[f"unet.{name}.lora_B.weight"] = (
            rng.standard_normal((s["out"], rank, *(1,) * len(kernel))).astype(np.float32)
            * 0.5
            / np.sqrt(rank)
        )
    save_file(tensors, str(path))
    return path


def run(pipe, loras, size: int, steps: int, batch: int = 1) -> float:
    out = pipe(
        [PROMPT] * batch,
        negative_prompt="blurry",
        seed=list(range(batch)),
        height=size,
        width=size,
        num_inference_steps=steps,
        output_type="latent",
        loras=loras,
        **{pipe.cfg_field: 5.0},
    )
    return out.timings["denoise"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-sdxl")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--targets", default=ATTENTION)
    parser.add_argument("--convs", action="store_true", help="the UNet's convolutions in the tables too")
    args = parser.parse_args()
    targets = args.targets or None
    if args.convs and targets is not None:
        targets = f"(?:{targets})|{CONVS}"
    load_before = os.getloadavg()[0]

    plain = load_pipeline(args.model, dtype="float32")
    pools = {
        rank: load_pipeline(
            args.model,
            dtype="float32",
            max_loras=4,
            max_lora_rank=rank,
            lora_targets=targets,
            lora_convs=args.convs,
        )
        for rank in (16, 64)
    }
    folder = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    for rank, pipe in pools.items():
        shapes = pipe.lora._layers()[1]
        for i in range(4):
            pipe.load_lora(
                f"r{rank}_{i}", write_adapter(folder / f"r{rank}_{i}.safetensors", shapes, rank, i)
            )

    def adapters(rank: int, k: int):
        return [{"name": f"r{rank}_{i}", "scale": 0.8} for i in range(k)]

    from meshserve.models.lora.pool import ZERO_SCALES

    # mode -> (pipe, loras, batch, steps divisor: per row-step for the 4-row comparisons)
    modes = {"no LoRA support": (plain, None, 1)}
    for rank, pipe in pools.items():
        modes[f"rank {rank}, 0 adapters"] = (pipe, ZERO_SCALES, 1)
        modes[f"rank {rank}, 1 adapter"] = (pipe, adapters(rank, 1), 1)
        modes[f"rank {rank}, 4 adapters"] = (pipe, adapters(rank, 4), 1)
    four = [[a] for a in adapters(16, 4)]
    modes["rank 16, batch of 4 rows, 4 different adapters"] = (pools[16], four, 4)

    compile_s = {}
    for mode, (pipe, loras, batch) in modes.items():  # compile every program once, untimed
        seconds = pipe.programs.seconds
        run(pipe, loras, args.size, args.steps, batch)
        compile_s[mode] = pipe.programs.seconds - seconds
    compiled = {id(p): p.compilations for p in [plain, *pools.values()]}

    times = {mode: [] for mode in modes}
    times["rank 16, 4 separate runs, 1 adapter each"] = []
    for r in range(args.rounds):
        order = list(modes.items())
        if r % 2:
            order.reverse()  # alternate so drift and warm caches favour no mode
        for mode, (pipe, loras, batch) in order:
            times[mode].append(run(pipe, loras, args.size, args.steps, batch) / args.steps)
            if batch == 4:  # the same four rows, one call each, right after the batch
                separate = sum(run(pipe, [row], args.size, args.steps) for row in loras)
                times["rank 16, 4 separate runs, 1 adapter each"].append(separate / args.steps)
    for pipe in [plain, *pools.values()]:
        assert pipe.compilations == compiled[id(pipe)], "a timed call compiled a program"
    load_after = os.getloadavg()[0]

    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:.1f} ms ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"{now}; {cpu_name()}, {os.cpu_count()} cores; load {load_before:.2f} before, {load_after:.2f} after"
    )
    layers = len(pools[16].lora._layers()[0])
    print(
        f"{args.model}, {args.size}x{args.size}, {args.steps} steps, CFG, fp32, {args.rounds} rounds; "
        f"LoRA tables: {layers} layers (targets {targets or 'every Linear'}"
        f"{', convs too' if args.convs else ''}), max_loras 4"
    )
    # A pipeline's first call compiles its text encoder's program too (a hit in JAX's persistent cache after the
    # first pipeline); the batch of 4 compiles its own text and LoRA programs.
    for mode, seconds in compile_s.items():
        print(f"compiled by the first call of {mode!r}: {seconds:.1f} s")
    print()
    base = statistics.median(times["no LoRA support"])
    print("| mode | denoise per step (all rows) | / no LoRA support |")
    print("|---|---|---|")
    for mode, xs in times.items():
        print(f"| {mode} | {med(xs)} | {statistics.median(xs) / base:.2f} |")
    batch, separate = (
        times["rank 16, batch of 4 rows, 4 different adapters"],
        times["rank 16, 4 separate runs, 1 adapter each"],
    )
    ratios = [s / b for b, s in zip(batch, separate, strict=True)]
    print(
        f"\n4 separate runs / one batch of 4: {statistics.median(ratios):.2f}x "
        f"({min(ratios):.2f}-{max(ratios):.2f}, per-round ratios)"
    )


if __name__ == "__main__":
    main()

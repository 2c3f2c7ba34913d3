"""Image inputs (issue 20): img2img at strength s costs about s of the steps; what the image_encode stage costs.

    python bench/image_inputs.py [--model tiny-sdxl] [--size 256] [--steps 20] [--rounds 5]

On one pipeline (one program per task, whatever the strength), per round in alternating order: a text-to-
image generation and img2img at strength 1.0, 0.75, 0.5 and 0.25, each `--steps` steps with CFG, batch 1,
output "latent" (the VAE decode is the same for every mode, so it is left out). Printed per mode: the denoise
seconds (median over rounds, min-max), the steps it ran, the ratio to text-to-image's denoise, and the
image_encode seconds (the VAE encoder on the image; img2img only). The timings are the pipeline's own
(`out.timings`: each stage blocked until ready). The first call of every mode compiles and is not timed.

The script prints the date, the machine (CPU model, cores), the load average before and after, and a
Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from meshserve.models.cpu.xla_cpu_flags import apply_cpu_defaults  # noqa: E402

apply_cpu_defaults()

import numpy as np  # noqa: E402

from meshserve.models import load_pipeline  # noqa: E402

MODES = {
    "text-to-image": None,
    "strength 1.0": 1.0,
    "strength 0.75": 0.75,
    "strength 0.5": 0.5,
    "strength 0.25": 0.25,
}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run(pipe, strength, image, size: int, steps: int) -> dict:
    extra = {} if strength is None else {"image": image, "strength": strength}
    out = pipe(
        "a red circle on a blue background",
        negative_prompt="blurry",
        seed=0,
        height=size,
        width=size,
        num_inference_steps=steps,
        output_type="latent",
        **{pipe.cfg_field: 5.0},
        **extra,
    )
    return out.timings


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-sdxl")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    pipe = load_pipeline(args.model)
    y, x = np.mgrid[0 : args.size, 0 : args.size] / args.size
    image = (np.stack([x, y, 1 - x * y], axis=-1) * 255).astype(np.uint8)
    for strength in MODES.values():  # compile (text-to-image: 3 programs; img2img: 4, shared by strengths)
        run(pipe, strength, image, args.size, args.steps)
    compiled = pipe.compilations
    times = {mode: {"denoise": [], "image_encode": []} for mode in MODES}
    for r in range(args.rounds):
        order = list(MODES.items())
        if r % 2:
            order.reverse()  # alternate the order so drift and warm caches favour no mode
        for mode, strength in order:
            timings = run(pipe, strength, image, args.size, args.steps)
            times[mode]["denoise"].append(timings["denoise"])
            if "image_encode" in timings:
                times[mode]["image_encode"].append(timings["image_encode"])
    assert pipe.compilations == compiled, "a strength compiled a program"
    load_after = os.getloadavg()[0]

    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:.1f} ms ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"{now}; {cpu_name()}, {os.cpu_count()} cores; load {load_before:.2f} before, {load_after:.2f} after"
    )
    print(f"{args.model}, {args.size}x{args.size}, {args.steps} steps, CFG, batch 1, {args.rounds} rounds\n")
    base = statistics.median(times["text-to-image"]["denoise"])
    print("| mode | steps run | denoise | / text-to-image | image_encode |")
    print("|---|---|---|---|---|")
    for mode, strength in MODES.items():
        steps = args.steps if strength is None else int(args.steps * strength)
        denoise = times[mode]["denoise"]
        encode = times[mode]["image_encode"]
        ratio = statistics.median(denoise) / base
        print(f"| {mode} | {steps} | {med(denoise)} | {ratio:.2f} | {med(encode) if encode else '-'} |")


if __name__ == "__main__":
    main()

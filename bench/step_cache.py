"""Step caching's quality and speed on a trained model: for each step count and threshold, the held-out
captions' pictures with the cache against the same seeds without it (PSNR, SSIM), their adherence
(training/shape_score.py), the steps skipped, and the denoise time (medians over alternating rounds).

    python bench/step_cache.py                      # the embedded tiny SDXL (deep_features)
    python bench/step_cache.py --method teacache    # the embedded tiny SDXL, TeaCache
    python bench/step_cache.py --model tiny-flux --call '{"true_cfg_scale": 2, "negative_prompt": ""}'
    python bench/step_cache.py --model tiny-wan --method teacache   # clips: each held-out motion

Random weights say nothing here: a cache's error is only meaningful on a model that draws something.
Results: docs/step-cache.md and bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np

from meshserve.models.cpu.xla_cpu_flags import apply_cpu_defaults

apply_cpu_defaults()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of uint8 pictures, dB (inf when equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _blur(x: np.ndarray, sigma: float = 1.5, radius: int = 5) -> np.ndarray:
    """Separable Gaussian filter over axes 1 and 2 of [N, H, W, C] ('valid' borders)."""
    t = np.arange(-radius, radius + 1)
    k = np.exp(-(t**2) / (2 * sigma**2))
    k /= k.sum()
    for axis in (1, 2):
        x = np.apply_along_axis(lambda v: np.convolve(v, k, mode="valid"), axis, x)
    return x


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM (Wang et al. 2004: Gaussian window sigma 1.5, K1 0.01, K2 0.03) of uint8 [N, H, W, 3],
    per channel, averaged."""
    x, y = a.astype(np.float64) / 255, b.astype(np.float64) / 255
    c1, c2 = 0.01**2, 0.03**2
    mx, my = _blur(x), _blur(y)
    vx, vy = _blur(x * x) - mx * mx, _blur(y * y) - my * my
    cov = _blur(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return float(s.mean())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default=None, help="a model id or folder (default: the embedded tiny SDXL)"
    )
    parser.add_argument("--method", default=None, help="the cache method (default: the model's first)")
    parser.add_argument("--steps", type=int, nargs="+", default=[20, 30, 50])
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3])
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per held-out caption")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument(
        "--call", default="{}", help="more pipeline arguments, as JSON (every call gets them)"
    )
    args = parser.parse_args(argv)
    extra = json.loads(args.call)

    import jax

    from meshserve.models import load_pipeline
    from meshserve.training.clips import held_out_clip_prompts
    from meshserve.training.evaluate import held_out_prompts
    from meshserve.training.motion_score import clip_adherence
    from meshserve.training.shape_score import adherence

    pipe = load_pipeline(args.model)
    methods = list(pipe.limits["cache"] or {})
    method = args.method or (methods[0] if methods else None)
    if method not in methods:
        raise SystemExit(
            f"{args.model or 'the embedded model'} has no step cache {method!r}; it has {methods}"
        )
    video = "frames" in pipe.limits
    prompts, seeds, wanted = (held_out_clip_prompts if video else held_out_prompts)(range(args.seeds))
    score_of = clip_adherence if video else adherence

    def run(steps: int, threshold: float | None):
        cache = None if threshold is None else {"method": method, "threshold": threshold}
        out = pipe(prompts, seed=seeds, num_inference_steps=steps, output_type="uint8", cache=cache, **extra)
        return np.asarray(out.images), out.timings["denoise"], out.cached_steps

    def frames(x):  # clips [N, F, H, W, 3] -> their frames, for PSNR and SSIM
        return x.reshape(-1, *x.shape[-3:])

    rows = []
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')} {platform.processor() or platform.machine()}, jax {jax.__version__}"
    )
    print(
        f"model {args.model or 'embedded tiny-sdxl'}, method {method}, {len(prompts)} "
        f"{'clips' if video else 'pictures'} per call, {extra or 'no other arguments'}"
    )
    for steps in args.steps:
        configs = [None, *args.thresholds]
        images, times, skipped = {}, {c: [] for c in configs}, {}
        for c in configs:  # compile (the cached program once: thresholds are inputs) and keep the pictures
            images[c], _, skipped[c] = run(steps, c)
        for _ in range(args.rounds):  # alternating rounds: each config once per round
            for c in configs:
                times[c].append(run(steps, c)[1])
        base = statistics.median(times[None])
        for c in configs:
            score = score_of(images[c], wanted)
            t = times[c]
            row = {
                "steps": steps,
                "threshold": c,
                "skipped": skipped[c],
                "psnr_db": None if c is None else round(psnr(images[c], images[None]), 1),
                "ssim": None if c is None else round(ssim(frames(images[c]), frames(images[None])), 4),
                "colour": score.colour,
                "shape": score.shape,
                "background": score.background,
                "direction": getattr(score, "direction", None),
                "denoise_s": round(statistics.median(t), 3),
                "spread_s": [round(min(t), 3), round(max(t), 3)],
                "speedup": round(base / statistics.median(t), 2),
            }
            rows.append(row)
            print(json.dumps(row))
    print(
        "\n| steps | threshold | skipped | PSNR dB | SSIM | colour / shape / background (/ direction) | denoise s (spread) | x |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        th = "off" if r["threshold"] is None else r["threshold"]
        q = "-" if r["psnr_db"] is None else r["psnr_db"]
        s = "-" if r["ssim"] is None else r["ssim"]
        adh = f"{r['colour']:.2f} / {r['shape']:.2f} / {r['background']:.2f}"
        if r["direction"] is not None:
            adh += f" / {r['direction']:.2f}"
        spread = f"{r['denoise_s']} ({r['spread_s'][0]}-{r['spread_s'][1]})"
        print(f"| {r['steps']} | {th} | {r['skipped']} | {q} | {s} | {adh} | {spread} | {r['speedup']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

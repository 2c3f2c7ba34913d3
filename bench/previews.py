"""Live previews and the prompt-embedding cache: what previews cost a step, what a cache hit saves (issue 23
§3-4; docs/previews.md has the figures).

    python bench/previews.py [--models tiny-sdxl tiny-flux tiny-wan fixture-sdxl] [--rounds 5] [--steps 20]

Per model, on the pipeline as served (one program whatever `preview_every` is):

- denoise seconds for `--steps` steps with previews off (the cond's branch never taken), every 5 steps and
  every step, in alternating rounds (medians and min-max), and the same program built without the preview
  hook (`no hook`: what the cond itself costs when off); per-step cost = (with - off) / steps, per-preview
  cost = (with - off) / previews made;
- the preview map's fit (seconds, once per load) and encoding one preview to a WebP data URL on the host;
- text_encode seconds per request: no cache, a cache whose rows all miss (prompt and negative new), and a
  cache whose rows all hit (the same request again); the saving on a hit = no cache - all hit.

`fixture-sdxl` is tests/fixtures/tiny_sdxl.py's random SDXL (built with diffusers, so it needs torch). The
script prints the date, the load average before and after, and a Markdown row per model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from meshserve.models.cpu.xla_cpu_flags import apply_cpu_defaults  # noqa: E402

apply_cpu_defaults()

import numpy as np  # noqa: E402

from meshserve.models import load_pipeline  # noqa: E402
from meshserve.models.engine.previews import encode_preview  # noqa: E402
from meshserve.models.engine.prompt_cache import PromptCache  # noqa: E402


def load(name: str):
    if name == "fixture-sdxl":
        from tests.fixtures.tiny_sdxl import build_tiny_sdxl

        return load_pipeline(build_tiny_sdxl(tempfile.mkdtemp(prefix="tiny_sdxl_")))
    return load_pipeline(name)


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} ms ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"


def run(pipe, steps: int, every: int, prompt: str = "a red circle on a blue background", **kw) -> dict:
    cfg = {pipe.cfg_field: 2.0}
    negative = "blurry" if pipe.cfg_needs_negative else None
    out = pipe(
        prompt,
        negative_prompt=negative,
        seed=0,
        num_inference_steps=steps,
        output_type="latent",
        preview_every=every,
        preview_callback=(lambda *a: None) if every else None,
        **cfg,
        **kw,
    )
    return out.timings


def bench_previews(pipe, steps: int, rounds: int) -> dict:
    pipe.previews.prepare()
    modes = {"off": 0, "every 5": 5, "every step": 1}
    for every in modes.values():  # compile (one program) and warm
        run(pipe, steps, every)
    times = {m: [] for m in modes}
    for _ in range(rounds):
        for mode, every in modes.items():
            times[mode].append(run(pipe, steps, every)["denoise"])
    # The same program without the preview hook: a second pipeline object is not needed, the hook is dropped.
    in_loop = pipe.previews.in_loop
    pipe.previews.in_loop = lambda *a, **kw: None
    try:
        run(pipe, steps, 0)
        times["no hook"] = [run(pipe, steps, 0)["denoise"] for _ in range(rounds)]
    finally:
        pipe.previews.in_loop = in_loop
    return times


def bench_encode(pipe, rounds: int) -> tuple[list[float], int, tuple[int, int]]:
    shape = pipe.noise_shape({**pipe.defaults, "num_frames": 1})
    h, w = shape[-3], shape[-2]
    pixels = np.random.default_rng(0).integers(0, 255, (h, w, 3), dtype=np.uint8)
    pixels = np.sort(pixels, axis=1)  # smoother than noise, as previews are
    times, size = [], 0
    for _ in range(rounds):
        t0 = time.perf_counter()
        url = encode_preview(pixels)
        times.append(time.perf_counter() - t0)
        size = len(url)
    return times, size, (h, w)


def bench_prompt_cache(pipe, rounds: int) -> dict:
    times = {"no cache": [], "all miss": [], "all hit": []}
    pipe.prompt_cache = None
    run(pipe, 1, 0)  # compile
    pipe.prompt_cache = PromptCache(256 << 20)
    pipe.prompt_cache.warm_up(
        pipe, {n: pipe.defaults.get(n, pipe.limits.get(n)) for n in pipe.batch_fields}, 4
    )
    run(pipe, 1, 0, prompt="warm")
    negative_kw = {}
    for r in range(rounds):
        pipe.prompt_cache = None
        times["no cache"].append(run(pipe, 1, 0, prompt=f"a prompt {r}")["text_encode"])
        cache = PromptCache(256 << 20)
        pipe.prompt_cache = cache
        times["all miss"].append(run(pipe, 1, 0, prompt=f"a new prompt {r}", **negative_kw)["text_encode"])
        times["all hit"].append(run(pipe, 1, 0, prompt=f"a new prompt {r}", **negative_kw)["text_encode"])
    pipe.prompt_cache = None
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["tiny-sdxl", "tiny-flux", "tiny-wan"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load before", os.getloadavg())
    rows = []
    for name in args.models:
        pipe = load(name)
        steps = args.steps
        t = bench_previews(pipe, steps, args.rounds)
        enc, size, hw = bench_encode(pipe, max(args.rounds, 20))
        pc = bench_prompt_cache(pipe, args.rounds)
        off = statistics.median(t["off"])
        every1 = (statistics.median(t["every step"]) - off) / steps
        every5 = (statistics.median(t["every 5"]) - off) / (steps // 5)
        hook = (off - statistics.median(t["no hook"])) / steps
        saved = statistics.median(pc["no cache"]) - statistics.median(pc["all hit"])
        print(f"\n== {name}: latents {hw}, {steps} steps, fit {pipe.previews.fit_seconds:.2f} s")
        for mode, xs in t.items():
            print(f"  denoise {mode:>10}: {med(xs)}")
        print(f"  encode one preview: {med(enc)}, {size} chars")
        for mode, xs in pc.items():
            print(f"  text_encode {mode:>8}: {med(xs)}")
        rows.append(
            f"| {name} | {hw[0]}x{hw[1]} | {med(t['off'])} | {every1 * 1e3:+.2f} ms | {every5 * 1e3:+.2f} ms | "
            f"{hook * 1e3:+.2f} ms | {pipe.previews.fit_seconds:.2f} s | {med(enc)}, {size / 1024:.1f} KiB | "
            f"{med(pc['no cache'])} | {med(pc['all miss'])} | {med(pc['all hit'])} | {saved * 1e3:.1f} ms |"
        )
    print("\nload after", os.getloadavg())
    print(
        "\n| model | latents | denoise, previews off | + per step, every step | + per preview, every 5 | "
        "hook when off, per step | map fit | encode one | text: no cache | all miss | all hit | saved on a hit |"
    )
    print("|" + "---|" * 12)
    print("\n".join(rows))


if __name__ == "__main__":
    main()

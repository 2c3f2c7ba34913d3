"""Live previews and the prompt-embedding cache: what previews cost a step, what a cache hit saves (issue 23
§3-4; docs/previews.md has the figures).

    python bench/previews.py [--models tiny-sdxl tiny-flux tiny-wan fixture-sdxl] [--rounds 5] [--steps 20]

Per model, on the pipeline as served (one program whatever `preview_every` is):

- denoise seconds for `--steps` steps with previews off (the cond's branch never taken), every 5 steps and
  every step, in alternating rounds (medians and min-max), and the same program built without the preview
  hook (`no hook`: what the cond itself costs when off); per-step cost = (with - off) / steps, per-preview
  cost = (with - off) / previews made, in CPU seconds of the process over whole calls (medians over rounds:
  on a loaded shared machine wall-time differences of a few ms drown in the noise, CPU time far less);
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
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for tests.fixtures
        from tests.fixtures.tiny_sdxl import build_tiny_sdxl

        return load_pipeline(build_tiny_sdxl(tempfile.mkdtemp(prefix="tiny_sdxl_")))
    return load_pipeline(name)


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} ms ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"


def run(pipe, steps: int, every: int, prompt: str = "a red circle on a blue background", **kw) -> dict:
    """The call's stage timings (wall seconds), plus `cpu`: the process's CPU seconds for the whole call (all
    threads), which a loaded machine disturbs far less than wall time."""
    cfg = {pipe.cfg_field: 2.0}
    negative = "blurry" if pipe.cfg_needs_negative else None
    cpu = time.process_time()
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
    return {**out.timings, "cpu": time.process_time() - cpu}


def bench_map(pipe) -> tuple[float, float]:
    """Seconds to fit the map (a fresh decode program each time: its compile, from JAX's persistent cache
    when warm, included) and to read it back from its cache file."""
    t0 = time.perf_counter()
    pipe.previews.fit()
    fit = time.perf_counter() - t0
    pipe.previews.prepare()  # writes the file when missing
    pipe.previews.rgb_map = None
    pipe.previews.prepare()
    assert not pipe.previews.fitted
    return fit, pipe.previews.fit_seconds


def bench_previews(pipe, steps: int, rounds: int) -> tuple[dict, dict]:
    """Alternating rounds of: previews off, every 5 steps, every step (one program), and `no hook`: the denoise
    program built without the preview hook (its own CompiledPrograms, so the two never share a program)."""
    from meshserve.models.engine.programs import CompiledPrograms

    pipe.previews.prepare()
    hooked, bare = pipe.programs, CompiledPrograms("no-hook")
    in_loop = pipe.previews.in_loop

    def call(mode: str, every: int) -> dict:
        no_hook = mode == "no hook"
        pipe.programs = bare if no_hook else hooked
        pipe.previews.in_loop = (lambda *a, **kw: None) if no_hook else in_loop
        try:
            return run(pipe, steps, every)
        finally:
            pipe.programs, pipe.previews.in_loop = hooked, in_loop

    modes = {"off": 0, "every 5": 5, "every step": 1, "no hook": 0}
    for mode, every in modes.items():  # compile and warm
        call(mode, every)
    times = {m: [] for m in modes}
    cpu = {m: [] for m in modes}
    for _ in range(rounds):
        for mode, every in modes.items():
            t = call(mode, every)
            times[mode].append(t["denoise"])
            cpu[mode].append(t["cpu"])
    return times, cpu


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
        fit_s, read_s = bench_map(pipe)
        t, cpu = bench_previews(pipe, steps, args.rounds)
        enc, size, hw = bench_encode(pipe, max(args.rounds, 20))
        pc = bench_prompt_cache(pipe, args.rounds)
        # Differences of minima: on a shared machine the fastest round is the one least disturbed.
        off = statistics.median(cpu["off"])  # CPU seconds of whole calls: medians
        every1 = (statistics.median(cpu["every step"]) - off) / steps
        every5 = (statistics.median(cpu["every 5"]) - off) / (steps // 5)
        hook = (off - statistics.median(cpu["no hook"])) / steps
        saved = min(pc["no cache"]) - min(pc["all hit"])
        print(f"\n== {name}: latents {hw}, {steps} steps, map fit {fit_s:.2f} s, read {read_s * 1e3:.1f} ms")
        for mode, xs in t.items():
            print(f"  denoise {mode:>10}: wall {med(xs)}, whole call CPU {med(cpu[mode])}")
        print(f"  encode one preview: {med(enc)}, {size} chars")
        for mode, xs in pc.items():
            print(f"  text_encode {mode:>8}: {med(xs)}")
        rows.append(
            f"| {name} | {hw[0]}x{hw[1]} | {med(t['off'])} | {every1 * 1e3:+.2f} ms | {every5 * 1e3:+.2f} ms | "
            f"{hook * 1e3:+.2f} ms | {fit_s:.2f} s / {read_s * 1e3:.1f} ms | {med(enc)}, {size / 1024:.1f} KiB | "
            f"{med(pc['no cache'])} | {med(pc['all miss'])} | {med(pc['all hit'])} | {saved * 1e3:.1f} ms |"
        )
    print("\nload after", os.getloadavg())
    print(
        "\n| model | latents | denoise wall, previews off | CPU + per step, every step | CPU + per preview, every 5 | "
        "CPU of the hook when off, per step | map fit / read | encode one | text: no cache | all miss | all hit | saved on a hit |"
    )
    print("|" + "---|" * 12)
    print("\n".join(rows))


if __name__ == "__main__":
    main()

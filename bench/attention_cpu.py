"""The attention core alone on the CPU: cpu_fused, xla_chunked and xla_blockwise against torch's
scaled_dot_product_attention, at the shapes the CPU benches' models call it with.

    python bench/attention_cpu.py --rounds 3 --threads 2

Each kernel runs in its own process (XLA's thread pool and torch's threads otherwise compete), pinned to the
same `--threads` CPUs, the processes alternating for `--rounds` rounds; a call is timed as the median of
`--calls` calls after a warm-up, on [B, S, H, D] float32 inputs (torch's with diffusers' transposes to
[B, H, S, D] and back, as diffusers' attention processors do). Printed: the date, CPU and load, then per shape
each kernel's median over rounds (min-max) and cpu_fused's speed-up over each other, the median of the
per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import compare_harness as harness  # noqa: E402

# (name, B, Sq, Sk, H, D): the models of bench/README.md's CPU rows.
SHAPES = [
    ("flux 512x512 joint, true CFG", 2, 1152, 1152, 4, 64),
    ("sdxl w64 256px level 2 self", 2, 256, 256, 2, 64),
    ("sdxl w64 256px level 2 cross", 2, 256, 77, 2, 64),
    ("sdxl w64 256px level 3 self", 2, 64, 64, 4, 64),
    ("wan 320x256x9 self, CFG", 2, 960, 960, 2, 128),
    ("wan 320x256x9 cross, CFG", 2, 960, 512, 2, 128),
    ("sdxl vae 256px mid block", 1, 1024, 1024, 1, 512),
]
KERNELS = ("cpu_fused", "xla_chunked", "xla_blockwise", "torch_sdpa")


def _inputs(b, sq, sk, h, d):
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(np.float32) for s in ((b, sq, h, d), (b, sk, h, d), (b, sk, h, d))]


def run_kernel(kernel: str, calls: int) -> dict[str, float]:
    """Seconds per call (median of `calls`) for every shape, in this process."""
    times = {}
    for name, b, sq, sk, h, d in SHAPES:
        arrays = _inputs(b, sq, sk, h, d)
        if kernel == "torch_sdpa":
            import torch

            q, k, v = (torch.from_numpy(x) for x in arrays)

            def call(q=q, k=k, v=v):
                with torch.no_grad():
                    out = torch.nn.functional.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                    )
                    return out.transpose(1, 2).contiguous()

        else:
            import jax

            from meshserve.models.attention.blockwise import xla_blockwise
            from meshserve.models.attention.chunked import chunk_rows, xla_chunked
            from meshserve.models.cpu.fused_attention import cpu_fused_attention

            if kernel == "xla_chunked" and chunk_rows(h, sq, sk) is None:
                continue
            fn = {
                "cpu_fused": cpu_fused_attention,
                "xla_chunked": xla_chunked,
                "xla_blockwise": xla_blockwise,
            }
            jitted = jax.jit(fn[kernel])
            q, k, v = (jax.device_put(x) for x in arrays)

            def call(q=q, k=k, v=v, jitted=jitted):
                return jitted(q, k, v).block_until_ready()

        call()
        times[name] = harness.median_time(call, calls)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--kernel", choices=KERNELS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.kernel:
        harness._pin(args.threads)
        if args.kernel == "torch_sdpa":
            import torch

            torch.set_num_threads(args.threads)
        else:
            from meshserve.models.cpu.xla_cpu_flags import apply_cpu_defaults

            apply_cpu_defaults()
        print(json.dumps(run_kernel(args.kernel, args.calls)))
        return

    load_before = os.getloadavg()[0]
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {harness.cpu_name()}, {args.threads} threads"
    )
    rounds: dict[str, list[dict[str, float]]] = {k: [] for k in KERNELS}
    for r in range(args.rounds):
        order = KERNELS if r % 2 == 0 else tuple(reversed(KERNELS))
        for kernel in order:
            command = [sys.executable, __file__, "--kernel", kernel, "--threads", str(args.threads)]
            command += ["--calls", str(args.calls)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            rounds[kernel].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(
        f"load average before {load_before:.2f}, after {os.getloadavg()[0]:.2f}; ms per call, median (min-max)"
    )
    print("| shape [B, Sq, Sk, H x D] | " + " | ".join(KERNELS) + " | cpu_fused speed-up over each |")
    print("|---" * (len(KERNELS) + 2) + "|")
    for name, b, sq, sk, h, d in SHAPES:
        cells, ratios = [], []
        for kernel in KERNELS:
            values = [t[name] * 1e3 for t in rounds[kernel] if name in t]
            cells.append(
                f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})" if values else "n/a"
            )
            if kernel != "cpu_fused" and values:
                per_round = [
                    t[name] / f[name] for t, f in zip(rounds[kernel], rounds["cpu_fused"], strict=True)
                ]
                ratios.append(f"{kernel} {statistics.median(per_round):.2f}x")
        print(
            f"| {name} [{b}, {sq}, {sk}, {h} x {d}] | " + " | ".join(cells) + " | " + ", ".join(ratios) + " |"
        )


if __name__ == "__main__":
    main()

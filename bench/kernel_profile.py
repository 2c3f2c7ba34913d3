"""Where a call's device time goes, by kernel: meshserve's side from JAX's profiler, diffusers' from torch's.

    from bench.kernel_profile import jax_kernels, torch_kernels, report
    ours = jax_kernels(lambda: step(*inputs), calls=3)
    theirs = torch_kernels(lambda: ref(...), calls=3)
    print(report({"meshserve": ours, "diffusers torch.compile": theirs}))

Used by `bench/gpu_vs_diffusers.py --profile N` (issue 24: the time's breakdown comes from the profiler, not from
guesses). Each side runs `calls` times under its profiler after the timed rounds; every device kernel's time is
summed by name and divided by `calls`, and each name is put in a category by what it is called (matmul,
attention, convolution, copy, fusion, other): cuBLAS / cuDNN / Triton / XLA kernel names are what the GPU
reports. JAX's side also keeps each kernel's HLO op where the profiler records it (`hlo_op`), which says which
instruction of the program launched it.

On a GPU the kernels are the events of the `/device:GPU:N` planes (JAX) and the CUDA events of torch's
profiler; on the CPU (a check that the module runs), the events of XLA's CPU threads and torch's CPU ops, whose
times overlap and compare nothing.
"""

from __future__ import annotations

import glob
import re
import tempfile
from collections import defaultdict

CATEGORIES = (
    ("attention", re.compile(r"fmha|sdpa|flash|attention|attn", re.I)),
    ("convolution", re.compile(r"conv(?!ert)|implicit_gemm|winograd|fprop|dgrad", re.I)),
    ("matmul", re.compile(r"gemm|matmul|cublas|nvjet|xmma|cutlass|wgmma|dot|mm_|addmm|_mm\b", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|transpose", re.I)),
    ("fusion", re.compile(r"fusion|triton|elementwise|reduce|norm|vectorized|unrolled", re.I)),
)


def category(name: str) -> str:
    """The first category whose pattern the kernel name matches (attention and convolution before matmul: a
    flash kernel's or an implicit-GEMM convolution's name often holds "gemm"), else "other"."""
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


def jax_kernels(fn, calls: int = 3) -> dict:
    """{"per_call_ms": total, "kernels": {name: {"ms": per call, "count": per call, "hlo_op": ...}}} of `calls`
    calls of fn (its output blocked on) under jax.profiler."""
    import jax
    from jax.profiler import ProfileData

    jax.block_until_ready(fn())  # nothing compiles inside the trace
    folder = tempfile.mkdtemp(prefix="meshserve-profile-")
    jax.profiler.start_trace(folder)
    try:
        for _ in range(calls):
            jax.block_until_ready(fn())
    finally:
        jax.profiler.stop_trace()
    (path,) = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
    data = ProfileData.from_file(path)
    planes = [p for p in data.planes if p.name.startswith("/device:GPU")]
    if planes:  # the kernels are on the stream lines; other lines (if any) derive from them
        lines = [line for p in planes for line in p.lines]
        streams = [line for line in lines if line.name.startswith("Stream")] or lines
        events = [e for line in streams for e in line.events]
    else:  # the CPU: XLA's own threads, not Python's, without the executor's spans around the kernels
        events = [
            e
            for p in data.planes
            if p.name == "/host:CPU"
            for line in p.lines
            if line.name.startswith("tf_XLA")
            for e in line.events
            if not e.name.startswith(("Threadpool", "ThunkExecutor"))
        ]
    kernels: dict = defaultdict(lambda: {"ms": 0.0, "count": 0, "hlo_op": ""})
    for event in events:
        entry = kernels[event.name]
        entry["ms"] += event.duration_ns / 1e6 / calls
        entry["count"] += 1
        if not entry["hlo_op"]:
            entry["hlo_op"] = next((str(v) for k, v in event.stats if k == "hlo_op"), "")
    for entry in kernels.values():
        entry["count"] /= calls
    return {"per_call_ms": sum(k["ms"] for k in kernels.values()), "kernels": dict(kernels)}


def torch_kernels(fn, calls: int = 3) -> dict:
    """The same for a torch callable: torch.profiler's device kernels (CUDA), or its CPU ops without a GPU."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    fn()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    kernels: dict = {}
    for event in prof.events():
        on_device = str(getattr(event, "device_type", "")).endswith("CUDA")
        if cuda != on_device:
            continue
        us = event.time_range.elapsed_us() if cuda else event.self_cpu_time_total  # a kernel's own span
        entry = kernels.setdefault(event.name, {"ms": 0.0, "count": 0, "hlo_op": ""})
        entry["ms"] += us / 1e3 / calls
        entry["count"] += 1
    for entry in kernels.values():
        entry["count"] /= calls
    return {"per_call_ms": sum(k["ms"] for k in kernels.values()), "kernels": kernels}


def by_category(profile: dict) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for name, entry in profile["kernels"].items():
        out[category(name)] += entry["ms"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def report(profiles: dict[str, dict], top: int = 12) -> str:
    """Markdown: per side, the device time per call by category, then its `top` kernels."""
    lines = []
    for side, profile in profiles.items():
        total = profile["per_call_ms"] or 1e-30
        cats = ", ".join(f"{k} {v:.2f} ms ({100 * v / total:.0f} %)" for k, v in by_category(profile).items())
        lines.append(f"**{side}**: {profile['per_call_ms']:.2f} ms of kernels per call: {cats}")
        lines.append("")
        lines.append("| kernel | category | ms per call | share | launches per call | HLO op |")
        lines.append("|---|---|---|---|---|---|")
        ranked = sorted(profile["kernels"].items(), key=lambda kv: -kv[1]["ms"])[:top]
        for name, entry in ranked:
            short = name if len(name) <= 90 else name[:87] + "..."
            lines.append(
                f"| `{short}` | {category(name)} | {entry['ms']:.3f} | {100 * entry['ms'] / total:.1f} % "
                f"| {entry['count']:g} | {entry['hlo_op'][:40]} |"
            )
        lines.append("")
    return "\n".join(lines)

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
instruction of the program launched it. Inside XLA:GPU's command buffers that op is the buffer
(`command_buffer_1`), so `describe(hlo_text)` reads the compiled program's own text instead: a kernel named after
a fusion (`loop_dynamic_slice_fusion_9`, XLA's `loop_dynamic_slice_fusion.9`) gets its result shape, the ops
fused into it and the lines of the project's code it was traced from (`annotate`).

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
    if not events and jax.devices()[0].platform == "gpu":
        # Seen on the H200 (2026-11-27): after torch.profiler has run in the process, JAX's CUPTI subscription
        # fails (CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED) and the trace holds no kernels.
        raise RuntimeError(
            "jax.profiler recorded no GPU kernel: CUPTI is held by another subscriber (torch.profiler, once it has"
            " run in this process); profile one measure per process"
        )
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


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+(?: \S+)*?) ([\w\-]+)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_SKIP_OPS = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple"}


def describe(hlo_text: str, ours: tuple[str, ...] = ("/models/", "/bench/")) -> dict[str, str]:
    """{instruction name: "result shape: fused ops @ file:line function"} of every instruction of an optimized
    HLO module's text (`compiled.as_text()`) that calls a computation (fusions): the opcodes inside it, and of the
    stack it was traced from the innermost two functions in files whose paths hold one of `ours`."""
    files, functions, locations, frames = {}, {}, {}, {}
    section = None  # the module text's tables before its computations, each ended by an empty line
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if not line.strip():
            section = None
        if section is None:
            continue
        key, _, rest = line.partition(" ")
        fields = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", rest)}
        if section == "FileNames":
            files[int(key)] = rest.strip('"')
        elif section == "FunctionNames":
            functions[int(key)] = rest.strip('"')
        elif section == "FileLocations":
            locations[int(key)] = fields
        else:
            frames[int(key)] = (fields.get("file_location_id", 0), fields.get("parent_frame_id", 0))

    def source(frame_id: int, depth: int = 2) -> str:
        """The innermost `depth` functions in our files, innermost first ("layers.py:201 Linear.__call__ <
        transformer_flux.py:286 GELU.__call__")."""
        found: list[str] = []
        seen, functions_found = set(), set()
        while frame_id in frames and frame_id not in seen and len(found) < depth:
            seen.add(frame_id)
            location_id, parent = frames[frame_id]
            location = locations.get(location_id, {})
            path = files.get(location.get("file_name_id", 0), "")
            name = functions.get(location.get("function_name_id", 0), "")
            if any(part in path for part in ours) and name not in functions_found:
                functions_found.add(name)  # a caller, not another line of the same function
                found.append(f"{path.rsplit('/', 1)[-1]}:{location.get('line', '?')} {name}")
            frame_id = parent
        return " < ".join(found)

    bodies: dict[str, list[str]] = defaultdict(list)
    callers: list[tuple[str, str, str, int]] = []  # name, shape, called computation, stack frame
    computation = None
    for line in hlo_text.splitlines():
        if match := _COMPUTATION.match(line):
            computation = match.group(1)
            continue
        match = _INSTRUCTION.match(line)
        if not match or computation is None:
            continue
        name, shape, opcode, rest = match.groups()
        if opcode not in _SKIP_OPS:
            bodies[computation].append(opcode)
        if called := re.search(r"\bcalls=%([\w.\-]+)", rest):
            frame = re.search(r"stack_frame_id=(\d+)", rest)
            layoutless = re.sub(r"\{[^}]*\}", "", shape)
            callers.append((name, layoutless, called.group(1), int(frame.group(1)) if frame else 0))
    out = {}
    for name, shape, called, frame in callers:
        ops = list(dict.fromkeys(bodies.get(called, [])))
        fused = ", ".join(ops[:5]) + (", ..." if len(ops) > 5 else "")
        where = source(frame)
        out[name] = f"{shape}: {fused}" + (f" @ {where}" if where else "")
    return out


def hlo_name(kernel: str) -> str:
    """XLA:GPU names a fusion's kernel after the instruction with its "." made "_": `loop_convert_fusion_4` is
    `loop_convert_fusion.4`; the CPU keeps the instruction's name."""
    return re.sub(r"_(\d+)$", r".\1", kernel)


def by_category(profile: dict) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for name, entry in profile["kernels"].items():
        out[category(name)] += entry["ms"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def annotate(profile: dict, hlo_text: str) -> dict:
    """The profile with "what" (`describe`) set on each kernel named after an instruction of the program."""
    described = describe(hlo_text)
    for name, entry in profile["kernels"].items():
        if what := described.get(name) or described.get(hlo_name(name)):
            entry["what"] = what
    return profile


def report(profiles: dict[str, dict], top: int = 12) -> str:
    """Markdown: per side, the device time per call by category, then its `top` kernels, and what those that
    `annotate` found in the program compute."""
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
        if found := [(name, entry["what"]) for name, entry in ranked if entry.get("what")]:
            lines.append("")
            lines.extend(f"- `{name}`: {what}" for name, what in found)
        lines.append("")
    return "\n".join(lines)

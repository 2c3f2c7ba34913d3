"""What the compiled-program memory benchmarks share. bench/flux_memory.py and bench/wan_memory.py: a
layout's placement and its text, the bytes per device of a placed abstract state, abstract batch arguments,
the "fits on a device of N GB" rule, the scheduler's name. Those two and bench/weight_memory.py,
bench/attention_memory.py, bench/denoise_comm.py: XLA:CPU set up with 8 host devices (and its scheduler), and
writing the generated section of a docs page.

`host_cpu_devices` sets environment variables JAX reads when it is imported and when it starts its CPU
backend, so it must run before anything imports JAX; hence JAX is imported inside the functions here, not at
the top of this module.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

GB = 1e9
DEVICE_GB = (16, 24, 40, 80)
# Headroom assumed free of our programs on a GPU: the CUDA context, cuDNN/cuBLAS workspaces and XLA's
# allocator fragmentation. 10 % of the device plus 1 GB is a common rule of thumb (XLA's GPU client itself
# preallocates 75 % by default; a pool runs with XLA_PYTHON_CLIENT_MEM_FRACTION raised), not measured here.
HEADROOM = (0.10, 1.0)


def host_cpu_devices(memory_minimizing: bool) -> None:
    """8 XLA:CPU host devices, CPU only; memory_minimizing: XLA:CPU's memory-minimizing scheduler instead of
    its default concurrency-optimized one. XLA:CPU reads that from XLA_FLAGS only (bench/weight_memory.py:
    per-compilation options changed nothing), so it is set here, before JAX starts."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    if memory_minimizing:
        os.environ["XLA_FLAGS"] += " --xla_cpu_enable_concurrency_optimized_scheduler=false"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


# Compiler options of the programs compiled as an accelerator's stand-in: without XLA's while-loop invariant code
# motion. XLA:CPU has no bf16 dynamic slice, so in a loop over stacked bf16 blocks (models/components/
# block_stack.py) it slices an f32 copy of the whole stack, and that pass hoists the copy out of the loop: every
# block's weights in f32 at once (T5-XXL's encode: 17 GB of temporaries scanned, 280 MiB unrolled;
# bench/compile_time.py). An accelerator slices and multiplies bf16 itself. (A per-compilation option works for
# this pass, unlike the scheduler flag above.)
ACCELERATOR_LIKE = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def scheduler_name(default_scheduler: bool) -> str:
    return "default (concurrency-optimized)" if default_scheduler else "memory-minimizing"


def layout_placement(sizes: dict, shard_over) -> tuple:
    """(Placement, AttentionSettings) of a pool on the first N devices: mesh `sizes` (axis -> size), the
    weights split over the `shard_over` axes (the pool's `weights: {shard_over: [...]}`)."""
    from meshserve.models.parallel.placement import pipeline_placement

    n = math.prod(sizes.values()) if sizes else 1
    weights = {"shard_over": list(shard_over)} if shard_over else None
    out = pipeline_placement(sizes, list(range(n)), weights=weights)
    return out["placement"], out["attention"]


def layout_text(sizes: dict, shard_over) -> str:
    mesh = " x ".join(f"{a}{n}" for a, n in sizes.items()) or "1 device"
    return mesh + (f", shard_over [{', '.join(shard_over)}]" if shard_over else "")


def state_bytes(state) -> tuple[int, int]:
    """(parameters, bytes per device) of a placed abstract state."""
    import jax
    import jax.numpy as jnp

    count = per_device = 0
    for leaf in jax.tree.leaves(state):
        count += math.prod(leaf.shape)
        per_device += math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
    return count, per_device


def batch_arg(placement, shape, dtype):
    """An abstract argument whose leading (batch) axis is placed as the pipeline places its batch."""
    import jax

    return jax.ShapeDtypeStruct(shape, dtype, sharding=placement.batch_spec(shape[0], len(shape)))


def fits(total_bytes: float) -> str:
    """The device sizes of DEVICE_GB a per-device peak fits, HEADROOM kept free."""
    ok = [f"{g}" for g in DEVICE_GB if total_bytes <= g * GB * (1 - HEADROOM[0]) - HEADROOM[1] * GB]
    return ", ".join(ok) + " GB" if ok else "none"


def fits_rule() -> str:
    fraction, fixed = HEADROOM
    return (
        f"Fits: peak <= {100 - 100 * fraction:.0f} % of the device minus {fixed:.0f} GB (headroom assumed "
        "for the runtime, not measured)."
    )


def write_docs_section(docs: Path, start: str, end: str, text: str) -> None:
    """Replaces what stands between the `start` and `end` marker lines of `docs` with `text`."""
    page = docs.read_text()
    if start not in page:
        raise SystemExit(f"{docs} has no {start} marker")
    before, rest = page.split(start, 1)
    docs.write_text(before + start + "\n" + text + "\n" + end + rest.split(end, 1)[1])

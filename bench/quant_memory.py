"""Per-device weight bytes of FLUX.1-dev's and Wan2.1-T2V-14B's transformers: bf16, int8 and fp8 (`quantize:`).

    python bench/quant_memory.py                # the weights at rest (abstract shapes, nothing compiled)
    python bench/quant_memory.py --compiled     # and the denoise programs compiled at the real shapes

Nothing is allocated: each transformer is built shapes-only (bench/flux_memory.py's and bench/wan_memory.py's
configs, blocks stacked as a pipeline holds them) and every parameter becomes a ShapeDtypeStruct with the
NamedSharding `Placement.param_spec` gives the real weight, quantized as models/components/quantize.py loads
it (bench/weight_memory.py's placed_state): each layers.Linear's kernel int8 or e4m3 under its own rule, plus
an fp32 scale per output channel under `quantized_rules`; everything else (norms, biases, Wan's patch
embedding, the modulation tables) stays bf16 (Wan's fp32 keep-list is ignored here: a few MB). Bytes per
device are the largest shard's (`state_bytes`).

`--compiled` compiles each model's denoise loop (bench/flux_memory.py's and bench/wan_memory.py's
lower_denoise: FLUX.1-dev at 1024x1024 without CFG, Wan 14B at 480p, 81 frames, CFG) for XLA:CPU as an
accelerator's stand-in (ACCELERATOR_LIKE) and reads its memory analysis: the arguments (the weights as the
program takes them, plus its inputs) and the temporaries, per device. fp8 with activations compiles the
"fp8-upcast" form (this CPU has no fp8 dot; a GPU's "fp8" program takes the same arguments, and its dot
reads the e4m3 operands as they are instead of converted copies).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.memory_analysis import host_cpu_devices  # noqa: E402

host_cpu_devices(memory_minimizing=True)  # before JAX is imported

import argparse  # noqa: E402
import datetime  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from bench import flux_memory, wan_memory  # noqa: E402
from bench.attention_memory import MIB, memory_parts  # noqa: E402
from bench.memory_analysis import ACCELERATOR_LIKE, layout_placement, layout_text, state_bytes  # noqa: E402
from bench.weight_memory import placed_state  # noqa: E402
from meshserve.models.components.layers import Linear  # noqa: E402
from meshserve.models.flux.transformer_flux import SHARDING_RULES as FLUX_RULES  # noqa: E402
from meshserve.models.wan.transformer_wan import SHARDING_RULES as WAN_RULES  # noqa: E402

# name -> (mesh sizes, shard_over)
LAYOUTS = {
    "1": ({}, ()),
    "tensor8": ({"tensor": 8}, ()),
    "context8-fsdp": ({"context": 8}, ("context",)),
}
# (label, quantize, activations) of each column
MODES = (
    ("bf16", None, None),
    ("int8", "int8", None),
    ("fp8", "fp8", None),
    ("fp8 + activations", "fp8", "fp8-upcast"),
)


def flux(settings):
    return flux_memory.flux_module(flux_memory.UNITS, settings)


def wan(settings):
    return wan_memory.wan_module(wan_memory.WAN_14B, wan_memory.WAN_14B["num_layers"], settings)


MODELS = {
    "FLUX.1-dev transformer": (flux, FLUX_RULES),
    "Wan2.1-T2V-14B transformer": (wan, WAN_RULES),
}


def compile_denoise(name: str, placement, settings, quantize, activations):
    if name.startswith("FLUX"):
        lowered = flux_memory.lower_denoise(
            flux_memory.UNITS, placement, settings, 1, quantize=quantize, activations=activations
        )
    else:
        _, _, latent = wan_memory.video_size("480p", wan_memory.WAN_14B)
        layers = wan_memory.WAN_14B["num_layers"]
        lowered = wan_memory.lower_denoise(
            wan_memory.WAN_14B,
            layers,
            placement,
            settings,
            latent,
            quantize=quantize,
            activations=activations,
        )
    return lowered.compile(compiler_options=ACCELERATOR_LIKE)


def at_rest_table(layouts) -> list[str]:
    rows = [
        "| model | layout | parameters | Linear share | "
        + " | ".join(f"{label} MiB/device" for label, _, a in MODES if not a)
        + " | int8 or fp8 / bf16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, (factory, rules) in MODELS.items():
        for layout in layouts:
            sizes, shard_over = LAYOUTS[layout]
            placement, settings = layout_placement(sizes, shard_over)
            module = factory(settings)
            linear = sum(n.kernel.size for _, n in nnx.iter_graph(module) if isinstance(n, Linear))
            count, cells = 0, []
            for _, quantize, activations in MODES:
                if activations:
                    continue  # the same bytes as fp8's
                state = placed_state(factory(settings), rules, placement, jnp.bfloat16, quantize)[1]
                parameters, nbytes = state_bytes(state)
                count = count or parameters  # bf16's: the model's own parameters, without the scales
                cells.append(nbytes)
            rows.append(
                f"| {name} | {layout_text(sizes, shard_over)} | {count:,} | {100 * linear / count:.2f} % | "
                + " | ".join(f"{b / MIB:,.1f}" for b in cells)
                + f" | {cells[1] / cells[0]:.3f} |"
            )
    return rows


def compiled_table(layouts) -> list[str]:
    rows = [
        "| model | layout | quantize | arguments MiB/device | temporaries MiB/device | compile s |",
        "|---|---|---|---|---|---|",
    ]
    for name in MODELS:
        for layout in layouts:
            sizes, shard_over = LAYOUTS[layout]
            placement, settings = layout_placement(sizes, shard_over)
            for label, quantize, activations in MODES:
                t0 = time.perf_counter()
                parts = memory_parts(compile_denoise(name, placement, settings, quantize, activations))
                seconds = time.perf_counter() - t0
                rows.append(
                    f"| {name} | {layout_text(sizes, shard_over)} | {label} | {parts['arguments'] / MIB:,.1f} | "
                    f"{parts['temporaries'] / MIB:,.1f} | {seconds:.0f} |"
                )
                print(rows[-1], file=sys.stderr, flush=True)  # noqa: T201 - progress
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--compiled", action="store_true", help="also compile the denoise programs")
    parser.add_argument("--compiled-layouts", default="tensor8,context8-fsdp")
    args = parser.parse_args()
    print(  # noqa: T201
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, jax {jax.__version__}, "
        f"{len(jax.devices())} host CPU devices\n"
    )
    print("\n".join(at_rest_table(args.layouts.split(","))))  # noqa: T201
    if args.compiled:
        print()  # noqa: T201
        print("\n".join(compiled_table(args.compiled_layouts.split(","))))  # noqa: T201


if __name__ == "__main__":
    main()

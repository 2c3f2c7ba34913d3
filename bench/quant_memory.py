"""Per-device weight bytes of FLUX.1-dev's and Wan2.1-T2V-14B's transformers, bf16 against int8 (quantize: int8).

    python bench/quant_memory.py                # the table (abstract shapes, nothing compiled)

Nothing is allocated: each transformer is built shapes-only (bench/flux_memory.py's and bench/wan_memory.py's
configs) and every parameter becomes a ShapeDtypeStruct with the NamedSharding `Placement.param_spec` gives
the real weight. int8 as models/components/quantize.py loads it: each layers.Linear's 2-D kernel int8 under
its own rule, plus an fp32 scale per output channel under `quantized_rules`; everything else (norms, biases,
Wan's patch embedding, the modulation tables) stays bf16 (Wan's fp32 keep-list is ignored here: a few MB).
Bytes per device are the largest shard's (`state_bytes`, as bench/flux_memory.py and bench/wan_memory.py
report the weights at rest; their compiled programs' argument bytes equal it plus the inputs).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.memory_analysis import host_cpu_devices  # noqa: E402

host_cpu_devices(memory_minimizing=True)  # before JAX is imported

import argparse  # noqa: E402
import datetime  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from bench.flux_memory import FLUX_DEV  # noqa: E402
from bench.memory_analysis import layout_placement, layout_text, state_bytes  # noqa: E402
from bench.wan_memory import WAN_14B  # noqa: E402
from meshserve.models.checkpoints.loading import abstract_module, torch_key  # noqa: E402
from meshserve.models.components.layers import Linear  # noqa: E402
from meshserve.models.components.quantize import quantized_rules  # noqa: E402
from meshserve.models.flux.transformer_flux import SHARDING_RULES as FLUX_RULES  # noqa: E402
from meshserve.models.flux.transformer_flux import FluxTransformer2DConfig, FluxTransformer2DModel  # noqa: E402
from meshserve.models.wan.transformer_wan import SHARDING_RULES as WAN_RULES  # noqa: E402
from meshserve.models.wan.transformer_wan import WanTransformer3DConfig, WanTransformer3DModel  # noqa: E402

MIB = 2**20
# name -> (mesh sizes, shard_over)
LAYOUTS = {
    "1": ({}, ()),
    "tensor8": ({"tensor": 8}, ()),
    "context8-fsdp": ({"context": 8}, ("context",)),
}


def flux_module(settings):
    cfg = FluxTransformer2DConfig(**FLUX_DEV)
    return abstract_module(
        lambda r: FluxTransformer2DModel(cfg, settings=settings, dtype=jnp.bfloat16, rngs=r)
    )


def wan_module(settings):
    cfg = WanTransformer3DConfig(**WAN_14B)
    return abstract_module(
        lambda r: WanTransformer3DModel(cfg, settings=settings, dtype=jnp.bfloat16, rngs=r)
    )


MODELS = {
    "FLUX.1-dev transformer": (flux_module, FLUX_RULES),
    "Wan2.1-T2V-14B transformer": (wan_module, WAN_RULES),
}


def placed(module, rules, placement, int8: bool):
    """(graph, abstract state): bf16 parameters, or int8 Linear kernels + fp32 scales, each with its sharding."""
    if int8:
        rules = quantized_rules(rules)
        for _, node in nnx.iter_graph(module):
            if isinstance(node, Linear):
                node.kernel_scale = nnx.Param(jax.ShapeDtypeStruct((node.kernel.shape[1],), jnp.float32))
    linear_kernels = {
        (*path, "kernel") for path, node in nnx.iter_graph(module) if isinstance(node, Linear) and int8
    }
    graph, state = nnx.split(module)
    flat = []
    for path, var in state.flat_state():
        value = var.get_value()
        if tuple(path) in linear_kernels:
            dtype = jnp.int8
        elif jnp.issubdtype(value.dtype, jnp.floating) and path[-1] != "kernel_scale":
            dtype = jnp.bfloat16
        else:
            dtype = value.dtype
        spec = placement.param_spec(rules, torch_key(path), value.shape)
        flat.append(
            (
                path,
                var.replace(
                    jax.ShapeDtypeStruct(value.shape, dtype, sharding=NamedSharding(placement.mesh, spec))
                ),
            )
        )
    return graph, nnx.State.from_flat_path(flat)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    print(
        f"{datetime.date.today()}, jax {jax.__version__}, {len(jax.devices())} host CPU devices (abstract shapes)\n"
    )  # noqa: T201
    print("| model | layout | parameters | Linear share | bf16 MiB/device | int8 MiB/device | int8 / bf16 |")  # noqa: T201
    print("|---|---|---|---|---|---|---|")  # noqa: T201
    for name, (factory, rules) in MODELS.items():
        for layout in args.layouts.split(","):
            sizes, shard_over = LAYOUTS[layout]
            placement, settings = layout_placement(sizes, shard_over)
            count, bf16 = state_bytes(placed(factory(settings), rules, placement, False)[1])
            module = factory(settings)
            linear = sum(n.kernel.size for _, n in nnx.iter_graph(module) if isinstance(n, Linear))
            _, int8 = state_bytes(placed(module, rules, placement, True)[1])
            print(  # noqa: T201
                f"| {name} | {layout_text(sizes, shard_over)} | {count:,} | {100 * linear / count:.1f} % | "
                f"{bf16 / MIB:,.1f} | {int8 / MIB:,.1f} | {int8 / bf16:.3f} |"
            )


if __name__ == "__main__":
    main()

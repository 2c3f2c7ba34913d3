"""Weights sharded over `data` (FSDP, `weights: {shard_over: [data]}`): bytes per device and what the gathers cost.

    python bench/weight_memory.py                       # SDXL-base shapes, prints the tables (no weights needed)
    python bench/weight_memory.py --ways 1,2 --latent 32  # quicker
    python bench/weight_memory.py --write-docs          # and replaces the generated part of docs/weights.md

Nothing here needs a checkpoint or runs a model: the modules are built shapes-only (models.loading.
abstract_module) from SDXL-base's configs (the UNet's and the VAE's are the ones tests/models check key by key
against diffusers; the two CLIP configs are transformers' CLIP ViT-L/14 and OpenCLIP bigG text towers).

1. Weight bytes per device: each parameter's NamedSharding from `Placement.param_spec` (the same call that
   places real weights), its shard shape times its dtype, summed, on a `data`-way mesh with shard_over [data].
2. The gathers' cost: the SDXL-base UNet in a `lax.while_loop` of unknown trip count (as the pipeline's denoise
   loop: a host callback may stop it), one CFG UNet pass per iteration on `data` requests (2 x data UNet rows,
   the batch split over data), lowered with ShapeDtypeStruct arguments carrying the weights' shardings and
   compiled; never run. From the compiled program: memory_analysis() (arguments = weights + inputs per device,
   temporaries) and, from its HLO, the all-gathers inside the loop body (= one denoise step), read with
   bench/attention_memory.py's HLO reader through bench/denoise_comm.py's per-step filter. Variants:
   "hoisted" (the loop body constrains every weight to its tensor-only sharding, Placement.gather_weights:
   loop-invariant, so XLA gathers before the loop), "per step" (what the pipeline compiles now:
   Placement.gather_weights_per_step ties the weights to the step's input first) and, on request, "as placed"
   (no constraint: XLA's partitioner free to choose how to use a split weight).

    python bench/weight_memory.py --ways 1,2,4 --memory-scheduler   # XLA:CPU's memory-minimizing scheduler
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.memory_analysis import host_cpu_devices, write_docs_section  # noqa: E402

# XLA:CPU reads its scheduler from XLA_FLAGS only: passed per compilation (compiler_options) it changed
# nothing here.
host_cpu_devices(memory_minimizing="--memory-scheduler" in sys.argv)  # before JAX is imported

import argparse  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from bench.attention_memory import COLLECTIVES, MIB, collectives, memory_parts  # noqa: E402
from bench.denoise_comm import per_step  # noqa: E402
from meshserve.models.checkpoints.loading import abstract_module, torch_key  # noqa: E402
from meshserve.models.components.autoencoder_kl import SHARDING_RULES as VAE_RULES  # noqa: E402
from meshserve.models.components.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig  # noqa: E402
from meshserve.models.components.clip import SHARDING_RULES as CLIP_RULES  # noqa: E402
from meshserve.models.components.clip import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection  # noqa: E402
from meshserve.models.components.layers import Linear  # noqa: E402
from meshserve.models.components.quantize import ACTIVATIONS, FP8, SCALE, TRANSPOSED, quantized_rules  # noqa: E402
from meshserve.models.parallel.placement import pipeline_placement  # noqa: E402
from meshserve.models.sdxl.unet_2d_condition import SHARDING_RULES as UNET_RULES  # noqa: E402
from meshserve.models.sdxl.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "weights.md"
START, END = "<!-- bench/weight_memory.py: start -->", "<!-- bench/weight_memory.py: end -->"
START_MEMORY = "<!-- bench/weight_memory.py --memory-scheduler: start -->"
END_MEMORY = "<!-- bench/weight_memory.py --memory-scheduler: end -->"

# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json and sdxl-vae (as tests/models/test_unet_2d_condition.py
# and test_autoencoder_kl.py, which check every key and shape against diffusers).
SDXL_UNET = {
    "act_fn": "silu", "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
    "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280], "cross_attention_dim": 2048,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"], "flip_sin_to_cos": True,
    "freq_shift": 0, "in_channels": 4, "layers_per_block": 2, "mid_block_type": "UNetMidBlock2DCrossAttn",
    "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4, "projection_class_embeddings_input_dim": 2816,
    "sample_size": 128, "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], "use_linear_projection": True,
}  # fmt: skip
SDXL_VAE = {
    "act_fn": "silu", "block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3, "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32, "out_channels": 3,
    "sample_size": 1024, "scaling_factor": 0.13025, "up_block_types": ["UpDecoderBlock2D"] * 4,
}  # fmt: skip
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_attention_heads=12,
              num_hidden_layers=12, hidden_act="quick_gelu", projection_dim=768)  # fmt: skip
CLIP_BIG_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_attention_heads=20,
                  num_hidden_layers=32, hidden_act="gelu", projection_dim=1280)  # fmt: skip


def modules():
    """(name, shapes-only module, rules, dtype as the pipeline serves it: bf16, the VAE fp32)."""
    bf16 = jnp.bfloat16
    unet_cfg = UNet2DConditionConfig.from_config(SDXL_UNET)
    yield (
        "UNet",
        abstract_module(UNet2DConditionModel, unet_cfg, dtype=bf16),
        UNET_RULES,
        bf16,
    )
    # SDXL's text_encoder/ and text_encoder_2/ configs: 12 and 32 layers.
    for name, raw, cls in (
        ("CLIP-L", CLIP_L, CLIPTextModel),
        ("CLIP-bigG", CLIP_BIG_G, CLIPTextModelWithProjection),
    ):
        cfg = CLIPTextConfig.from_config(raw)
        yield name, abstract_module(cls, cfg, dtype=bf16), CLIP_RULES, bf16
    vae_cfg = AutoencoderKLConfig.from_config(SDXL_VAE)
    yield "VAE", abstract_module(AutoencoderKL, vae_cfg), VAE_RULES, jnp.float32


def placed_state(
    module, rules, placement, dtype, quantize: str | None = None, activations: str | None = None
):
    """The module's state as ShapeDtypeStructs with the shardings `placement` gives the real weights.

    `quantize` ("int8" | "fp8"): as models/components/quantize.py's load_quantized stores them, each
    layers.Linear's kernel (a stacked block's too: [blocks, in, out]) in that dtype under its own rule, an
    fp32 scale per output channel under `quantized_rules`, and `activations` (fp8: "fp8" | "fp8-upcast") set
    on the layer, its kernel then [out, in] as `kernel_t`; everything else in `dtype`."""
    kernels = set()
    if quantize:
        rules = quantized_rules(rules)
        for path, node in nnx.iter_graph(module):
            if isinstance(node, Linear):
                scale = (*node.kernel.shape[:-2], node.kernel.shape[-1])
                node.kernel_scale = nnx.Param(jax.ShapeDtypeStruct(scale, jnp.float32))
                if activations:  # stored [out, in] as `kernel_t`, as load_quantized does
                    setattr(node, ACTIVATIONS, activations)
                    *blocks, n_in, out = node.kernel.shape
                    transposed = jax.ShapeDtypeStruct((*blocks, out, n_in), node.kernel.dtype)
                    setattr(node, TRANSPOSED, nnx.Param(transposed))
                    del node.kernel
                kernels.add((*path, TRANSPOSED if activations else "kernel"))
    graph, state = nnx.split(module)
    flat = []
    for path, var in state.flat_state():
        value = var.get_value()
        spec = placement.param_spec(rules, torch_key(path), value.shape)
        if tuple(path) in kernels:
            leaf_dtype = {"int8": jnp.int8, "fp8": FP8}[quantize]
        elif path[-1] == SCALE:
            leaf_dtype = jnp.float32
        else:
            leaf_dtype = dtype if jnp.issubdtype(value.dtype, jnp.floating) else value.dtype
        abstract = jax.ShapeDtypeStruct(value.shape, leaf_dtype, sharding=NamedSharding(placement.mesh, spec))
        flat.append((path, var.replace(abstract)))
    return graph, nnx.State.from_flat_path(flat)


def _placement(ways: int):
    weights = {"shard_over": ["data"]} if ways > 1 else None
    return pipeline_placement({"data": ways}, list(range(ways)), weights=weights)["placement"]


def weight_bytes_table(ways_list) -> list[str]:
    rows = [
        "| module | parameters | " + " | ".join(f"{w}-way MiB/device" for w in ways_list) + " |",
        "|---|---|" + "---|" * len(ways_list),
    ]
    totals = [0.0] * len(ways_list)
    for name, module, rules, dtype in modules():
        cells, count = [], 0
        for i, ways in enumerate(ways_list):
            _, state = placed_state(module, rules, _placement(ways), dtype)
            per_device = 0
            count = 0
            for leaf in jax.tree.leaves(state):
                count += math.prod(leaf.shape)
                per_device += (
                    math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
                )
            totals[i] += per_device
            cells.append(f"{per_device / MIB:,.1f}")
        rows.append(f"| {name} | {count:,} | " + " | ".join(cells) + " |")
    rows.append("| **all four** | | " + " | ".join(f"**{t / MIB:,.1f}**" for t in totals) + " |")
    return rows


VARIANTS = ("as placed", "hoisted", "per step")


def compile_unet_loop(ways: int, latent: int, variant: str):
    """The SDXL-base UNet's CFG pass inside a while loop on a `ways`-way data mesh, compiled (never run).

    variant: "as placed" (no gather constraint), "hoisted" (the weights constrained to their tensor-only
    sharding at merge: loop-invariant, so XLA gathers them once before the loop) or "per step" (the pipeline
    now: Placement.gather_weights_per_step ties them to the step's input first)."""
    placement = _placement(ways)
    name, module, rules, dtype = next(modules())
    graph, state = placed_state(module, rules, placement, dtype)
    batch = ways  # one request per device: the UNet batch is 2 x ways with CFG, split over data

    def _denoise(state, latents, embeds, pooled, time_ids, steps):
        def body(carry):
            i, x = carry
            rows = placement.constrain_batch(jnp.repeat(x, 2, axis=0))  # [u0, c0, u1, c1, ...]
            if variant == "per step":
                weights, rows = placement.gather_weights_per_step(state, rows, rules)
            else:
                weights = placement.gather_weights(state, rules) if variant == "hoisted" else state
            unet = nnx.merge(graph, weights)
            eps = unet(rows, jnp.full((rows.shape[0],), 500.0), embeds, text_embeds=pooled, time_ids=time_ids)
            eps = placement.constrain_batch(eps.astype(jnp.float32))
            uncond, cond = eps[0::2], eps[1::2]
            return i + 1, placement.constrain_batch(x - 0.1 * (uncond + 5.0 * (cond - uncond)))

        return jax.lax.while_loop(lambda c: c[0] < steps, body, (jnp.int32(0), latents))[1]

    def arg(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=placement.batch_spec(shape[0], len(shape)))

    args = (
        arg((batch, latent, latent, 4), jnp.float32),
        arg((2 * batch, 77, 2048), dtype),
        arg((2 * batch, 1280), dtype),
        arg((2 * batch, 6), dtype),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    return jax.jit(_denoise).lower(state, *args).compile()


def gather_table(ways_list, latent: int, variants) -> list[str]:
    rows = [
        "| ways | variant | arguments MiB/device | temporaries MiB/device | peak MiB/device | all-gathers "
        "in the loop per step | all-gather MiB/device/step | all-gathers before the loop | other collectives "
        "MiB/device/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for ways in ways_list:
        for variant in variants if ways > 1 else ("replicated",):
            t0 = time.perf_counter()
            compiled = compile_unet_loop(ways, latent, variant)
            mem = memory_parts(compiled)
            hlo = compiled.as_text()
            step = per_step(hlo)  # raises if a loop of unknown trip count hides inside the step
            gathered = step["all-gather"]
            other = sum(step[kind] for kind in COLLECTIVES if kind != "all-gather")
            found = [c for c in collectives(hlo) if c["kind"] == "all-gather"]
            inside = sum(c["times"] for c in found if c["loops"][:1] == ("jit(_denoise)/while",))
            before = sum(c["times"] for c in found if not c["loops"])
            rows.append(
                f"| {ways} | {variant} | {mem['arguments'] / MIB:,.0f} | {mem['temporaries'] / MIB:,.0f} | "
                f"{(mem['arguments'] + mem['temporaries']) / MIB:,.0f} | {inside} | {gathered / MIB:,.1f} | "
                f"{before} | {other / MIB:,.1f} |"
            )
            print(rows[-1], f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ways", default="1,2,4,8", help="data-axis sizes (= FSDP ways), comma separated")
    parser.add_argument("--latent", type=int, default=128, help="latent side (128: a 1024x1024 image)")
    parser.add_argument(
        "--variants", default="hoisted,per step", help=f"comma separated, of {', '.join(VARIANTS)}"
    )
    parser.add_argument(
        "--memory-scheduler",
        action="store_true",
        help="XLA:CPU's memory-minimizing scheduler (--xla_cpu_enable_concurrency_optimized_scheduler=false; "
        "read from XLA_FLAGS, so set here before JAX starts)",
    )
    parser.add_argument("--skip-compile", action="store_true", help="only the weight-bytes table")
    parser.add_argument("--write-docs", action="store_true", help=f"replace the generated section of {DOCS}")
    args = parser.parse_args()
    ways_list = [int(w) for w in args.ways.split(",")]
    variants = [v.strip() for v in args.variants.split(",")]
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}")
    out = [
        f"SDXL-base shapes; {len(jax.devices())} host CPU devices, jax {jax.__version__}. Weights as the "
        "pipeline serves them in bf16 (the VAE in fp32); mesh data=N, weights: {shard_over: [data]}.",
    ]
    if not args.memory_scheduler:  # the placement arithmetic does not depend on the scheduler: written once
        out += ["", *weight_bytes_table(ways_list)]
    if not args.skip_compile:
        scheduler = (
            "XLA:CPU's memory-minimizing scheduler (--memory-scheduler)"
            if args.memory_scheduler
            else "XLA:CPU's default (concurrency-optimized) scheduler"
        )
        out += [
            "",
            f"The UNet's denoise step compiled ({args.latent}x{args.latent} latent, one request per device, CFG), "
            f"{scheduler}: per-device memory from memory_analysis() (peak = arguments + temporaries) and the "
            "all-gathers inside the loop body (one step) and before it.",
            "",
        ]
        out += gather_table(ways_list, args.latent, variants)
    text = "\n".join(out)
    print(text)
    if args.write_docs:
        start, end = (START, END) if not args.memory_scheduler else (START_MEMORY, END_MEMORY)
        write_docs_section(DOCS, start, end, text)


if __name__ == "__main__":
    main()

"""FLUX.1-dev per-device memory on 1, 4 and 8 devices, from compiled programs of the real shapes (no weights).

    python bench/flux_memory.py                    # every layout, prints the tables (2.4 min on 2 cores)
    python bench/flux_memory.py --layouts 1,tensor4 --units 2      # a subset at 2 of 19 units: quick
    python bench/flux_memory.py --write-docs       # and replaces the generated part of docs/flux.md
    python bench/flux_memory.py --kontext --layouts 1,context4-fsdp   # FLUX.1 Kontext's denoise beside dev's

Nothing here needs a checkpoint or runs a model: every module is built shapes-only (models.loading.
abstract_module) from FLUX.1-dev's configs (transformer: 19 double + 38 single blocks of 24 heads x 128,
joint_attention_dim 4096, pooled 768, guidance_embeds; text_encoder_2: T5 v1.1 XXL, 24 layers of d_model 4096,
d_ff 10240, 64 heads; text_encoder: CLIP ViT-L/14's text tower; vae: 16 latent channels, blocks
[128, 256, 512, 512], no quant convs), weights bf16 but the VAE fp32, as models/flux/pipeline.py loads them. Each parameter is a ShapeDtypeStruct carrying the
NamedSharding `Placement.param_spec` gives the real weight (the same call `load_pipeline` places with), so
the compiled program's argument bytes are the weights' bytes per device.

Programs compiled (lowered with abstract arguments and compiled for XLA:CPU on N of 8 host devices; never run):

- denoise: the transformer in a `lax.while_loop` of unknown trip count (as the pipeline's loop), one pass per
  trip on the batch (1 row with CFG off, 2 with true CFG: negative and positive prompt, interleaved so the
  `cfg` axis splits them), the weights gathered per step with `Placement.gather_weights_per_step` when
  shard_over is set, the flow-match Euler update x + (sigma_next - sigma) v on bf16 packed latents.
  1024x1024: 4096 image tokens (a 128 x 128 latent packed 2 x 2) + 512 text tokens.
- text_encode: T5-XXL on [rows, 512] token ids (weights gathered once, `Placement.gather_weights`).
- vae_decode: the VAE decoder on [1, 128, 128, 16] latents -> [1, 1024, 1024, 3] (plain attention, batch
  replicated: one image), as the pipeline decodes one image per call.

The whole 57-block transformer compiles in 3-5 s per program on a 2-core EPYC, its blocks stacked under a scan
as the engine holds them (1-2.5 min unrolled, `scan=False`; bench/compile_time.py), so no block count is
extrapolated; `--units k` compiles k units of (1 double + 2 single) blocks for a quick run
(FLUX.1-dev is 19 units) and marks the tables as not FLUX.1-dev's size.

XLA:CPU has no bf16 matmul: it converts bf16 weights to f32 before each dot, and in the denoise loop those
converts are loop-invariant, so XLA hoists them out of the loop and an f32 copy of every weight lives through
the generation (measured: 48.1 GB of temporaries for the 23.8 GB transformer on one device; docs/weights.md
found the same for SDXL). A GPU or TPU multiplies bf16 directly and has no such copy. So the denoise program
measured here ties the weights to the step's input through an optimization barrier, as
`Placement.gather_weights_per_step` does with shard_over (with shard_over it is exactly the engine's program),
and runs XLA:CPU's memory-minimizing scheduler (`--default-scheduler` to compare): each weight's f32 copy is
then made at its use and freed after it. The temporaries still hold the f32 copies live at the peak (measured
on a toy of 4 bf16 [4096, 4096] layers: 66 MiB of temporaries = one layer in f32 + activations), at most a few
hundred MB for Flux's largest weights (a double block's AdaLayerNormZero Linear [3072, 18432] is 216 MiB in
f32 unsplit). The engine's own program without shard_over is also compiled once per layout ("engine, CPU"
column) to show what the CPU itself needs.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.memory_analysis import host_cpu_devices  # noqa: E402

host_cpu_devices(memory_minimizing="--default-scheduler" not in sys.argv)  # before JAX is imported

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench.attention_memory import MIB, memory_parts  # noqa: E402
from bench.memory_analysis import (  # noqa: E402
    ACCELERATOR_LIKE,
    GB,
    batch_arg,
    fits,
    fits_rule,
    layout_placement,
    layout_text,
    scheduler_name,
    state_bytes,
    write_docs_section,
)
from bench.weight_memory import placed_state  # noqa: E402
from meshserve.models.attention import AttentionSettings  # noqa: E402
from meshserve.models.checkpoints.loading import abstract_module  # noqa: E402
from meshserve.models.components.autoencoder_kl import SHARDING_RULES as VAE_RULES  # noqa: E402
from meshserve.models.components.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig  # noqa: E402
from meshserve.models.components.block_stack import stack_blocks  # noqa: E402
from meshserve.models.components.clip import SHARDING_RULES as CLIP_RULES  # noqa: E402
from meshserve.models.components.clip import CLIPTextConfig, CLIPTextModel  # noqa: E402
from meshserve.models.components.quantize import quantized_rules  # noqa: E402
from meshserve.models.components.t5 import SHARDING_RULES as T5_RULES  # noqa: E402
from meshserve.models.components.t5 import T5Config, T5EncoderModel  # noqa: E402
from meshserve.models.flux.transformer_flux import SHARDING_RULES as FLUX_RULES  # noqa: E402
from meshserve.models.flux.transformer_flux import FluxTransformer2DConfig, FluxTransformer2DModel  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "flux.md"
START, END = "<!-- bench/flux_memory.py: start -->", "<!-- bench/flux_memory.py: end -->"

# black-forest-labs/FLUX.1-dev: transformer/config.json, text_encoder_2/config.json (T5 v1.1 XXL),
# text_encoder/config.json (CLIP ViT-L/14 text), vae/config.json.
FLUX_DEV = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)  # fmt: skip
T5_XXL = dict(
    vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, layer_norm_epsilon=1e-6,
    feed_forward_proj="gated-gelu", model_type="t5",
)  # fmt: skip
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_attention_heads=12,
              num_hidden_layers=12, hidden_act="quick_gelu", projection_dim=768)  # fmt: skip
FLUX_VAE = {
    "act_fn": "silu", "block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3, "latent_channels": 16, "layers_per_block": 2, "norm_num_groups": 32, "out_channels": 3,
    "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "use_quant_conv": False, "use_post_quant_conv": False, "mid_block_add_attention": True,
}  # fmt: skip

IMAGE, TEXT = 4096, 512  # tokens at 1024x1024 (128 x 128 latent, 2 x 2 patches) and T5's max_sequence_length
UNITS = 19  # FLUX.1-dev = 19 x (1 double + 2 single blocks)

# name -> (mesh sizes, shard_over, transformer rows compiled: 1 = CFG off, 2 = true CFG). A cfg axis only
# helps with true CFG (it splits the negative and positive rows), so cfg layouts are measured with it alone;
# true CFG on the others is measured on one device (it doubles the activations, not the weights). Compiling
# the whole transformer takes 1-5 min per program on this shared 2-core machine, hence a short list.
LAYOUTS = {
    "1": ({}, (), (1, 2)),
    "context4": ({"context": 4}, (), (1,)),
    "tensor4": ({"tensor": 4}, (), (1,)),
    "context4-fsdp": ({"context": 4}, ("context",), (1,)),
    "cfg2-context2-fsdp": ({"cfg": 2, "context": 2}, ("cfg", "context"), (2,)),
    "context8-fsdp": ({"context": 8}, ("context",), (1,)),
    "cfg2-context4-fsdp": ({"cfg": 2, "context": 4}, ("cfg", "context"), (2,)),
    # More tensor parallelism, for comparison.
    "context2-tensor2": ({"context": 2, "tensor": 2}, (), (1,)),
    "tensor8": ({"tensor": 8}, (), (1,)),
    "context2-tensor4-fsdp": ({"context": 2, "tensor": 4}, ("context",), (1,)),
}


def flux_module(units: int, settings: AttentionSettings, scan: bool = True):
    """scan: the blocks stacked (models/components/block_stack.py), as a pipeline holds them by default."""
    cfg = FluxTransformer2DConfig(**dict(FLUX_DEV, num_layers=units, num_single_layers=2 * units))
    module = abstract_module(FluxTransformer2DModel, cfg, settings=settings, dtype=jnp.bfloat16)
    return stack_blocks(module) if scan else module


def other_modules():
    """(name, shapes-only module, rules, dtype) of the three other components: the text encoders in bf16, the
    VAE in fp32 (models/flux/pipeline.py decodes in fp32 whatever the pipeline dtype)."""
    t5 = T5Config(**T5_XXL)
    bf16 = jnp.bfloat16
    yield "T5-XXL", abstract_module(T5EncoderModel, t5, dtype=bf16), T5_RULES, bf16
    clip = CLIPTextConfig.from_config(CLIP_L)
    yield "CLIP-L", abstract_module(CLIPTextModel, clip, dtype=bf16), CLIP_RULES, bf16
    vae = AutoencoderKLConfig.from_config(FLUX_VAE)
    f32 = jnp.float32
    yield "VAE", abstract_module(AutoencoderKL, vae, dtype=f32), VAE_RULES, f32


def compile_denoise(*args, **kwargs):
    """lower_denoise's program compiled: as an accelerator's stand-in (ACCELERATOR_LIKE), or with tie=False as
    the engine's program on this CPU, with XLA:CPU's own passes."""
    engine = kwargs.get("tie", True) is False
    return lower_denoise(*args, **kwargs).compile(compiler_options=None if engine else ACCELERATOR_LIKE)


def lower_denoise(
    units: int,
    placement,
    settings,
    rows: int,
    tie: bool = True,
    scan: bool = True,
    quantize: str | None = None,
    activations: str | None = None,
    context: int = 0,
):
    """The transformer's denoise loop at 1024x1024 (`rows` = 1: CFG off, 2: true CFG), lowered.

    context: FLUX.1 Kontext's image tokens after the latents' (models/flux/pipeline_kontext.py: 4096, an image
    of the output's size), an input of the loop the transformer sees every step, its output cut to the latents.

    tie: without shard_over too, the weights pass an optimization barrier with the step's input (as
    `gather_weights_per_step` does with shard_over), so XLA:CPU cannot hoist its bf16 -> f32 weight converts
    out of the loop (module docstring); False: the program the engine compiles (hoisted converts on CPU).
    scan: the blocks under a lax.scan (the engine's default) or unrolled. quantize, activations: the Linear
    kernels as a pool with `quantize` stores them (bench/weight_memory.py's placed_state)."""
    module = flux_module(units, settings, scan)
    rules = quantized_rules(FLUX_RULES) if quantize else FLUX_RULES
    graph, state = placed_state(module, FLUX_RULES, placement, jnp.bfloat16, quantize, activations)
    bf16 = jnp.bfloat16
    cos = np.zeros((TEXT + IMAGE + context, 128), np.float32)
    replicated = jax.sharding.NamedSharding(placement.mesh, jax.sharding.PartitionSpec())

    def _denoise(state, latents, embeds, pooled, guidance, rope, sigmas, steps, image):
        def body(carry):
            i, x = carry
            tokens = jnp.concatenate([x, image], axis=1) if context else x
            rows_in = placement.constrain_batch(
                jnp.repeat(tokens, rows, axis=0)
            )  # [neg0, pos0, ...] with CFG
            weights, rows_in = placement.gather_weights_per_step(state, rows_in, rules)
            if tie and not placement.shard_over:
                weights, rows_in = jax.lax.optimization_barrier((weights, rows_in))
            model = placement.gather_blocks(nnx.merge(graph, weights), rules)
            t = jnp.broadcast_to(sigmas[i], (rows_in.shape[0],))
            v = model(rows_in, embeds, pooled, t, rope, guidance)[:, :IMAGE].astype(jnp.float32)
            v = placement.constrain_batch(v)
            if rows == 2:  # true CFG: neg + s (pos - neg)
                v = v[0::2] + 3.5 * (v[1::2] - v[0::2])
            x = (x.astype(jnp.float32) + (sigmas[i + 1] - sigmas[i]) * v).astype(x.dtype)
            return i + 1, placement.constrain_batch(x)

        return jax.lax.while_loop(lambda c: c[0] < steps, body, (jnp.int32(0), latents))[1]

    args = (
        batch_arg(placement, (1, IMAGE, 64), bf16),
        batch_arg(placement, (rows, TEXT, 4096), bf16),
        batch_arg(placement, (rows, 768), bf16),
        batch_arg(placement, (rows,), jnp.float32),
        tuple(jax.ShapeDtypeStruct(cos.shape, jnp.float32, sharding=replicated) for _ in range(2)),
        jax.ShapeDtypeStruct((201,), jnp.float32, sharding=replicated),
        jax.ShapeDtypeStruct((), jnp.int32),
        batch_arg(placement, (1, max(context, 1), 64), bf16),
    )
    return jax.jit(_denoise).lower(state, *args)


def compile_t5(*args, **kwargs):
    return lower_t5(*args, **kwargs).compile(compiler_options=ACCELERATOR_LIKE)


def lower_t5(placement, rows: int, scan: bool = True):
    name, module, rules, dtype = next(other_modules())
    module = stack_blocks(module) if scan else module
    graph, state = placed_state(module, rules, placement, dtype)

    def _encode(state, ids):
        t5 = placement.gather_blocks(nnx.merge(graph, placement.gather_weights(state, rules)), rules)
        return t5(ids).last_hidden_state

    return jax.jit(_encode).lower(state, batch_arg(placement, (rows, TEXT), jnp.int32))


def compile_vae(placement):
    *_, (name, module, rules, dtype) = other_modules()
    graph, state = placed_state(module, rules, placement, dtype)

    def _decode(state, z):
        vae = nnx.merge(graph, placement.gather_weights(state, rules))
        return vae.decode(z)

    z = batch_arg(placement, (1, 128, 128, 16), jnp.float32)
    return jax.jit(_decode).lower(state, z).compile()


def measure(name: str, units: int, engine: bool) -> dict:
    sizes, shard_over, cfg_modes = LAYOUTS[name]
    placement, settings = layout_placement(sizes, shard_over)
    out = {"name": name, "sizes": sizes, "shard_over": shard_over, "devices": placement.sizes.num_devices}
    out["cfg_modes"] = cfg_modes
    out["measured"] = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M}"
    # Weights at rest per device (every component stays loaded), from the placement alone.
    graph, state = placed_state(flux_module(units, settings), FLUX_RULES, placement, jnp.bfloat16)
    out["weights"] = {"transformer": state_bytes(state)}
    for comp, module, rules, dtype in other_modules():
        out["weights"][comp] = state_bytes(placed_state(module, rules, placement, dtype)[1])

    def timed(label, fn):
        t0 = time.perf_counter()
        mem = memory_parts(fn())
        print(f"  {name} {label}: " + ", ".join(f"{p} {v / MIB:,.0f} MiB" for p, v in mem.items())
              + f" ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
        return mem

    for rows in cfg_modes:
        out[f"denoise{rows}"] = timed(
            f"denoise rows={rows}", lambda r=rows: compile_denoise(units, placement, settings, r)
        )
        out[f"t5_{rows}"] = timed(f"T5 rows={rows}", lambda r=rows: compile_t5(placement, r))
    if engine:
        out["engine"] = timed(
            "denoise rows=1, as the engine", lambda: compile_denoise(units, placement, settings, 1, tie=False)
        )
    out["vae"] = timed("VAE decode", lambda: compile_vae(placement))
    return out


def kontext(names: list[str], units: int) -> list[str]:
    """FLUX.1 Kontext's denoise program (the image as 4096 context tokens: 512 + 2 x 4096 in the joint sequence)
    beside FLUX.1-dev's, per layout and CFG mode: its temporaries and the peak they make with the weights at
    rest (the T5 and VAE stages are FLUX.1-dev's; the image's VAE encode is smaller than the decode)."""
    out = [
        "| layout | CFG | FLUX.1-dev denoise temp | Kontext denoise temp | Kontext peak | fits (of 16, 24, 40, 80 GB) |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        sizes, shard_over, cfg_modes = LAYOUTS[name]
        placement, settings = layout_placement(sizes, shard_over)
        at_rest = state_bytes(
            placed_state(flux_module(units, settings), FLUX_RULES, placement, jnp.bfloat16)[1]
        )[1]
        for _, module, rules, dtype in other_modules():
            at_rest += state_bytes(placed_state(module, rules, placement, dtype)[1])[1]
        vae = memory_parts(compile_vae(placement))
        for rows in cfg_modes:
            plain = memory_parts(compile_denoise(units, placement, settings, rows))
            edit = memory_parts(compile_denoise(units, placement, settings, rows, context=IMAGE))
            t5 = memory_parts(compile_t5(placement, rows))
            peak = at_rest + max(p["temporaries"] + p["output"] for p in (edit, t5, vae))
            out.append(
                f"| {layout_text(sizes, shard_over)} | {'true CFG' if rows == 2 else 'off'} | "
                f"{plain['temporaries'] / GB:.2f} | {edit['temporaries'] / GB:.2f} | **{peak / GB:.2f}** | "
                f"{fits(peak)} |"
            )
            print(out[-1], file=sys.stderr, flush=True)
    return out


def _layout_text(r) -> str:
    return layout_text(r["sizes"], r["shard_over"])


def tables(results, units: int) -> list[str]:
    scale = "" if units == UNITS else f" (**{units} of {UNITS} units: not FLUX.1-dev's size**)"
    out = [
        f"Weights at rest, GB per device (bf16, the VAE fp32; every component loaded; from the placement){scale}:",
        "",
        "| layout | devices | transformer | T5-XXL | CLIP-L | VAE | all |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        w = r["weights"]
        total = sum(b for _, b in w.values())
        cells = " | ".join(f"{w[c][1] / GB:.2f}" for c in ("transformer", "T5-XXL", "CLIP-L", "VAE"))
        out.append(f"| {_layout_text(r)} | {r['devices']} | {cells} | **{total / GB:.2f}** |")
    params = results[0]["weights"]
    out += [
        "",
        "Parameters: " + ", ".join(f"{c} {params[c][0] / 1e9:.3f} B" for c in params) + ".",
        "",
        "Programs at 1024x1024, GB per device from `memory_analysis()`: the denoise loop (arguments = its "
        "weights and inputs; temporaries), T5 (512 tokens) and the VAE decode. Peak = all weights at rest + the "
        'largest (temporaries + output) of the three stages, which run one after another. "engine, CPU": the '
        "denoise temporaries of the program as the engine compiles it without shard_over, where XLA:CPU hoists "
        "an f32 copy of every weight out of the loop (module docstring of bench/flux_memory.py).",
        "",
        "| layout | CFG | denoise args | denoise temp | T5 temp | VAE temp | peak | fits (of 16, 24, 40, 80 GB) "
        "| engine, CPU: denoise temp |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        at_rest = sum(b for _, b in r["weights"].values())
        for rows in r["cfg_modes"]:
            d, t5, vae = r[f"denoise{rows}"], r[f"t5_{rows}"], r["vae"]
            stage = max(part["temporaries"] + part["output"] for part in (d, t5, vae))
            peak = at_rest + stage
            engine = r.get("engine") if rows == 1 else None
            engine_cell = f"{engine['temporaries'] / GB:.2f}" if engine else ""
            out.append(
                f"| {_layout_text(r)} | {'true CFG' if rows == 2 else 'off'} | {d['arguments'] / GB:.2f} | "
                f"{d['temporaries'] / GB:.2f} | {t5['temporaries'] / GB:.2f} | {vae['temporaries'] / GB:.2f} | "
                f"**{peak / GB:.2f}** | {fits(peak)} | {engine_cell} |"
            )
    return out


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layouts", default=",".join(LAYOUTS), help=f"comma separated, of {', '.join(LAYOUTS)}"
    )
    parser.add_argument(
        "--units", type=int, default=UNITS, help="(1 double + 2 single) block units (dev: 19)"
    )
    parser.add_argument(
        "--engine",
        default="1",
        help="layouts (comma separated) on which the engine's own program is compiled too (CPU hoisting)",
    )
    parser.add_argument(
        "--default-scheduler",
        action="store_true",
        help="XLA:CPU's default concurrency-optimized scheduler (read from XLA_FLAGS before JAX starts)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        help="a JSON file of measured layouts: read (layouts in it are not compiled again) and written after "
        "each layout, so an interrupted run resumes",
    )
    parser.add_argument("--write-docs", action="store_true", help=f"replace the generated section of {DOCS}")
    parser.add_argument(
        "--kontext",
        action="store_true",
        help="only FLUX.1 Kontext's denoise program beside FLUX.1-dev's, per layout (a table; no docs written)",
    )
    args = parser.parse_args()
    names = [n.strip() for n in args.layouts.split(",")]
    if unknown := set(names) - set(LAYOUTS):
        parser.error(f"unknown layouts {sorted(unknown)}")
    t0 = time.perf_counter()
    if args.kontext:
        table = kontext(names, args.units)
        print(f"FLUX.1 Kontext at 1024x1024, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, jax "
              f"{jax.__version__}, {time.perf_counter() - t0:.0f} s. " + fits_rule())  # fmt: skip
        print("\n".join(table))
        return
    engine = {n.strip() for n in args.engine.split(",")}
    scheduler = scheduler_name(args.default_scheduler)
    key = f"units={args.units} scheduler={scheduler} jax={jax.__version__}"
    cache = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    results = []
    for n in names:
        if f"{key} {n}" not in cache:
            cache[f"{key} {n}"] = measure(n, args.units, n in engine and not LAYOUTS[n][1])
            if args.cache:
                args.cache.write_text(json.dumps(cache))
        results.append(cache[f"{key} {n}"])
    text = "\n".join(
        [
            f"FLUX.1-dev shapes; {len(jax.devices())} host CPU devices, jax {jax.__version__}, XLA:CPU "
            f"{scheduler} scheduler; layouts measured {min(r['measured'] for r in results)} to "
            f"{max(r['measured'] for r in results)} UTC (this run: {time.perf_counter() - t0:.0f} s). "
            + fits_rule(),
            "",
            *tables(results, args.units),
        ]
    )
    print(text)
    if args.write_docs:
        write_docs_section(DOCS, START, END, text)


if __name__ == "__main__":
    main()

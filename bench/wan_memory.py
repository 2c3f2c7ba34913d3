"""Wan2.1-T2V-14B (and 1.3B): per-device memory and bytes sent of one CFG denoise step, from compiled programs.

    python bench/wan_memory.py --sizes 480p --json a.json    # the 40-block model, every layout (3-25 min)
    python bench/wan_memory.py --sizes 720p --json b.json    # the same at 720x1280
    python bench/wan_memory.py --from-json a.json b.json --write-docs   # tables from both, into docs/wan.md
    python bench/wan_memory.py --model 1.3b --layouts 1 --sizes 480p,720p,352x640   # Wan2.1-T2V-1.3B, 1 device
    python bench/wan_memory.py --layers 1,2 --layouts context8-fsdp --sizes 480p     # quick, extrapolated
    python bench/wan_memory.py --model a14b --sizes 480p,720p --write-docs   # Wan2.2-T2V-A14B's two experts
    python bench/wan_memory.py --model ti2v5b --sizes 480p,720p --write-docs # Wan2.2-TI2V-5B, 121 frames

Nothing here needs a checkpoint or runs a model: the transformer is built shapes-only (models.loading.
abstract_module) from Wan2.1-T2V-14B's transformer config (dim 5120 = 40 heads x 128, 40 blocks, ffn 13824,
text_dim 4096, freq_dim 256, patch (1, 2, 2), 16 latent channels in and out), or 1.3B's (12 heads x 128,
30 blocks, ffn 8960), in bf16; the UMT5-XXL text encoder (5.7 B parameters, bf16) and the VAE (fp32) only
for their weights at rest. Each parameter is a
ShapeDtypeStruct carrying the NamedSharding `Placement.param_spec` gives the real weight under
`models/transformer_wan.SHARDING_RULES` and the pool's `weights: {shard_over: [...]}` (the call `load_pipeline`
places with), so the compiled program's argument bytes are the weights' bytes per device.

The program (lowered with abstract arguments and compiled for XLA:CPU on N of 8 host devices; never run) is
the denoise loop as models/wan/pipeline.py builds it: a `lax.while_loop` of unknown trip count whose body
repeats the fp32 latents [1, 21, h, w, 16] into the CFG batch of 2 (negative, positive: interleaved, so a cfg
axis splits them), gathers the weights per step (`Placement.gather_weights_per_step`) when shard_over is set,
runs the transformer in bf16 on the 512 text tokens of each row, combines neg + 5 (pos - neg) and takes a flow
step x + (sigma_next - sigma) v in fp32 (UniPC's few extra element-wise terms on the latents are not in it:
they are 2.2 MB arrays at 480p). Attention: `AttentionSettings()` (context strategy "auto": Ulysses, since
40 heads divide 2, 4 and 8; the cross-attention's 512 text tokens are kept whole on every device). 480x832,
81 frames: 21 x 30 x 52 = 32,760 video tokens; 720x1280: 21 x 45 x 80 = 75,600.

Peak per device: every component's weights at rest (the pipeline keeps them loaded) plus the larger of the
denoise step's inputs + temporaries and the VAE decode's temporaries + video. The decode (fp32, batch 1, the
real VAE config) is compiled by bench/wan_vae_memory.py in a child process with XLA:CPU's default scheduler
(`vae_decode_memory`), unsplit: one device's whole decode on any layout, an upper bound since the pipeline
splits the decode over the pool's devices (docs/wan.md, "Split over the pool's devices", has those numbers).

Bytes sent per device per step: every collective inside the loop body, read from the compiled HLO with
bench/attention_memory.py's reader (as bench/denoise_comm.py does for SDXL): all-gather (the FSDP weight
gathers), all-to-all (Ulysses), all-reduce, collective-permute, reduce-scatter; bytes one device puts on the
wire, averaged over the mesh. XLA:CPU converts bf16 to f32 before its collectives, so each is also counted
at bf16 (`as_bf16`): what a GPU or TPU program sends.

XLA:CPU has no bf16 matmul: it converts bf16 weights to f32 before each dot, and in a loop those converts are
loop-invariant, so without shard_over XLA hoists an f32 copy of every weight out of the loop (bench/
flux_memory.py measured 45.8 GB of temporaries for Flux's 23.8 GB transformer). A GPU or TPU multiplies bf16
directly. So, as bench/flux_memory.py does, the program ties the weights to the step's input through an
optimization barrier also without shard_over, and runs XLA:CPU's memory-minimizing scheduler
(`--default-scheduler` to compare); with shard_over it is exactly the engine's program.

Layers: the whole 40-block model is compiled (abstract: nothing is allocated; 2-4 s per layout on a 2-core
EPYC with the blocks under a scan as the engine holds them, 16-200 s unrolled). `--layers 1,2` compiles two smaller block counts per cell and extrapolates each byte
count linearly to 40 for a quick look, but the temporaries are NOT linear in the block count (measured on one
device at 480p, unrolled: 6.26 GB at 1 block, 15.87 GB at 2, 4 and 40 blocks: the peak is one block's working
set once there are two), so only the arguments and the bytes sent extrapolate; the tables say which was done.
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
import math  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from bench.attention_memory import COLLECTIVES, collectives, memory_parts  # noqa: E402
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
from meshserve.models.components.block_stack import stack_blocks  # noqa: E402
from meshserve.models.components.quantize import quantized_rules  # noqa: E402
from meshserve.models.components.t5 import SHARDING_RULES as T5_RULES  # noqa: E402
from meshserve.models.components.t5 import T5Config, T5EncoderModel  # noqa: E402
from meshserve.models.wan.autoencoder_kl_wan import SHARDING_RULES as VAE_RULES  # noqa: E402
from meshserve.models.wan.autoencoder_kl_wan import AutoencoderKLWan, AutoencoderKLWanConfig  # noqa: E402
from meshserve.models.wan.transformer_wan import SHARDING_RULES as WAN_RULES  # noqa: E402
from meshserve.models.wan.transformer_wan import WanTransformer3DConfig, WanTransformer3DModel  # noqa: E402
from meshserve.models.wan.two_experts import WanExperts  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "wan.md"


def markers(model: str) -> tuple[str, str]:
    """The generated section of docs/wan.md for one model."""
    return f"<!-- bench/wan_memory.py {model}: start -->", f"<!-- bench/wan_memory.py {model}: end -->"


MB = 1e6

# Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json (diffusers' WanTransformer3DModel defaults).
WAN_14B = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)  # fmt: skip
# Its text_encoder/config.json: UMT5-XXL encoder (a relative-position table in every layer).
UMT5_XXL = dict(
    vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, layer_norm_epsilon=1e-6,
    feed_forward_proj="gated-gelu", model_type="umt5",
)  # fmt: skip
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json: 12 heads x 128, 30 blocks, ffn 8960.
WAN_1_3B = dict(WAN_14B, num_attention_heads=12, ffn_dim=8960, num_layers=30)
# Wan-AI/Wan2.2-T2V-A14B-Diffusers: two transformers of Wan2.1-T2V-14B's config (transformer, transformer_2),
# switched at boundary_ratio 0.875 (models/wan/two_experts.py): both resident, one runs per step.
# Wan-AI/Wan2.2-TI2V-5B-Diffusers: a 30-block transformer of 24 heads x 128 (dim 3072), ffn 14336, on 48 latent
# channels; its vae/config.json (the Wan 2.2 VAE: 16x in space; its 48 latent statistics do not shape the
# network); 121 frames (5 s at 24 fps), its 720p 704 x 1280 (sizes are multiples of 32).
TI2V_5B_VAE = {
    "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "temperal_downsample": [False, True, True], "is_residual": True, "patch_size": 2, "in_channels": 12,
    "out_channels": 12, "scale_factor_spatial": 16, "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48,
}  # fmt: skip
TI2V_5B = dict(
    WAN_14B, num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48,
    video={"vae": TI2V_5B_VAE, "frames": 121, "sizes": {"480p": (480, 832), "720p": (704, 1280)}},
)  # fmt: skip
MODELS = {
    "14b": ("Wan2.1-T2V-14B", WAN_14B),
    "1.3b": ("Wan2.1-T2V-1.3B", WAN_1_3B),
    "a14b": ("Wan2.2-T2V-A14B (two 14B experts)", dict(WAN_14B, experts=2)),
    "ti2v5b": ("Wan2.2-TI2V-5B", TI2V_5B),
}
A14B_BOUNDARY = 875.0  # boundary_ratio 0.875 x 1000 training timesteps
TEXT = 512
GUIDANCE = 5.0
# A model's video (its `video` entry, else Wan 2.1's): the VAE, the frame count and the named sizes.
WAN21_VIDEO = {"vae": {}, "frames": 81, "sizes": {"480p": (480, 832), "720p": (720, 1280)}}


def video_of(base: dict) -> dict:
    return base.get("video", WAN21_VIDEO)


def vae_config(base: dict) -> AutoencoderKLWanConfig:
    return AutoencoderKLWanConfig.from_config(video_of(base)["vae"])


def video_size(name: str, base: dict) -> tuple[int, int, tuple[int, int, int]]:
    """'480p', '720p' or 'HxW' (multiples of the VAE's factor x the patch's 2) -> (height, width, (latent
    frames, rows, columns)) at the model's frame count (81; TI2V-5B 121)."""
    video = video_of(base)
    f = vae_config(base).spatial_compression
    if name in video["sizes"]:
        height, width = video["sizes"][name]
    else:
        height, width = (int(v) for v in name.lower().split("x"))
    if height % (2 * f) or width % (2 * f):
        raise ValueError(f"{name}: height and width must be multiples of {2 * f} (VAE factor {f} x patch 2)")
    return height, width, ((video["frames"] - 1) // 4 + 1, height // f, width // f)


# name -> (mesh sizes, shard_over). Context degree 1/2/4/8; with a cfg axis of 2 where the 8 devices allow.
LAYOUTS = {
    "1": ({}, ()),
    "context2-fsdp": ({"context": 2}, ("context",)),
    "context4-fsdp": ({"context": 4}, ("context",)),
    "context8-fsdp": ({"context": 8}, ("context",)),
    "cfg2-fsdp": ({"cfg": 2}, ("cfg",)),
    "cfg2-context2-fsdp": ({"cfg": 2, "context": 2}, ("cfg", "context")),
    "cfg2-context4-fsdp": ({"cfg": 2, "context": 4}, ("cfg", "context")),
}


def wan_module(base: dict, layers: int, settings: AttentionSettings, scan: bool = True):
    """scan: the blocks stacked (models/components/block_stack.py), as a pipeline holds them by default. A base
    with `experts: 2` (Wan 2.2 A14B) is two such transformers as the pipeline holds them (WanExperts)."""
    base = dict(base)
    experts = base.pop("experts", 1)
    base.pop("video", None)
    cfg = WanTransformer3DConfig(**dict(base, num_layers=layers))

    def one():
        module = abstract_module(WanTransformer3DModel, cfg, settings=settings, dtype=jnp.bfloat16)
        return stack_blocks(module) if scan else module

    return one() if experts == 1 else WanExperts(one(), one(), A14B_BOUNDARY)


def compile_denoise(*args, **kwargs):
    return lower_denoise(*args, **kwargs).compile(compiler_options=ACCELERATOR_LIKE)


def lower_denoise(
    base: dict,
    layers: int,
    placement,
    settings,
    latent: tuple[int, int, int],
    scan: bool = True,
    quantize: str | None = None,
    activations: str | None = None,
):
    """quantize, activations: the Linear kernels as a pool with `quantize` stores them (bench/weight_memory.py's
    placed_state)."""
    module = wan_module(base, layers, settings, scan)
    rules = quantized_rules(WAN_RULES) if quantize else WAN_RULES
    graph, state = placed_state(module, WAN_RULES, placement, jnp.bfloat16, quantize, activations)
    frames, h, w = latent
    tokens = frames * (h // 2) * (w // 2)
    replicated = jax.sharding.NamedSharding(placement.mesh, jax.sharding.PartitionSpec())

    def _denoise(state, latents, embeds, rope, sigmas, steps):
        def body(carry):
            i, x = carry
            rows = placement.constrain_batch(
                jnp.repeat(x, 2, axis=0)
            )  # [neg0, pos0]: the cfg axis splits them
            weights, rows = placement.gather_weights_per_step(state, rows, rules)
            if not placement.shard_over:
                weights, rows = jax.lax.optimization_barrier((weights, rows))
            model = placement.gather_blocks(nnx.merge(graph, weights), rules)
            t = jnp.broadcast_to(sigmas[i] * 1000, (2,))
            v = model(rows.astype(jnp.bfloat16), t, embeds, rope)
            v = placement.constrain_batch(v)
            v = (v[0::2] + GUIDANCE * (v[1::2] - v[0::2])).astype(jnp.float32)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
            return i + 1, placement.constrain_batch(x)

        return jax.lax.while_loop(lambda c: c[0] < steps, body, (jnp.int32(0), latents))[1]

    args = (
        batch_arg(placement, (1, frames, h, w, base["in_channels"]), jnp.float32),
        batch_arg(placement, (2, TEXT, 4096), jnp.bfloat16),
        tuple(jax.ShapeDtypeStruct((tokens, 128), jnp.float32, sharding=replicated) for _ in range(2)),
        jax.ShapeDtypeStruct((201,), jnp.float32, sharding=replicated),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    return jax.jit(_denoise).lower(state, *args)


def sent_per_step(hlo: str) -> dict:
    """Bytes one device sends in one loop trip (= one denoise step), by collective kind."""
    out = {kind: 0.0 for kind in COLLECTIVES}
    for c in collectives(hlo):
        if c["loops"][:1] != ("jit(_denoise)/while",):
            continue  # before or after the loop: once per generation, not per step
        if len(c["loops"]) > 1:
            raise RuntimeError("a loop of unknown trip count inside the step: bytes would be undercounted")
        out[c["kind"]] += c["times"] * c["sent"]
    return out


def as_bf16(hlo: str) -> str:
    """The HLO with every f32 shape read as bf16. XLA:CPU has no bf16 arithmetic, so it converts bf16 weights
    and activations to f32 BEFORE its collectives (the compiled HLO shows `all-gather(wrapped_convert)` into
    f32[5120,5120], and f32 all-to-alls of q/k/v/out), which doubles the bytes a GPU or TPU program, whose
    collectives carry the bf16 values themselves, would send. Counting the same collectives at 2 bytes per
    element gives that program's bytes; it undercounts only the few collectives that are f32 on any device
    (the fp32 latents' and the velocity's re-sharding around the transformer: under 10 MB per step here)."""
    return hlo.replace("f32[", "bf16[")


def measure_cell(base: dict, name: str, size: str, layers: int) -> dict:
    sizes, shard_over = LAYOUTS[name]
    placement, settings = layout_placement(sizes, shard_over)
    t0 = time.perf_counter()
    compiled = compile_denoise(base, layers, placement, settings, video_size(size, base)[2])
    mem = memory_parts(compiled)
    hlo = compiled.as_text()
    sent, sent16 = sent_per_step(hlo), sent_per_step(as_bf16(hlo))
    seconds = time.perf_counter() - t0
    out = dict(
        mem, sent=sum(sent.values()), sent_bf16=sum(sent16.values()), sent_by_kind=sent, seconds=seconds
    )
    print(
        f"  {name} {size} layers={layers}: "
        + ", ".join(f"{k} {v / GB:.3f} GB" for k, v in mem.items())
        + f", sent {out['sent'] / MB:,.1f} MB (bf16 {out['sent_bf16'] / MB:,.1f} MB) ({seconds:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    return out


def vae_decode_memory(size: str, base: dict) -> dict:
    """The VAE decode of one video (the model's frames; fp32, batch 1) by bench/wan_vae_memory.py, in a child process
    with XLA:CPU's default scheduler, on one device: an upper bound for every layout, since the pipeline
    splits the decode spatially over the pool's devices (`bench/wan_vae_memory.py --meshes` measures that;
    the tables here were not re-rendered with it). The memory-minimizing scheduler this script compiles the denoise step with gives the decode
    twice the temporaries (measured at 480x832: 15.60 GB against 7.26 GB), so the decode is measured apart."""
    height, width, (frames, _, _) = video_size(size, base)
    flags = os.environ.get("XLA_FLAGS", "").replace(
        "--xla_cpu_enable_concurrency_optimized_scheduler=false", ""
    )
    code = (
        f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from bench.wan_vae_memory import measure; "
        f"print(json.dumps(measure({height}, {width}, {frames}, vae={video_of(base)['vae']!r})))"
    )
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    mem = {
        "arguments": raw["argument_bytes"],
        "output": raw["output_bytes"],
        "temporaries": raw["temp_bytes"],
    }
    print(
        f"  VAE decode {size}: " + ", ".join(f"{k} {v / GB:.3f} GB" for k, v in mem.items()),
        file=sys.stderr,
        flush=True,
    )
    return mem


def at_rest(base: dict, name: str) -> dict:
    """Weights at rest per device, every component of the 14B pipeline (from the placement alone)."""
    sizes, shard_over = LAYOUTS[name]
    placement, settings = layout_placement(sizes, shard_over)
    out = {}
    module = wan_module(base, base["num_layers"], settings)
    _, state = placed_state(module, WAN_RULES, placement, jnp.bfloat16)
    out["transformer"] = state_bytes(state)
    t5 = T5Config(**UMT5_XXL)
    enc = abstract_module(T5EncoderModel, t5, dtype=jnp.bfloat16)
    out["UMT5-XXL"] = state_bytes(placed_state(enc, T5_RULES, placement, jnp.bfloat16)[1])
    vae = abstract_module(AutoencoderKLWan, vae_config(base), dtype=jnp.float32)
    out["VAE"] = state_bytes(placed_state(vae, VAE_RULES, placement, jnp.float32)[1])
    return out


def extrapolate(points: dict[int, float], layers: int) -> float:
    if layers in points:
        return points[layers]
    (l1, v1), (l2, v2) = sorted(points.items())[:2]
    slope = (v2 - v1) / (l2 - l1)
    return v1 + slope * (layers - l1)


def _layout_text(name: str) -> str:
    return layout_text(*LAYOUTS[name])


def tables(
    results: dict, rest: dict, vae: dict, layer_points: list[int], layers: int, frames: int
) -> list[str]:
    fitted = layers not in layer_points
    out = [
        "Weights at rest, GB per device (bf16; the VAE fp32; from the placement, every component loaded):",
        "",
        "| layout | devices | transformer | UMT5-XXL | VAE | all |",
        "|---|---|---|---|---|---|",
    ]
    for name, w in rest.items():
        n = math.prod(LAYOUTS[name][0].values()) if LAYOUTS[name][0] else 1
        total = sum(b for _, b in w.values())
        cells = " | ".join(f"{w[c][1] / GB:.2f}" for c in ("transformer", "UMT5-XXL", "VAE"))
        out.append(f"| {_layout_text(name)} | {n} | {cells} | **{total / GB:.2f}** |")
    if rest:
        params = next(iter(rest.values()))
        out += ["", "Parameters: " + ", ".join(f"{c} {params[c][0] / 1e9:.3f} B" for c in params) + "."]
    how = (
        f"measured at {' and '.join(map(str, layer_points))} blocks and extrapolated linearly to {layers} "
        "(value = a + b x blocks through the two points; temp: the largest block count's, not extrapolated; "
        "the measured points are in the last columns)"
        if fitted
        else f"measured on all {layers} blocks"
    )
    out += [
        "",
        f"One CFG denoise step (batch 2: negative + positive prompt), {frames} frames, GB per device from "
        f"`memory_analysis()`, {how}. args = the transformer's weights and the loop's inputs; temp = the "
        "step's temporaries (activations, gathered weights, attention) and output. VAE temp = the VAE decode's "
        "temporaries and output (fp32, batch 1; the same program on every device of any layout). Peak = all "
        "weights at rest + the larger of the denoise step's (args less the transformer's weights, + temp) and "
        "the VAE decode's (VAE temp); the stage that sets it is named. GB sent = bytes one device sends per "
        "step (every collective in the loop body), counted at bf16 (what a GPU/TPU program sends) and as "
        "XLA:CPU compiled it (its collectives carry f32; `as_bf16` in bench/wan_memory.py).",
        "",
        "| size | layout | args | temp | VAE temp | peak | fits (of 16, 24, 40, 80 GB) | GB sent / step, bf16 | "
        "GB sent, XLA:CPU f32 | "
        + ("measured (blocks: args, temp, GB sent f32) |" if fitted else "compile s |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (size, name), points in results.items():
        args = extrapolate({k: v["arguments"] for k, v in points.items()}, layers)
        # Temporaries are one block's working set once there are two blocks (module docstring): not
        # extrapolated, the largest block count's is used.
        temp = max(points.items())[1]["temporaries"] + max(points.items())[1]["output"]
        sent = extrapolate({k: v["sent"] for k, v in points.items()}, layers)
        sent16 = extrapolate({k: v["sent_bf16"] for k, v in points.items()}, layers)
        weights = sum(b for _, b in rest[name].values())
        inputs = args - rest[name]["transformer"][1]  # latents, text embeddings, RoPE tables, schedule
        decode = vae[size]["temporaries"] + vae[size]["output"]
        stage, extra = max(("denoise", inputs + temp), ("VAE", decode), key=lambda x: x[1])
        peak = weights + extra
        if fitted:
            last = "; ".join(
                f"{k}: {v['arguments'] / GB:.2f}, {(v['temporaries'] + v['output']) / GB:.2f}, "
                f"{v['sent'] / GB:.2f}"
                for k, v in sorted(points.items())
            )
        else:
            last = f"{points[layers]['seconds']:.0f}"
        out.append(
            f"| {size} | {_layout_text(name)} | {args / GB:.2f} | {temp / GB:.2f} | {decode / GB:.2f} | "
            f"**{peak / GB:.2f}** ({stage}) | {fits(peak)} | {sent16 / GB:.2f} | {sent / GB:.2f} | {last} |"
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
        "--sizes", default="480p,720p", help="comma separated: 480p, 720p or HxW (the model's frame count)"
    )
    parser.add_argument(
        "--layers", help="block counts to compile: default the model's (40 or 30), or two to extrapolate from"
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="14b",
        help="Wan 2.1 T2V 14B or 1.3B, Wan 2.2 T2V A14B or TI2V 5B",
    )
    parser.add_argument("--default-scheduler", action="store_true", help="XLA:CPU's default scheduler")
    parser.add_argument("--json", type=Path, help="also write the raw measurements here")
    parser.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        help="render the tables from earlier --json files (merged; e.g. one run per size) without compiling "
        "the denoise step again",
    )
    parser.add_argument("--write-docs", action="store_true", help=f"replace the generated section of {DOCS}")
    args = parser.parse_args()
    names = [n.strip() for n in args.layouts.split(",")]
    sizes = [s.strip() for s in args.sizes.split(",")]
    layer_points = sorted({int(n) for n in args.layers.split(",")}) if args.layers else None
    if unknown := set(names) - set(LAYOUTS):
        parser.error(f"unknown layouts {sorted(unknown)}")
    title, base = MODELS[args.model]
    for size in sizes:
        try:
            video_size(size, base)
        except ValueError as e:
            parser.error(f"--sizes: {e}")
    layers = base["num_layers"]
    if args.layers is None:
        layer_points = [layers]
    if layers not in layer_points and len(layer_points) < 2:
        parser.error(f"--layers: two block counts to extrapolate from, or {layers}")
    started = datetime.datetime.now(datetime.UTC)
    t0 = time.perf_counter()
    results, vae, runs = {}, {}, []
    if args.from_json:
        for path in args.from_json:
            raw = json.loads(path.read_text())
            cells = raw.get("cells", raw)  # files of the first version held the cells alone
            for key, points in cells.items():
                size, name = key.split("/", 1)
                results[(size, name)] = {int(k): v for k, v in points.items()}
            vae.update(raw.get("vae", {}))
            runs.append(
                raw.get("run")
                or f"{datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.UTC):%Y-%m-%d %H:%M} UTC"
            )
        names = list(dict.fromkeys(name for _, name in results))
        sizes = list(dict.fromkeys(size for size, _ in results))
        layer_points = sorted({k for points in results.values() for k in points})
    else:
        for size in sizes:
            for name in names:
                results[(size, name)] = {n: measure_cell(base, name, size, n) for n in layer_points}
                if args.json:  # as it goes: a run cut short keeps its cells (--from-json renders them)
                    cells = {f"{s}/{n}": {str(k): v for k, v in p.items()} for (s, n), p in results.items()}
                    args.json.write_text(json.dumps({"cells": cells, "run": f"{started:%Y-%m-%d %H:%M} UTC"}))
    for size in sizes:
        if size not in vae:
            vae[size] = vae_decode_memory(size, base)
    rest = {name: at_rest(base, name) for name in names}
    load = os.getloadavg()[0]
    if not runs:
        runs.append(f"{started:%Y-%m-%d %H:%M} UTC, {time.perf_counter() - t0:.0f} s, load {load:.1f}")
    if args.json:
        cells = {f"{s}/{n}": {str(k): v for k, v in p.items()} for (s, n), p in results.items()}
        args.json.write_text(json.dumps({"cells": cells, "vae": vae, "run": runs[0]}, indent=1))
    scheduler = scheduler_name(args.default_scheduler)
    text = "\n".join(
        [
            f"{title} shapes; {len(jax.devices())} host CPU devices, jax {jax.__version__}, XLA:CPU "
            f"{scheduler} scheduler; measured {'; '.join(runs)}. " + fits_rule(),
            "",
            *tables(results, rest, vae, layer_points, layers, video_of(base)["frames"]),
        ]
    )
    print(text)
    if args.write_docs:
        write_docs_section(DOCS, *markers(args.model), text)


if __name__ == "__main__":
    main()

"""Our Flux pipeline against diffusers' FluxPipeline (PyTorch, CPU) on the same weights, config and threads.

    python bench/flux_vs_diffusers.py [--size 512] [--width 256] [--double 2] [--single 4] [--text-len 128]
                                      [--steps 4] [--repeats 3] [--rounds 3] [--threads 2]

Builds one small random Flux checkpoint with diffusers (FluxTransformer2DModel with `--double` double and
`--single` single blocks of `--width` channels in heads of 64, guidance embedding (a "dev" type); a T5 v1.1
encoder and a CLIP text encoder, both small; a four-level VAE (factor 8, 16 latent channels): at 512x512 the
transformer sees 32 x 32 = 1024 image tokens + `--text-len` text tokens), then measures each side in its own
process (XLA's thread pool and torch's threads would otherwise compete), pinned to the same `--threads` CPUs
(sched_setaffinity; torch.set_num_threads as well). True CFG on both sides (negative prompt,
true_cfg_scale 2: two transformer passes per step; diffusers runs them one after the other, we run them as
one batch of 2), guidance 3.5, fp32, the same packed latents. The sides alternate for `--rounds` rounds;
every figure is the median over rounds with its min-max, each speed-up the median of the per-round ratios.

Measured: one true-CFG denoise step called alone (both transformer passes + combine + Euler update, one call
from Python), one step inside a generation ((whole - 1-step whole) / (steps - 1)), whole generations of
`--steps` and of 1 step, the VAE decode, our compile time; and for our step its FLOPs (XLA's
`cost_analysis()` of the compiled step, and an analytic count of its matmuls and attention) over its time,
against a plain JAX fp32 matmul's rate measured in the same process, right before.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "a photo of a cat and a dog"
NEGATIVE = "blurry"
GUIDANCE, TRUE_CFG = 3.5, 2.0
HEAD_DIM = 64
# FLUX.1-dev's scheduler_config.json (dynamic shift).
SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)
VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[32, 32, 64, 64],
    layers_per_block=1,
    norm_num_groups=32,
    latent_channels=16,
    sample_size=512,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
CLIP = dict(
    hidden_size=64,
    intermediate_size=256,
    num_attention_heads=4,
    num_hidden_layers=2,
    hidden_act="quick_gelu",
    projection_dim=64,
    max_position_embeddings=77,
    layer_norm_eps=1e-5,
)
T5 = dict(
    d_model=128,
    d_kv=32,
    d_ff=256,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
    dropout_rate=0.0,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)


def transformer_config(args) -> dict:
    if args.width % HEAD_DIM:
        raise SystemExit(f"--width must be a multiple of {HEAD_DIM}")
    return dict(
        patch_size=1,
        in_channels=4 * VAE["latent_channels"],
        num_layers=args.double,
        num_single_layers=args.single,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=args.width // HEAD_DIM,
        joint_attention_dim=T5["d_model"],
        pooled_projection_dim=CLIP["projection_dim"],
        guidance_embeds=True,
        axes_dims_rope=[8, 28, 28],
    )


def build_checkpoint(out: Path, args) -> Path:
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import (
        AutoTokenizer,
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTokenizer,
        T5Config,
        T5EncoderModel,
    )

    from meshserve.models.clip_tokenizer import build_tiny_clip_tokenizer
    from meshserve.models.t5_tokenizer import build_tiny_t5_tokenizer

    clip_vocab = build_tiny_clip_tokenizer(out / "_tok")
    t5_vocab = build_tiny_t5_tokenizer(out / "_tok2")
    special = dict(bos_token_id=clip_vocab - 2, eos_token_id=clip_vocab - 1, pad_token_id=clip_vocab - 1)
    torch.manual_seed(0)
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=AutoencoderKL(**VAE),
        text_encoder=CLIPTextModel(CLIPTextConfig(vocab_size=clip_vocab, **special, **CLIP)),
        tokenizer=CLIPTokenizer.from_pretrained(str(out / "_tok")),
        text_encoder_2=T5EncoderModel(T5Config(vocab_size=t5_vocab, **T5)),
        tokenizer_2=AutoTokenizer.from_pretrained(str(out / "_tok2")),
        transformer=FluxTransformer2DModel(**transformer_config(args)),
    )
    pipe.save_pretrained(str(out / "ckpt"), safe_serialization=True)
    return out / "ckpt"


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _grid(size: int) -> int:
    return size // 16  # VAE factor 8 x 2x2 packing


def _latents(size: int):
    import numpy as np

    tokens = _grid(size) ** 2
    return (
        np.random.default_rng(0).standard_normal((1, tokens, 4 * VAE["latent_channels"])).astype(np.float32)
    )


def _pin(threads: int) -> None:
    """Both sides on the same CPUs: XLA sizes its pool from the affinity mask, torch is told as well."""
    cpus = sorted(os.sched_getaffinity(0))
    if threads < len(cpus):
        os.sched_setaffinity(0, cpus[:threads])


def analytic_flops(cfg: dict, image: int, text: int, rows: int) -> float:
    """2 x the multiply-adds of one transformer pass on `rows` rows: every per-token Linear and the
    attention's two matmuls (QK^T and PV over the joint sequence), plus the per-row modulation Linears and
    time/guidance/pooled embedders. Elementwise work (norms, activations, RoPE, softmax) is left out."""
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    s = image + text
    # Per token: a double block's stream (each token is in one) has q, k, v, out (4 d^2) + a 4x MLP (8 d^2);
    # a single block has q, k, v (3 d^2) + proj_mlp (4 d^2) + proj_out over [attn, mlp] (5 d^2).
    per_layer = 12 * d * d * s + 2 * s * s * d
    macs = (cfg["num_layers"] + cfg["num_single_layers"]) * per_layer
    macs += image * cfg["in_channels"] * d * 2 + text * cfg["joint_attention_dim"] * d  # x/context embed, out
    # Per row: AdaLayerNormZero [d, 6d] x 2 streams per double block, [d, 3d] per single, norm_out [d, 2d],
    # timestep and guidance MLPs (256 -> d -> d), the pooled text MLP (P -> d -> d).
    macs_row = cfg["num_layers"] * 12 * d * d + cfg["num_single_layers"] * 3 * d * d + 2 * d * d
    macs_row += 2 * (256 * d + d * d) + cfg["pooled_projection_dim"] * d + d * d
    return 2.0 * rows * (macs + macs_row)


def matmul_rate(n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of a plain jitted fp32 n x n matmul on this process's CPUs (median of `repeats`)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    mm = jax.jit(lambda a, b: a @ b)
    mm(a, b).block_until_ready()
    return 2.0 * n**3 / median_time(lambda: mm(a, b).block_until_ready(), repeats)


def run_ours(ckpt: Path, args) -> dict:
    from meshserve.models.xla_cpu_flags import apply_cpu_defaults

    apply_cpu_defaults()  # as `meshserve` runs: before JAX starts its CPU backend
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from meshserve.models import load_pipeline
    from meshserve.models.transformer_flux import flux_rope, image_ids

    size, steps, text = args.size, args.steps, args.text_len
    latents = _latents(size)
    t0 = time.perf_counter()
    ours = load_pipeline(ckpt, dtype="float32")
    load_s = time.perf_counter() - t0
    kw = dict(
        negative_prompt=NEGATIVE,
        true_cfg_scale=TRUE_CFG,
        guidance_scale=GUIDANCE,
        height=size,
        width=size,
        max_sequence_length=text,
        output_type="np",
    )

    def run(n):
        return ours(PROMPT, latents=latents, num_inference_steps=n, **kw)

    t0 = time.perf_counter()
    first = run(steps)
    first_s = time.perf_counter() - t0
    gen = median_time(lambda: run(steps), args.repeats)
    run(1)  # compiles the 1-step program
    gen_1 = median_time(lambda: run(1), args.repeats)

    # One true-CFG step: the transformer on [negative, positive] + combine + Euler update, one jitted call.
    graph, state = nnx.split(nnx.merge(ours._graphs["transformer"], ours._states["transformer"]))
    cfg = ours.transformer_config
    grid = _grid(size)
    ids = np.concatenate([np.zeros((text, 3), np.float32), image_ids(grid, grid)])
    rope = tuple(jnp.asarray(t) for t in flux_rope(ids, cfg.axes_dims_rope))
    x = jnp.asarray(latents)
    embeds = jnp.zeros((2, text, cfg.joint_attention_dim))
    pooled = jnp.zeros((2, cfg.pooled_projection_dim))
    guidance = jnp.full((2,), GUIDANCE, jnp.float32)

    def cfg_step(state, x, sigma, sigma_next):
        model = nnx.merge(graph, state)
        rows = jnp.concatenate([x, x])
        v = model(rows, embeds, pooled, jnp.broadcast_to(sigma, (2,)), rope, guidance)
        v = v[:1] + TRUE_CFG * (v[1:] - v[:1])
        return x + (sigma_next - sigma) * v

    sigma, sigma_next = jnp.float32(0.9), jnp.float32(0.8)
    compiled = jax.jit(cfg_step).lower(state, x, sigma, sigma_next).compile()
    compiled(state, x, sigma, sigma_next).block_until_ready()
    rate = matmul_rate()
    step = median_time(
        lambda: compiled(state, x, sigma, sigma_next).block_until_ready(), max(5, args.repeats)
    )
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    xla_flops = float(cost.get("flops", float("nan"))) if cost else float("nan")

    vae_graph, vae_state = nnx.split(nnx.merge(ours._graphs["vae"], ours._states["vae"]))
    z = jnp.zeros((1, size // 8, size // 8, VAE["latent_channels"]), jnp.float32)
    decode = jax.jit(lambda state, z: nnx.merge(vae_graph, state).decode(z))
    decode(vae_state, z).block_until_ready()
    vae = median_time(lambda: decode(vae_state, z).block_until_ready(), max(5, args.repeats))
    np.save(args.images, first.images)
    params = sum(v.size for v in jax.tree.leaves(ours._states["transformer"]))
    return {
        "step": step,
        "vae": vae,
        "gen": gen,
        "gen_1": gen_1,
        "compile": first_s - gen,
        "load": load_s,
        "params": int(params),
        "xla_flops": xla_flops,
        "analytic_flops": analytic_flops(transformer_config(args), grid * grid, text, rows=2),
        "matmul_rate": rate,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "threads": len(os.sched_getaffinity(0)),
    }


def run_diffusers(ckpt: Path, args) -> dict:
    import numpy as np
    import torch
    from diffusers import FluxPipeline

    torch.set_num_threads(args.threads)
    size, steps, text = args.size, args.steps, args.text_len
    latents = torch.from_numpy(_latents(size))
    ref = FluxPipeline.from_pretrained(str(ckpt), torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    kw = dict(
        negative_prompt=NEGATIVE,
        true_cfg_scale=TRUE_CFG,
        guidance_scale=GUIDANCE,
        height=size,
        width=size,
        max_sequence_length=text,
        output_type="np",
    )

    def run(n):
        return ref(PROMPT, latents=latents, num_inference_steps=n, **kw)

    with torch.inference_mode():
        images = run(steps).images
        gen = median_time(lambda: run(steps), args.repeats)
        gen_1 = median_time(lambda: run(1), args.repeats)

        cfg = ref.transformer.config
        grid = _grid(size)
        img_ids = FluxPipeline._prepare_latent_image_ids(1, grid, grid, "cpu", torch.float32)
        txt_ids = torch.zeros(text, 3)
        embeds = torch.zeros(1, text, cfg.joint_attention_dim)
        neg_embeds = torch.zeros(1, text, cfg.joint_attention_dim)
        pooled = torch.zeros(1, cfg.pooled_projection_dim)
        guidance = torch.full((1,), GUIDANCE)
        sigma, sigma_next = torch.tensor([0.9]), torch.tensor([0.8])

        def cfg_step():
            # As FluxPipeline's loop with true CFG: the positive pass, the negative pass, the combine, then
            # the scheduler's Euler update (x + (sigma_next - sigma) v).
            common = dict(
                timestep=sigma, guidance=guidance, txt_ids=txt_ids, img_ids=img_ids, return_dict=False
            )
            pos = ref.transformer(
                hidden_states=latents, encoder_hidden_states=embeds, pooled_projections=pooled, **common
            )[0]
            neg = ref.transformer(
                hidden_states=latents, encoder_hidden_states=neg_embeds, pooled_projections=pooled, **common
            )[0]
            v = neg + TRUE_CFG * (pos - neg)
            return latents + (sigma_next - sigma) * v

        cfg_step()
        step = median_time(cfg_step, max(5, args.repeats))
        z = torch.zeros(1, VAE["latent_channels"], size // 8, size // 8)
        ref.vae.decode(z)
        vae = median_time(lambda: ref.vae.decode(z), max(5, args.repeats))
    np.save(args.images, images)
    return {"step": step, "vae": vae, "gen": gen, "gen_1": gen_1, "threads": torch.get_num_threads()}


def main() -> None:
    import json
    import subprocess

    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=512, help="image side (512: 1024 image tokens)")
    ap.add_argument("--width", type=int, default=256, help="transformer width (heads of 64)")
    ap.add_argument("--double", type=int, default=2, help="double-stream blocks")
    ap.add_argument("--single", type=int, default=4, help="single-stream blocks")
    ap.add_argument("--text-len", type=int, default=128, help="T5 max_sequence_length (text tokens)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of each side; median and min-max")
    ap.add_argument("--side", choices=["ours", "diffusers"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--images", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.size % 16:
        ap.error("--size must be a multiple of 16 (VAE factor 8 x 2x2 packing)")

    if args.side:  # a child process: one side, result as JSON on the last line
        _pin(args.threads)
        result = (run_ours if args.side == "ours" else run_diffusers)(Path(args.ckpt), args)
        print(json.dumps(result))
        return

    tmp = Path(tempfile.mkdtemp(prefix="meshserve-flux-bench-"))
    ckpt = build_checkpoint(tmp, args)
    started, load_before = datetime.datetime.now(datetime.UTC), os.getloadavg()
    runs = {"ours": [], "diffusers": []}
    for r in range(args.rounds):
        for side in ("ours", "diffusers") if r % 2 == 0 else ("diffusers", "ours"):
            cmd = [
                sys.executable,
                __file__,
                "--side",
                side,
                "--ckpt",
                str(ckpt),
                "--images",
                str(tmp / f"{side}.npy"),
            ]
            for flag in ("size", "width", "double", "single", "text_len", "steps", "repeats", "threads"):
                cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{side} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
            runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
    load_after = os.getloadavg()
    for (
        rs
    ) in runs.values():  # a step as the generation runs it: what one more step adds, loop overhead included
        for r in rs:
            r["in_gen"] = (r["gen"] - r["gen_1"]) / max(args.steps - 1, 1)
    ours, ref = runs["ours"], runs["diffusers"]
    err = float(np.abs(np.load(tmp / "ours.npy") - np.load(tmp / "diffusers.npy")).max())
    grid = _grid(args.size)
    print(
        f"\n{started:%Y-%m-%d %H:%M} UTC, {_cpu_name()}, {os.cpu_count()} cores, load average "
        f"{load_before[0]:.2f} before / {load_after[0]:.2f} after (1 min)\n"
        f"Flux-shaped model: transformer {ours[0]['params'] / 1e6:.1f} M parameters ({args.double} double + "
        f"{args.single} single blocks, width {args.width}, {args.width // HEAD_DIM} heads of {HEAD_DIM}), "
        f"{args.size}x{args.size} = {grid * grid} image + {args.text_len} text tokens, {args.steps} steps, "
        f"true CFG {TRUE_CFG} (two passes), guidance {GUIDANCE}, fp32; threads: ours {ours[0]['threads']}, "
        f"diffusers {ref[0]['threads']}; each side in its own process, {args.rounds} alternating rounds "
        f"(median, min-max over rounds); our XLA_FLAGS={ours[0]['xla_flags']!r}; "
        f"max |ours - diffusers| pixel = {err:.1e}; our load {statistics.median(r['load'] for r in ours):.1f}s\n"
    )
    print("| measure | meshserve (JAX) | diffusers (PyTorch) | speed-up, per-round ratios |")
    print("|---|---|---|---|")
    rows = [
        ("one true-CFG denoise step, called alone", "step", 1e3, "ms"),
        ("one step inside a generation, (whole - 1-step whole) / (steps - 1)", "in_gen", 1e3, "ms"),
        (f"whole generation, {args.steps} steps (median of {args.repeats} per round)", "gen", 1, "s"),
        ("whole generation, 1 step", "gen_1", 1, "s"),
        ("VAE decode", "vae", 1e3, "ms"),
    ]
    cells = []
    for name, key, scale, unit in rows:
        a = [r[key] * scale for r in ours]
        b = [r[key] * scale for r in ref]
        ratio = [y / x for x, y in zip(a, b, strict=True)]
        fmt = ".2f" if unit == "s" else ".1f"
        print(f"| {name} | {_spread(a, fmt)} {unit} | {_spread(b, fmt)} {unit} | {_spread(ratio, '.2f')}x |")
        cells.append(
            f"{statistics.median(a):{fmt}} / {statistics.median(b):{fmt}} {unit} "
            f"(**{statistics.median(ratio):.2f}x**, {min(ratio):.2f}-{max(ratio):.2f})"
        )
    compile_s = [r["compile"] for r in ours]
    print(f"| compile (first call - steady call) | {_spread(compile_s, '.1f')} s | n/a | |")

    # Achieved FLOP/s of our step against the plain matmul rate of the same process.
    gflops = [r["xla_flops"] / r["step"] / 1e9 for r in ours]
    analytic = [r["analytic_flops"] / r["step"] / 1e9 for r in ours]
    mm = [r["matmul_rate"] / 1e9 for r in ours]
    share = [r["analytic_flops"] / r["step"] / r["matmul_rate"] for r in ours]
    print(
        f"\nOur step: {ours[0]['xla_flops'] / 1e9:.2f} GFLOP by XLA's cost_analysis, "
        f"{ours[0]['analytic_flops'] / 1e9:.2f} GFLOP analytic (matmuls + attention); achieved "
        f"{_spread(gflops, '.1f')} GFLOP/s (cost_analysis) / {_spread(analytic, '.1f')} GFLOP/s (analytic); "
        f"plain fp32 2048^3 matmul in the same process {_spread(mm, '.1f')} GFLOP/s; step at "
        f"{_spread([100 * s for s in share], '.0f')} % of the matmul rate (analytic FLOPs)."
    )
    print("\nbench/README.md row (ours / diffusers, median speed-up, its min-max over rounds):\n")
    print(
        f"| {args.size}x{args.size}, width {args.width}, {args.double}+{args.single} blocks, text "
        f"{args.text_len} ({ours[0]['params'] / 1e6:.1f} M) | "
        + " | ".join(cells)
        + f" | {statistics.median(analytic):.1f} GFLOP/s ({statistics.median(share) * 100:.0f} % of "
        f"{statistics.median(mm):.1f}) | {statistics.median(compile_s):.1f} s | {started:%Y-%m-%d}, "
        f"load {load_before[0]:.1f}/{load_after[0]:.1f} |"
    )


def _spread(values: list[float], fmt: str) -> str:
    """'median (min-max)' over rounds."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()

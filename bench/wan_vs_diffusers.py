"""Our Wan 2.1 pipeline against diffusers' WanPipeline (PyTorch, CPU) on the same weights, config and threads.

    python bench/wan_vs_diffusers.py [--height 256] [--width 320] [--frames 9] [--dim 256] [--layers 4]
                                     [--ffn 704] [--steps 4] [--repeats 3] [--rounds 3] [--threads 2]

Builds one small random Wan 2.1 checkpoint with diffusers (WanTransformer3DModel with `--layers` blocks of
`--dim` channels in heads of 128 as Wan's, FFN `--ffn` (Wan's ratio 13824 / 5120 = 2.7), patch (1, 2, 2), 16
latent channels, RoPE tables of the real 1024 positions; a small UMT5 encoder (text_dim 128); a small
AutoencoderKLWan with Wan 2.1's temporal layout (x4 in time, x8 in space, 16 latent channels); Wan 2.1's UniPC
scheduler config, flow_shift 3). 9 frames at 256x320 are 3 latent frames of 32 x 40, 3 x 16 x 20 = 960 video
tokens, + 512 text tokens (Wan's max_sequence_length) in the cross-attention. Each side is measured in its own
process (XLA's thread pool and torch's threads would otherwise compete), pinned to the same `--threads` CPUs
(sched_setaffinity; torch.set_num_threads as well). CFG on both sides (guidance 5, negative prompt: two
transformer passes per step; diffusers runs them one after the other, we run them as one batch of 2), fp32, the
same initial latents. The sides alternate for `--rounds` rounds; every figure is the median over rounds with
its min-max, each speed-up the median of the per-round ratios.

Measured: one CFG denoise step called alone (both transformer passes + combine + a flow update
x + (sigma_next - sigma) v, one call from Python), one step inside a generation ((whole - 1-step whole) /
(steps - 1), UniPC's update included), whole generations of `--steps` and of 1 step (UMT5, the loop, the VAE
decode), the VAE decode alone, our compile time; and for our step its FLOPs (XLA's `cost_analysis()` and an
analytic count of its matmuls and attention) over its time, against a plain JAX fp32 matmul's rate measured in
the same process, right before.
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

PROMPT = "a cat walking on a beach at sunset"
NEGATIVE = "blurry, low quality"
GUIDANCE = 5.0
HEAD_DIM = 128  # Wan 2.1's (1.3B and 14B)
TEXT = 512  # WanPipeline's max_sequence_length
LATENT_CHANNELS = 16
# Wan 2.1's scheduler_config.json (Wan-AI/Wan2.1-T2V-1.3B-Diffusers): UniPC, flow matching, shift 3.
SCHEDULER = dict(
    prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
)
# AutoencoderKLWan at base_dim 16 (Wan 2.1's is 96) with its temporal layout and 16 latent channels.
VAE = dict(
    base_dim=16,
    z_dim=LATENT_CHANNELS,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
)
UMT5 = dict(
    d_model=128,
    d_kv=32,
    d_ff=256,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    dropout_rate=0.0,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)


def transformer_config(args) -> dict:
    if args.dim % HEAD_DIM:
        raise SystemExit(f"--dim must be a multiple of {HEAD_DIM}")
    return dict(
        patch_size=(1, 2, 2),
        num_attention_heads=args.dim // HEAD_DIM,
        attention_head_dim=HEAD_DIM,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        text_dim=UMT5["d_model"],
        freq_dim=256,
        ffn_dim=args.ffn,
        num_layers=args.layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    )


def build_checkpoint(out: Path, args) -> Path:
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    from meshserve.models.t5_tokenizer import build_tiny_t5_tokenizer

    vocab = build_tiny_t5_tokenizer(out / "_tok")
    torch.manual_seed(0)
    pipe = WanPipeline(
        tokenizer=AutoTokenizer.from_pretrained(str(out / "_tok")),
        text_encoder=UMT5EncoderModel(UMT5Config(vocab_size=vocab, **UMT5)).eval(),
        vae=AutoencoderKLWan(**VAE).eval(),
        scheduler=UniPCMultistepScheduler(**SCHEDULER),
        transformer=WanTransformer3DModel(**transformer_config(args)).eval(),
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


def _latent_shape(args) -> tuple[int, int, int]:
    """(latent frames, rows, columns): the VAE's x4 in time (first frame alone), x8 in space."""
    return (args.frames - 1) // 4 + 1, args.height // 8, args.width // 8


def _tokens(args) -> int:
    t, h, w = _latent_shape(args)
    return t * (h // 2) * (w // 2)


def _latents(args):
    """Diffusers' layout [1, C, T, h, w], fp32."""
    import numpy as np

    shape = (1, LATENT_CHANNELS, *_latent_shape(args))
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def _pin(threads: int) -> None:
    """Both sides on the same CPUs: XLA sizes its pool from the affinity mask, torch is told as well."""
    cpus = sorted(os.sched_getaffinity(0))
    if threads < len(cpus):
        os.sched_setaffinity(0, cpus[:threads])


def analytic_flops(cfg: dict, video: int, text: int, rows: int) -> float:
    """2 x the multiply-adds of one transformer pass on `rows` rows: per block, self-attention q, k, v, out
    (4 d^2 per video token) and its QK^T, PV (2 s^2 d), cross-attention q, out (2 d^2 per video token), k, v
    on the text (2 d^2 per text token) and its two matmuls (2 s text d), the FFN (2 d ffn per token); the
    patch embedding, text and time embedders and the output head. Elementwise work is left out."""
    d, ffn, layers = cfg["num_attention_heads"] * HEAD_DIM, cfg["ffn_dim"], cfg["num_layers"]
    s = video
    per_block = 6 * d * d * s + 2 * s * s * d + 2 * d * d * text + 2 * s * text * d + 2 * d * ffn * s
    patch = LATENT_CHANNELS * 4  # (1, 2, 2) patch x channels
    macs = layers * per_block + s * patch * d * 2  # patch embedding in, proj_out back
    macs += text * (cfg["text_dim"] * d + d * d)  # text embedder (Linear, GELU, Linear)
    macs += cfg["freq_dim"] * d + d * d + d * 6 * d  # time embedder + time_proj, per row
    return 2.0 * rows * macs


def matmul_rate(n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of a plain jitted fp32 n x n matmul on this process's CPUs (median of `repeats`)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    mm = jax.jit(lambda a, b: a @ b)
    mm(a, b).block_until_ready()
    return 2.0 * n**3 / median_time(lambda: mm(a, b).block_until_ready(), repeats)


def _gen_kwargs(args, steps: int) -> dict:
    return dict(
        negative_prompt=NEGATIVE,
        guidance_scale=GUIDANCE,
        height=args.height,
        width=args.width,
        num_frames=args.frames,
        num_inference_steps=steps,
        output_type="np",
    )


def run_ours(ckpt: Path, args) -> dict:
    from meshserve.models.xla_cpu_flags import apply_cpu_defaults

    apply_cpu_defaults()  # as `meshserve` runs: before JAX starts its CPU backend
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from meshserve.models import load_pipeline
    from meshserve.models.transformer_wan import wan_rope

    latents = _latents(args)
    t0 = time.perf_counter()
    ours = load_pipeline(ckpt, dtype="float32")
    load_s = time.perf_counter() - t0

    def run(n):
        return ours(PROMPT, latents=latents, **_gen_kwargs(args, n))

    t0 = time.perf_counter()
    first = run(args.steps)
    first_s = time.perf_counter() - t0
    gen = median_time(lambda: run(args.steps), args.repeats)
    run(1)  # compiles the 1-step program (the schedule differs; the loop's trip count is traced)
    gen_1 = median_time(lambda: run(1), args.repeats)

    # One CFG step: the transformer on [negative, positive] + combine + flow update, one jitted call.
    graph, state = nnx.split(nnx.merge(ours._graphs["transformer"], ours._states["transformer"]))
    cfg = ours.transformer_config
    t, h, w = _latent_shape(args)
    rope = tuple(jnp.asarray(a) for a in wan_rope((t, h // 2, w // 2), HEAD_DIM, cfg.rope_max_seq_len))
    x = jnp.asarray(np.ascontiguousarray(latents.transpose(0, 2, 3, 4, 1)))  # ours: channels last
    embeds = jnp.zeros((2, TEXT, cfg.text_dim))

    def cfg_step(state, x, sigma, sigma_next):
        model = nnx.merge(graph, state)
        rows = jnp.concatenate([x, x])
        v = model(rows, jnp.broadcast_to(sigma * 1000, (2,)), embeds, rope)
        v = v[:1] + GUIDANCE * (v[1:] - v[:1])
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
    z = jnp.zeros((1, t, h, w, LATENT_CHANNELS), jnp.float32)
    decode = jax.jit(lambda state, z: nnx.merge(vae_graph, state).decode(z))
    decode(vae_state, z).block_until_ready()
    vae = median_time(lambda: decode(vae_state, z).block_until_ready(), max(3, args.repeats))
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
        "analytic_flops": analytic_flops(transformer_config(args), _tokens(args), TEXT, rows=2),
        "matmul_rate": rate,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "threads": len(os.sched_getaffinity(0)),
    }


def run_diffusers(ckpt: Path, args) -> dict:
    import numpy as np
    import torch
    from diffusers import WanPipeline

    torch.set_num_threads(args.threads)
    latents = torch.from_numpy(_latents(args))
    ref = WanPipeline.from_pretrained(str(ckpt), torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)

    def run(n):
        return ref(PROMPT, latents=latents, **_gen_kwargs(args, n))

    with torch.inference_mode():
        frames = run(args.steps).frames
        gen = median_time(lambda: run(args.steps), args.repeats)
        gen_1 = median_time(lambda: run(1), args.repeats)

        text_dim = ref.transformer.config.text_dim
        embeds = torch.zeros(1, TEXT, text_dim)
        neg_embeds = torch.zeros(1, TEXT, text_dim)
        sigma, sigma_next = torch.tensor([0.9]), torch.tensor([0.8])
        timestep = sigma * 1000

        def cfg_step():
            # As WanPipeline's loop with CFG: the conditional pass, the unconditional pass, the combine, then
            # a flow update x + (sigma_next - sigma) v.
            cond = ref.transformer(
                hidden_states=latents, timestep=timestep, encoder_hidden_states=embeds, return_dict=False
            )[0]
            uncond = ref.transformer(
                hidden_states=latents, timestep=timestep, encoder_hidden_states=neg_embeds, return_dict=False
            )[0]
            v = uncond + GUIDANCE * (cond - uncond)
            return latents + (sigma_next - sigma) * v

        cfg_step()
        step = median_time(cfg_step, max(5, args.repeats))
        z = torch.zeros(1, LATENT_CHANNELS, *_latent_shape(args))
        ref.vae.decode(z)
        vae = median_time(lambda: ref.vae.decode(z), max(3, args.repeats))
    np.save(args.images, frames)
    return {"step": step, "vae": vae, "gen": gen, "gen_1": gen_1, "threads": torch.get_num_threads()}


def main() -> None:
    import json
    import subprocess

    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--width", type=int, default=320)
    ap.add_argument("--frames", type=int, default=9, help="4k + 1 (9: 3 latent frames)")
    ap.add_argument("--dim", type=int, default=256, help="transformer width (heads of 128)")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks")
    ap.add_argument("--ffn", type=int, default=704, help="FFN hidden units")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of each side; median and min-max")
    ap.add_argument("--side", choices=["ours", "diffusers"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--images", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.height % 16 or args.width % 16:
        ap.error("--height and --width must be multiples of 16 (VAE factor 8 x patch 2)")
    if (args.frames - 1) % 4:
        ap.error("--frames must be 4k + 1 (the VAE's temporal factor)")

    if args.side:  # a child process: one side, result as JSON on the last line
        _pin(args.threads)
        result = (run_ours if args.side == "ours" else run_diffusers)(Path(args.ckpt), args)
        print(json.dumps(result))
        return

    tmp = Path(tempfile.mkdtemp(prefix="meshserve-wan-bench-"))
    ckpt = build_checkpoint(tmp, args)
    started, load_before = datetime.datetime.now(datetime.UTC), os.getloadavg()
    runs = {"ours": [], "diffusers": []}
    flags = ("height", "width", "frames", "dim", "layers", "ffn", "steps", "repeats", "threads")
    for r in range(args.rounds):
        for side in ("ours", "diffusers") if r % 2 == 0 else ("diffusers", "ours"):
            cmd = [sys.executable, __file__, "--side", side, "--ckpt", str(ckpt)]
            cmd += ["--images", str(tmp / f"{side}.npy")]
            for flag in flags:
                cmd += [f"--{flag}", str(getattr(args, flag))]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{side} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
            runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
    load_after = os.getloadavg()
    # A step as the generation runs it: what one more step adds, loop overhead included.
    for rs in runs.values():
        for r in rs:
            r["in_gen"] = (r["gen"] - r["gen_1"]) / max(args.steps - 1, 1)
    ours, ref = runs["ours"], runs["diffusers"]
    err = float(np.abs(np.load(tmp / "ours.npy") - np.load(tmp / "diffusers.npy")).max())
    cfg = transformer_config(args)
    t, h, w = _latent_shape(args)
    print(
        f"\n{started:%Y-%m-%d %H:%M} UTC, {_cpu_name()}, {os.cpu_count()} cores, load average "
        f"{load_before[0]:.2f} before / {load_after[0]:.2f} after (1 min)\n"
        f"Wan-shaped model: transformer {ours[0]['params'] / 1e6:.1f} M parameters ({args.layers} blocks, "
        f"dim {args.dim} = {cfg['num_attention_heads']} heads of {HEAD_DIM}, ffn {args.ffn}), {args.frames} "
        f"frames at {args.width}x{args.height} = {t} x {h // 2} x {w // 2} = {_tokens(args)} video tokens + "
        f"{TEXT} text tokens, {args.steps} UniPC steps, CFG {GUIDANCE} (two passes), fp32; threads: ours "
        f"{ours[0]['threads']}, diffusers {ref[0]['threads']}; each side in its own process, {args.rounds} "
        f"alternating rounds (median, min-max over rounds); our XLA_FLAGS={ours[0]['xla_flags']!r}; "
        f"max |ours - diffusers| pixel = {err:.1e}; our load {statistics.median(r['load'] for r in ours):.1f}s\n"
    )
    print("| measure | meshserve (JAX) | diffusers (PyTorch) | speed-up, per-round ratios |")
    print("|---|---|---|---|")
    rows = [
        ("one CFG denoise step, called alone", "step", 1e3, "ms"),
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
        f"| {args.frames} x {args.width}x{args.height} ({_tokens(args)} tokens), dim {args.dim}, "
        f"{args.layers} blocks ({ours[0]['params'] / 1e6:.1f} M) | "
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

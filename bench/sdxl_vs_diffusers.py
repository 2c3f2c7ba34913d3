"""Our SDXL pipeline against diffusers' (PyTorch, CPU) on the same weights, config and thread count.

    python bench/sdxl_vs_diffusers.py [--width 64] [--size 256] [--steps 10] [--repeats 3] [--rounds 3] [--threads 2]

Builds one small SDXL-shaped checkpoint with diffusers (SDXL's three UNet levels, block types, transformer
depths and heads of dim 64, at base width `--width` instead of 320; two CLIP encoders; a four-level VAE),
then measures each side in its own process (XLA's CPU thread pool and torch's intra-op threads otherwise
compete: measured in one process, diffusers' generation took 34 s instead of 2 s). The sides alternate for
`--rounds` rounds; every figure is the median over rounds with its min-max beside it, and each speed-up
is the median of the per-round ratios (the two sides of one round ran minutes apart, so their ratio is
less exposed to this VM's drift, 10-30 % within minutes, than a ratio of medians). Measured: one CFG
denoise step called alone (UNet on the doubled batch + guidance + scheduler step, one call from Python),
one step inside a generation ((whole generation - 1-step generation) / (steps - 1): a trip of our
compiled loop, a pass of diffusers' Python loop), whole generations of `--steps` and of 1 step, the VAE
decode, and our compile time. Prints the date, the machine and its load average before and after (a load
above the core count means other work shared the cores), a markdown table per measure, and the row for
bench/README.md's table.
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


UNET = dict(
    block_out_channels=(64, 128, 256),
    layers_per_block=2,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(1, 2, 4),  # SDXL's (5, 10, 20) heads of 64 at channels / 5
    transformer_layers_per_block=(1, 2, 2),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=64,
    projection_class_embeddings_input_dim=6 * 64 + 64,
    cross_attention_dim=128,
    in_channels=4,
    out_channels=4,
    sample_size=32,
    norm_num_groups=32,
)
VAE = dict(
    block_out_channels=[32, 64, 128, 128],
    layers_per_block=2,
    latent_channels=4,
    sample_size=256,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=256,
    num_attention_heads=4,
    num_hidden_layers=4,
    projection_dim=64,
    max_position_embeddings=77,
    layer_norm_eps=1e-5,
)


def unet_config(width: int = 64) -> dict:
    """SDXL's UNet at channels x width / 320, SDXL's head counts / 5: heads of 64 at width 64 (SDXL's), 32 at 32."""
    return dict(UNET, block_out_channels=(width, 2 * width, 4 * width))


def vae_config(width: int = 64) -> dict:
    return dict(VAE, block_out_channels=[32, width, 2 * width, 2 * width])  # GroupNorm(32) needs >= 32


def build_checkpoint(out: Path, width: int = 64) -> Path:
    import torch
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    from meshserve.models.clip_tokenizer import build_tiny_clip_tokenizer

    vocab = build_tiny_clip_tokenizer(out / "_tok")
    special = dict(bos_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=vocab - 1)
    torch.manual_seed(0)
    pipe = StableDiffusionXLPipeline(
        unet=UNet2DConditionModel(**unet_config(width)),
        vae=AutoencoderKL(**vae_config(width)),
        text_encoder=CLIPTextModel(
            CLIPTextConfig(vocab_size=vocab, hidden_act="quick_gelu", **special, **TEXT)
        ),
        text_encoder_2=CLIPTextModelWithProjection(
            CLIPTextConfig(vocab_size=vocab, hidden_act="gelu", **special, **TEXT)
        ),
        tokenizer=CLIPTokenizer.from_pretrained(str(out / "_tok")),
        tokenizer_2=CLIPTokenizer.from_pretrained(str(out / "_tok")),
        scheduler=EulerDiscreteScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            timestep_spacing="leading",
            steps_offset=1,
        ),
    )
    pipe.save_pretrained(str(out / "ckpt"))
    return out / "ckpt"


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_ours(ckpt: Path, args) -> dict:
    from meshserve.models.xla_cpu_flags import apply_cpu_defaults

    apply_cpu_defaults()  # as `meshserve` runs: before JAX starts its CPU backend
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from meshserve.models import load_pipeline

    size, steps = args.size, args.steps
    latents = _latents(size)
    t0 = time.perf_counter()
    ours = load_pipeline(ckpt, dtype="float32")
    load_s = time.perf_counter() - t0
    kw = dict(height=size, width=size, num_inference_steps=steps, guidance_scale=5.0, output_type="np")

    def run():
        return ours(PROMPT, latents=latents, **kw)

    t0 = time.perf_counter()
    first = run()
    first_s = time.perf_counter() - t0
    gen = median_time(run, args.repeats)
    ours(PROMPT, latents=latents, **dict(kw, num_inference_steps=1))  # compiles the 1-step program
    gen_1 = median_time(
        lambda: ours(PROMPT, latents=latents, **dict(kw, num_inference_steps=1)), args.repeats
    )

    # One CFG denoise step: the UNet program the loop runs, on the doubled batch, + guidance + scheduler step.
    graph, state = nnx.split(nnx.merge(ours._graphs["unet"], ours._states["unet"]))
    sched = ours.scheduler(None)  # the folder's own (Euler), as the generations above used
    schedule = sched.schedule(steps)
    x = jnp.asarray(np.transpose(latents, (0, 2, 3, 1)))
    emb = jnp.zeros((2, 77, UNET["cross_attention_dim"]))
    pooled = jnp.zeros((2, TEXT["projection_dim"]))
    tids = jnp.tile(jnp.asarray([[size, size, 0, 0, size, size]], jnp.float32), (2, 1))

    @jax.jit
    def cfg_step(state, schedule, x, i):
        unet = nnx.merge(graph, state)
        xin = sched.scale_model_input(schedule, jnp.concatenate([x, x]), i)
        eps = unet(xin, jnp.broadcast_to(schedule.timesteps[i], (2,)), emb, text_embeds=pooled, time_ids=tids)
        u, c = jnp.split(eps, 2)
        out, _ = sched.step(schedule, sched.init_state(x), u + 5.0 * (c - u), x, i, jax.random.key(0))
        return out

    cfg_step(state, schedule, x, 0).block_until_ready()
    step = median_time(lambda: cfg_step(state, schedule, x, 1).block_until_ready(), max(5, args.repeats))

    vae_graph, vae_state = nnx.split(nnx.merge(ours._graphs["vae"], ours._states["vae"]))
    decode = jax.jit(lambda state, z: nnx.merge(vae_graph, state).decode(z))
    decode(vae_state, x).block_until_ready()
    vae = median_time(lambda: decode(vae_state, x).block_until_ready(), max(5, args.repeats))
    np.save(args.images, first.images)
    params = sum(v.size for v in jax.tree.leaves(ours._states["unet"]))
    return {
        "step": step,
        "vae": vae,
        "gen": gen,
        "gen_1": gen_1,
        "compile": first_s - gen,
        "load": load_s,
        "unet_params": int(params),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def run_diffusers(ckpt: Path, args) -> dict:
    import numpy as np
    import torch
    from diffusers import StableDiffusionXLPipeline

    torch.set_num_threads(args.threads)
    size, steps = args.size, args.steps
    latents = torch.from_numpy(_latents(size))
    ref = StableDiffusionXLPipeline.from_pretrained(str(ckpt), torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    kw = dict(height=size, width=size, num_inference_steps=steps, guidance_scale=5.0, output_type="np")

    def run():
        return ref(PROMPT, latents=latents, **kw)

    with torch.inference_mode():
        images = run().images
        gen = median_time(run, args.repeats)
        gen_1 = median_time(
            lambda: ref(PROMPT, latents=latents, **dict(kw, num_inference_steps=1)), args.repeats
        )
        ref.scheduler.set_timesteps(steps)
        emb = torch.zeros(2, 77, UNET["cross_attention_dim"])
        added = {
            "text_embeds": torch.zeros(2, TEXT["projection_dim"]),
            "time_ids": torch.tensor([[size, size, 0, 0, size, size]] * 2, dtype=torch.float32),
        }

        def cfg_step():
            t = ref.scheduler.timesteps[1]
            ref.scheduler._step_index = 1
            xin = ref.scheduler.scale_model_input(torch.cat([latents, latents]), t)
            eps = ref.unet(xin, t, encoder_hidden_states=emb, added_cond_kwargs=added, return_dict=False)[0]
            u, c = eps.chunk(2)
            ref.scheduler._step_index = 1
            return ref.scheduler.step(u + 5.0 * (c - u), t, latents, return_dict=False)[0]

        cfg_step()
        step = median_time(cfg_step, max(5, args.repeats))
        ref.vae.decode(latents)
        vae = median_time(lambda: ref.vae.decode(latents), max(5, args.repeats))
    np.save(args.images, images)
    return {"step": step, "vae": vae, "gen": gen, "gen_1": gen_1}


PROMPT = "a photo of an astronaut riding a horse"


def _latents(size: int):
    import numpy as np

    return np.random.default_rng(0).standard_normal((1, 4, size // 8, size // 8)).astype(np.float32)


def main() -> None:
    import json
    import subprocess

    import numpy as np

    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of each side; median and min-max")
    ap.add_argument("--width", type=int, default=64, help="UNet base channels (SDXL: 320); VAE scaled alike")
    ap.add_argument("--side", choices=["ours", "diffusers"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--images", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.side:  # a child process: one side, result as JSON on the last line
        result = (run_ours if args.side == "ours" else run_diffusers)(Path(args.ckpt), args)
        print(json.dumps(result))
        return

    tmp = Path(tempfile.mkdtemp(prefix="meshserve-bench-"))
    ckpt = build_checkpoint(tmp, args.width)
    started, load_before = datetime.datetime.now(datetime.UTC), os.getloadavg()
    # Rounds alternate which side goes first: this machine's speed drifts by 10-30% over minutes (a shared
    # VM), which one run per side would book to one side.
    runs = {"ours": [], "diffusers": []}
    for r in range(args.rounds):
        for side in ("ours", "diffusers") if r % 2 == 0 else ("diffusers", "ours"):
            cmd = [sys.executable, __file__, "--side", side, "--ckpt", str(ckpt)]
            cmd += [
                "--images",
                str(tmp / f"{side}.npy"),
                "--size",
                str(args.size),
                "--steps",
                str(args.steps),
            ]
            cmd += ["--repeats", str(args.repeats), "--threads", str(args.threads)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{side} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
            runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
    load_after = os.getloadavg()
    for (
        rs
    ) in runs.values():  # a step as the generation runs it: what one more step adds, loop overhead included
        for r in rs:
            r["in_gen"] = (r["gen"] - r["gen_1"]) / (args.steps - 1)
    ours, ref = runs["ours"], runs["diffusers"]
    err = float(np.abs(np.load(tmp / "ours.npy") - np.load(tmp / "diffusers.npy")).max())
    params = ours[0]["unet_params"]
    print(
        f"\n{started:%Y-%m-%d %H:%M} UTC, {_cpu_name()}, {os.cpu_count()} cores, load average "
        f"{load_before[0]:.2f} before / {load_after[0]:.2f} after (1 min)\n"
        f"SDXL-shaped model ({params / 1e6:.1f}M UNet params), {args.size}x{args.size}, "
        f"{args.steps} steps, CFG, fp32, {args.threads} threads, CPU, each side in its own process, "
        f"{args.rounds} alternating rounds (median, min-max over rounds); "
        f"our XLA_FLAGS={ours[0]['xla_flags']!r}; max |ours - diffusers| pixel = {err:.1e}; "
        f"our load {statistics.median(r['load'] for r in ours):.1f}s\n"
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
    print("\nbench/README.md row (ours / diffusers, median speed-up, its min-max over rounds):\n")
    print(
        f"| width {args.width}, {args.size}x{args.size} ({params / 1e6:.1f} M) | "
        + " | ".join(cells)
        + f" | {statistics.median(compile_s):.1f} s | {started:%Y-%m-%d}, "
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

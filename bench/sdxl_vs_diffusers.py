"""Our SDXL pipeline against diffusers' (PyTorch, CPU) on the same weights, config and thread count.

    python bench/sdxl_vs_diffusers.py [--size 256] [--steps 10] [--repeats 3] [--threads 2]

Builds one small SDXL-shaped checkpoint with diffusers (three UNet levels like SDXL, channels / 5, head dim 64,
the same block types and transformer depths pattern), then measures each side in its own process, one after
the other (XLA's CPU thread pool and torch's intra-op threads otherwise compete: measured in one process,
diffusers' generation took 34 s instead of 2 s): the median time of one CFG denoise step (UNet on the
doubled batch + guidance + scheduler step), the median time of a whole generation, and our compile time.
Prints a markdown table (bench/README.md keeps the latest one).
"""

from __future__ import annotations

import argparse
import os
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


def build_checkpoint(out: Path) -> Path:
    import torch
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    from models.clip_tokenizer import build_tiny_clip_tokenizer

    vocab = build_tiny_clip_tokenizer(out / "_tok")
    special = dict(bos_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=vocab - 1)
    torch.manual_seed(0)
    pipe = StableDiffusionXLPipeline(
        unet=UNet2DConditionModel(**UNET),
        vae=AutoencoderKL(**VAE),
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
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from models import load_pipeline

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

    # One CFG denoise step: the UNet program the loop runs, on the doubled batch, + guidance + scheduler step.
    graph, state = nnx.split(nnx.merge(ours._graphs["unet"], ours._states["unet"]))
    sched = ours._scheduler(None)
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
    np.save(args.images, first.images)
    params = sum(v.size for v in jax.tree.leaves(ours._states["unet"]))
    return {"step": step, "gen": gen, "compile": first_s - gen, "load": load_s, "unet_params": int(params)}


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
    np.save(args.images, images)
    return {"step": step, "gen": gen}


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
    ap.add_argument("--side", choices=["ours", "diffusers"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--images", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.side:  # a child process: one side, result as JSON on the last line
        result = (run_ours if args.side == "ours" else run_diffusers)(Path(args.ckpt), args)
        print(json.dumps(result))
        return

    tmp = Path(tempfile.mkdtemp(prefix="meshserve-bench-"))
    ckpt = build_checkpoint(tmp)
    results = {}
    for side in ("ours", "diffusers"):
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
        cmd += ["--size", str(args.size), "--steps", str(args.steps), "--repeats", str(args.repeats)]
        cmd += ["--threads", str(args.threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[side] = json.loads(out.strip().splitlines()[-1])
    ours, ref = results["ours"], results["diffusers"]
    err = float(np.abs(np.load(tmp / "ours.npy") - np.load(tmp / "diffusers.npy")).max())
    print(
        f"\nSDXL-shaped model ({ours['unet_params'] / 1e6:.1f}M UNet params), {args.size}x{args.size}, "
        f"{args.steps} steps, CFG, fp32, {args.threads} threads, CPU, each side in its own process; "
        f"max |ours - diffusers| pixel = {err:.1e}; our load {ours['load']:.1f}s\n"
    )
    print("| measure | meshserve (JAX) | diffusers (PyTorch) | speed-up |")
    print("|---|---|---|---|")
    print(
        f"| one CFG denoise step (median) | {ours['step'] * 1e3:.1f} ms | {ref['step'] * 1e3:.1f} ms "
        f"| {ref['step'] / ours['step']:.2f}x |"
    )
    print(
        f"| whole generation (median of {args.repeats}) | {ours['gen']:.2f} s | {ref['gen']:.2f} s "
        f"| {ref['gen'] / ours['gen']:.2f}x |"
    )
    print(f"| compile (first call - steady call) | {ours['compile']:.1f} s | n/a | |")


if __name__ == "__main__":
    main()

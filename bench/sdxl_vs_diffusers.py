"""Our SDXL pipeline against diffusers' (PyTorch, CPU) on the same weights, config and thread count.

    python bench/sdxl_vs_diffusers.py [--size 256] [--steps 10] [--repeats 3] [--threads 2]

Builds one small SDXL-shaped checkpoint with diffusers (three UNet levels like SDXL, channels / 5, head dim 64,
the same block types and transformer depths pattern), then in one run measures for each side: the median time
of one CFG denoise step (UNet on the doubled batch + guidance + scheduler step), the median time of a whole
generation, and our compile time. Prints a markdown table (bench/README.md keeps the latest one).
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from diffusers import StableDiffusionXLPipeline as TorchSDXL

    from models import load_pipeline

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="meshserve-bench-"))
    ckpt = build_checkpoint(tmp)
    size, steps, prompt = args.size, args.steps, "a photo of an astronaut riding a horse"
    latents = np.random.default_rng(0).standard_normal((1, 4, size // 8, size // 8)).astype(np.float32)

    # --- ours
    t0 = time.perf_counter()
    ours = load_pipeline(ckpt, dtype="float32")
    load_s = time.perf_counter() - t0
    kw = dict(height=size, width=size, num_inference_steps=steps, guidance_scale=5.0, output_type="np")

    def run():
        return ours(prompt, latents=latents, **kw)

    t0 = time.perf_counter()
    first = run()
    first_s = time.perf_counter() - t0
    ours_gen = median_time(run, args.repeats)
    compile_s = first_s - ours_gen

    # One CFG denoise step, ours: the same UNet program the loop runs, on the doubled batch, + guidance + step.
    from flax import nnx

    unet = nnx.merge(ours._graphs["unet"], ours._states["unet"])
    sched = ours._scheduler(None)
    schedule = sched.schedule(steps)
    x = jnp.asarray(np.transpose(latents, (0, 2, 3, 1)))
    emb = jnp.zeros((2, 77, UNET["cross_attention_dim"]))
    pooled = jnp.zeros((2, TEXT["projection_dim"]))
    tids = jnp.tile(jnp.asarray([[size, size, 0, 0, size, size]], jnp.float32), (2, 1))
    graph, state = nnx.split(unet)

    @jax.jit
    def cfg_step(state, x, i):
        unet = nnx.merge(graph, state)
        xin = sched.scale_model_input(schedule, jnp.concatenate([x, x]), i)
        eps = unet(xin, jnp.broadcast_to(schedule.timesteps[i], (2,)), emb, text_embeds=pooled, time_ids=tids)
        u, c = jnp.split(eps, 2)
        out, _ = sched.step(schedule, sched.init_state(x), u + 5.0 * (c - u), x, i, jax.random.key(0))
        return out

    cfg_step(state, x, 0).block_until_ready()
    ours_step = median_time(lambda: cfg_step(state, x, 1).block_until_ready(), max(5, args.repeats))

    # --- diffusers
    ref = TorchSDXL.from_pretrained(str(ckpt), torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)

    def trun():
        return ref(prompt, latents=torch.from_numpy(latents), **kw)

    with torch.inference_mode():
        expected = trun().images
        ref_gen = median_time(trun, args.repeats)
        ref.scheduler.set_timesteps(steps)
        tx = torch.from_numpy(latents)
        temb = torch.zeros(2, 77, UNET["cross_attention_dim"])
        added = {
            "text_embeds": torch.zeros(2, TEXT["projection_dim"]),
            "time_ids": torch.tensor([[size, size, 0, 0, size, size]] * 2, dtype=torch.float32),
        }

        def torch_step():
            t = ref.scheduler.timesteps[1]
            ref.scheduler._step_index = 1
            xin = ref.scheduler.scale_model_input(torch.cat([tx, tx]), t)
            eps = ref.unet(xin, t, encoder_hidden_states=temb, added_cond_kwargs=added, return_dict=False)[0]
            u, c = eps.chunk(2)
            ref.scheduler._step_index = 1
            return ref.scheduler.step(u + 5.0 * (c - u), t, tx, return_dict=False)[0]

        torch_step()
        ref_step = median_time(torch_step, max(5, args.repeats))

    err = float(np.abs(first.images - expected).max())
    print(
        f"\nSDXL-shaped model ({sum(v.size for v in jax.tree.leaves(ours._states['unet'])) / 1e6:.1f}M UNet params), "
        f"{size}x{size}, {steps} steps, CFG, fp32, {args.threads} threads, {jax.devices()[0].platform}; "
        f"max |ours - diffusers| pixel = {err:.1e}; load {load_s:.1f}s\n"
    )
    print("| measure | meshserve (JAX) | diffusers (PyTorch) | speed-up |")
    print("|---|---|---|---|")
    print(
        f"| one CFG denoise step (median) | {ours_step * 1e3:.1f} ms | {ref_step * 1e3:.1f} ms | {ref_step / ours_step:.2f}x |"
    )
    print(
        f"| whole generation (median of {args.repeats}) | {ours_gen:.2f} s | {ref_gen:.2f} s | {ref_gen / ours_gen:.2f}x |"
    )
    print(f"| compile (first call - steady call) | {compile_s:.1f} s | n/a | |")


if __name__ == "__main__":
    main()

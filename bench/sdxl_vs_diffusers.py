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
decode, and our compile time. Both sides are pinned to the same `--threads` CPUs. Prints the date, the
machine and its load average before and after (a load above the core count means other work shared the
cores), a markdown table per measure, and the row for bench/README.md's table. The harness (processes,
pinning, rounds, table, README row) is bench/compare_harness.py's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import compare_harness as harness  # noqa: E402

PROMPT = "a photo of an astronaut riding a horse"

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

    from meshserve.models.components.clip_tokenizer import build_tiny_clip_tokenizer

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


def _latents(size: int):
    import numpy as np

    return np.random.default_rng(0).standard_normal((1, 4, size // 8, size // 8)).astype(np.float32)


def run_ours(ckpt: Path, args) -> tuple[object, dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    size, steps = args.size, args.steps
    latents = _latents(size)
    ours, load_s = harness.load_ours(ckpt)
    kw = dict(height=size, width=size, guidance_scale=5.0, output_type="np")
    first, gens = harness.time_generations(
        lambda n: ours(PROMPT, latents=latents, num_inference_steps=n, **kw), steps, args.repeats
    )

    # One CFG denoise step: the UNet program the loop runs, on the doubled batch, + guidance + scheduler step.
    graph, state = harness.ours_component(ours, "unet")
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
    step = harness.median_time(
        lambda: cfg_step(state, schedule, x, 1).block_until_ready(), max(5, args.repeats)
    )
    return first.images, {
        **gens,
        "step": step,
        "vae": harness.time_ours_decode(ours, x, max(5, args.repeats)),
        "load": load_s,
        "unet_params": harness.ours_parameters(ours, "unet"),
    }


def run_diffusers(ckpt: Path, args) -> tuple[object, dict]:
    import torch
    from diffusers import StableDiffusionXLPipeline

    size, steps = args.size, args.steps
    latents = torch.from_numpy(_latents(size))
    ref = harness.load_diffusers(StableDiffusionXLPipeline, ckpt)
    kw = dict(height=size, width=size, guidance_scale=5.0, output_type="np")

    with torch.inference_mode():
        first, gens = harness.time_generations(
            lambda n: ref(PROMPT, latents=latents, num_inference_steps=n, **kw), steps, args.repeats
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

        step = harness.warm_median(cfg_step, max(5, args.repeats))
        vae = harness.warm_median(lambda: ref.vae.decode(latents), max(5, args.repeats))
    return first.images, {**gens, "step": step, "vae": vae}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--width", type=int, default=64, help="UNet base channels (SDXL: 320); VAE scaled alike")
    harness.add_harness_options(ap)
    args = ap.parse_args()
    if harness.run_side(args, run_ours, run_diffusers):
        return

    def build(folder: Path, args) -> Path:
        return build_checkpoint(folder, args.width)

    rounds = harness.compare(__file__, args, build, ("size", "steps", "repeats", "threads"))
    params = rounds.ours[0]["unet_params"]
    model = (
        f"SDXL-shaped model ({params / 1e6:.1f}M UNet params), {args.size}x{args.size}, "
        f"{args.steps} steps, CFG, fp32, CPU"
    )
    config = f"width {args.width}, {args.size}x{args.size} ({params / 1e6:.1f} M)"
    harness.report(rounds, args, model, "one CFG denoise step, called alone", config)


if __name__ == "__main__":
    main()

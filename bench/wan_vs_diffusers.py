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
the same process, right before. The harness (processes, pinning, rounds, table, README row) is
bench/compare_harness.py's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import compare_harness as harness  # noqa: E402

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

    from meshserve.models.components.t5_tokenizer import build_tiny_t5_tokenizer

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


def run_ours(ckpt: Path, args) -> tuple[object, dict]:
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from meshserve.models.wan.transformer_wan import wan_rope

    latents = _latents(args)
    ours, load_s = harness.load_ours(ckpt)
    first, gens = harness.time_generations(
        lambda n: ours(PROMPT, latents=latents, **_gen_kwargs(args, n)), args.steps, args.repeats
    )

    # One CFG step: the transformer on [negative, positive] + combine + flow update, one jitted call.
    graph, state = harness.ours_component(ours, "transformer")
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

    step = harness.time_ours_flow_step(cfg_step, state, x, args.repeats)
    z = jnp.zeros((1, t, h, w, LATENT_CHANNELS), jnp.float32)
    return first.images, {
        **gens,
        **step,
        "vae": harness.time_ours_decode(ours, z, max(3, args.repeats)),
        "load": load_s,
        "params": harness.ours_parameters(ours, "transformer"),
        "analytic_flops": analytic_flops(transformer_config(args), _tokens(args), TEXT, rows=2),
    }


def run_diffusers(ckpt: Path, args) -> tuple[object, dict]:
    import torch
    from diffusers import WanPipeline

    latents = torch.from_numpy(_latents(args))
    ref = harness.load_diffusers(WanPipeline, ckpt)

    with torch.inference_mode():
        first, gens = harness.time_generations(
            lambda n: ref(PROMPT, latents=latents, **_gen_kwargs(args, n)), args.steps, args.repeats
        )

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

        step = harness.warm_median(cfg_step, max(5, args.repeats))
        z = torch.zeros(1, LATENT_CHANNELS, *_latent_shape(args))
        vae = harness.warm_median(lambda: ref.vae.decode(z), max(3, args.repeats))
    return first.frames, {**gens, "step": step, "vae": vae}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--width", type=int, default=320)
    ap.add_argument("--frames", type=int, default=9, help="4k + 1 (9: 3 latent frames)")
    ap.add_argument("--dim", type=int, default=256, help="transformer width (heads of 128)")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks")
    ap.add_argument("--ffn", type=int, default=704, help="FFN hidden units")
    ap.add_argument("--steps", type=int, default=4)
    harness.add_harness_options(ap)
    args = ap.parse_args()
    if args.height % 16 or args.width % 16:
        ap.error("--height and --width must be multiples of 16 (VAE factor 8 x patch 2)")
    if (args.frames - 1) % 4:
        ap.error("--frames must be 4k + 1 (the VAE's temporal factor)")
    if harness.run_side(args, run_ours, run_diffusers):
        return

    flags = ("height", "width", "frames", "dim", "layers", "ffn", "steps", "repeats", "threads")
    rounds = harness.compare(__file__, args, build_checkpoint, flags)
    ours = rounds.ours
    cfg = transformer_config(args)
    t, h, w = _latent_shape(args)
    model = (
        f"Wan-shaped model: transformer {ours[0]['params'] / 1e6:.1f} M parameters ({args.layers} blocks, "
        f"dim {args.dim} = {cfg['num_attention_heads']} heads of {HEAD_DIM}, ffn {args.ffn}), {args.frames} "
        f"frames at {args.width}x{args.height} = {t} x {h // 2} x {w // 2} = {_tokens(args)} video tokens + "
        f"{TEXT} text tokens, {args.steps} UniPC steps, CFG {GUIDANCE} (two passes), fp32"
    )
    config = (
        f"{args.frames} x {args.width}x{args.height} ({_tokens(args)} tokens), dim {args.dim}, "
        f"{args.layers} blocks ({ours[0]['params'] / 1e6:.1f} M)"
    )
    harness.report(rounds, args, model, "one CFG denoise step, called alone", config)


if __name__ == "__main__":
    main()

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
against a plain JAX fp32 matmul's rate measured in the same process, right before. The harness (processes,
pinning, rounds, table, README row) is bench/compare_harness.py's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import compare_harness as harness  # noqa: E402

PROMPT = "a photo of a cat and a dog"
NEGATIVE = "blurry"
GUIDANCE, TRUE_CFG = 3.5, 2.0
HEAD_DIM = 64
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
    return write_checkpoint(out, transformer_config(args))


def write_checkpoint(
    out: Path,
    transformer: dict,
    *,
    vae: dict = VAE,
    clip: dict = CLIP,
    t5: dict = T5,
    dtype=None,
    device="cpu",
) -> Path:
    """A random FluxPipeline folder, `out`/ckpt, as diffusers writes one: these configs (seed 0) built in `dtype`
    (None: torch's default) on `device`, the tests' tiny tokenizers (whose ids any larger vocabulary takes),
    FLUX.1-dev's scheduler. Also bench/gpu_vs_diffusers.py's real-size pipeline."""
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

    from meshserve.models.components.clip_tokenizer import build_tiny_clip_tokenizer
    from meshserve.models.components.t5_tokenizer import build_tiny_t5_tokenizer
    from meshserve.models.flux.random_tiny import SCHEDULER  # FLUX.1-dev's scheduler_config.json

    clip_vocab = build_tiny_clip_tokenizer(out / "_tok")
    t5_vocab = build_tiny_t5_tokenizer(out / "_tok2")
    special = dict(bos_token_id=clip_vocab - 2, eos_token_id=clip_vocab - 1, pad_token_id=clip_vocab - 1)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype or default)
    try:
        with torch.device(device):
            pipe = FluxPipeline(
                scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
                vae=AutoencoderKL(**vae),
                text_encoder=CLIPTextModel(CLIPTextConfig(vocab_size=clip_vocab, **special, **clip)),
                tokenizer=CLIPTokenizer.from_pretrained(str(out / "_tok")),
                text_encoder_2=T5EncoderModel(T5Config(vocab_size=t5_vocab, **t5)),
                tokenizer_2=AutoTokenizer.from_pretrained(str(out / "_tok2")),
                transformer=FluxTransformer2DModel(**transformer),
            )
    finally:
        torch.set_default_dtype(default)
    pipe.save_pretrained(str(out / "ckpt"), safe_serialization=True)
    return out / "ckpt"


def _grid(size: int) -> int:
    return size // 16  # VAE factor 8 x 2x2 packing


def _latents(size: int):
    import numpy as np

    tokens = _grid(size) ** 2
    return (
        np.random.default_rng(0).standard_normal((1, tokens, 4 * VAE["latent_channels"])).astype(np.float32)
    )


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


def _generation_kwargs(args) -> dict:
    return dict(
        negative_prompt=NEGATIVE,
        true_cfg_scale=TRUE_CFG,
        guidance_scale=GUIDANCE,
        height=args.size,
        width=args.size,
        max_sequence_length=args.text_len,
        output_type="np",
    )


def run_ours(ckpt: Path, args) -> tuple[object, dict]:
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from meshserve.models.flux.transformer_flux import flux_rope, image_ids

    size, text = args.size, args.text_len
    latents = _latents(size)
    ours, load_s = harness.load_ours(ckpt)
    kw = _generation_kwargs(args)
    first, gens = harness.time_generations(
        lambda n: ours(PROMPT, latents=latents, num_inference_steps=n, **kw), args.steps, args.repeats
    )

    # One true-CFG step: the transformer on [negative, positive] + combine + Euler update, one jitted call.
    graph, state = harness.ours_component(ours, "transformer")
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

    step = harness.time_ours_flow_step(cfg_step, state, x, args.repeats)
    z = jnp.zeros((1, size // 8, size // 8, VAE["latent_channels"]), jnp.float32)
    return first.images, {
        **gens,
        **step,
        "vae": harness.time_ours_decode(ours, z, max(5, args.repeats)),
        "load": load_s,
        "params": harness.ours_parameters(ours, "transformer"),
        "analytic_flops": analytic_flops(transformer_config(args), grid * grid, text, rows=2),
    }


def run_diffusers(ckpt: Path, args) -> tuple[object, dict]:
    import torch
    from diffusers import FluxPipeline

    size, text = args.size, args.text_len
    latents = torch.from_numpy(_latents(size))
    ref = harness.load_diffusers(FluxPipeline, ckpt)
    kw = _generation_kwargs(args)

    with torch.inference_mode():
        first, gens = harness.time_generations(
            lambda n: ref(PROMPT, latents=latents, num_inference_steps=n, **kw), args.steps, args.repeats
        )

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

        step = harness.warm_median(cfg_step, max(5, args.repeats))
        z = torch.zeros(1, VAE["latent_channels"], size // 8, size // 8)
        vae = harness.warm_median(lambda: ref.vae.decode(z), max(5, args.repeats))
    return first.images, {**gens, "step": step, "vae": vae}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=512, help="image side (512: 1024 image tokens)")
    ap.add_argument("--width", type=int, default=256, help="transformer width (heads of 64)")
    ap.add_argument("--double", type=int, default=2, help="double-stream blocks")
    ap.add_argument("--single", type=int, default=4, help="single-stream blocks")
    ap.add_argument("--text-len", type=int, default=128, help="T5 max_sequence_length (text tokens)")
    ap.add_argument("--steps", type=int, default=4)
    harness.add_harness_options(ap)
    args = ap.parse_args()
    if args.size % 16:
        ap.error("--size must be a multiple of 16 (VAE factor 8 x 2x2 packing)")
    if harness.run_side(args, run_ours, run_diffusers):
        return

    flags = ("size", "width", "double", "single", "text_len", "steps", "repeats", "threads")
    rounds = harness.compare(__file__, args, build_checkpoint, flags)
    ours = rounds.ours
    grid = _grid(args.size)
    model = (
        f"Flux-shaped model: transformer {ours[0]['params'] / 1e6:.1f} M parameters ({args.double} double + "
        f"{args.single} single blocks, width {args.width}, {args.width // HEAD_DIM} heads of {HEAD_DIM}), "
        f"{args.size}x{args.size} = {grid * grid} image + {args.text_len} text tokens, {args.steps} steps, "
        f"true CFG {TRUE_CFG} (two passes), guidance {GUIDANCE}, fp32"
    )
    config = (
        f"{args.size}x{args.size}, width {args.width}, {args.double}+{args.single} blocks, text "
        f"{args.text_len} ({ours[0]['params'] / 1e6:.1f} M)"
    )
    harness.report(rounds, args, model, "one true-CFG denoise step, called alone", config)


if __name__ == "__main__":
    main()

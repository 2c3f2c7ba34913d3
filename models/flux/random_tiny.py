"""A random tiny Flux: a Flux.1-dev-architecture checkpoint with random weights, made deterministically on first use.

The tests' dev-type Flux checkpoint (the shipped "tiny-flux" is trained and schnell-type: models/flux/embedded.py). No
download, no torch: the weights come from our own NNX modules (shapes only) filled by numpy from a fixed seed,
written as an ordinary diffusers FluxPipeline folder (model_index.json, configs, safetensors in PyTorch layout, CLIP and T5
tokenizers built offline), so it goes through exactly the loading path a real checkpoint takes, and diffusers'
FluxPipeline.from_pretrained opens it too. It has the guidance embedding (a tiny "dev") and FLUX.1-dev's scheduler
config; it draws noise-like colour at 64x64 (the VAE's sample_size).

The configs below are also what the tests' diffusers-built checkpoints use (tests/fixtures/tiny_flux.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshserve.models.checkpoints.embedded_folder import (
    RandomComponent,
    cached_model_folder,
    clip_text_config,
    write_pipeline_folder,
)
from meshserve.models.components.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig
from meshserve.models.components.clip import CLIPTextConfig, CLIPTextModel
from meshserve.models.components.clip_tokenizer import build_tiny_clip_tokenizer
from meshserve.models.components.t5 import T5Config, T5EncoderModel
from meshserve.models.components.t5_tokenizer import build_tiny_t5_tokenizer
from meshserve.models.flux.transformer_flux import FluxTransformer2DConfig, FluxTransformer2DModel

VERSION = "tiny-flux-v1"  # bump when anything below changes: the cache folder is keyed by it

# 4 heads of 16 (so tensor=2/4 and Ulysses-4 layouts divide), 2 double + 2 single blocks; in_channels is the
# VAE's 4 latent channels x the 2x2 packing; the text dims are the two tiny encoders' widths.
TRANSFORMER = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    guidance_embeds=True,
    axes_dims_rope=[4, 6, 6],
)
# FLUX.1's VAE layout (no quant convs, scaling and shift factors) at 2 blocks: factor 2, so 64x64 px images
# are 32x32 latents and 16x16 = 256 packed tokens.
VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
    up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
    block_out_channels=[16, 32],
    layers_per_block=1,
    norm_num_groups=8,
    latent_channels=4,
    sample_size=64,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
# CLIPTextModel (Flux reads its pooled output only): hidden 32 = the transformer's pooled_projection_dim.
TEXT_ENCODER = dict(
    hidden_size=32,
    intermediate_size=37,
    num_attention_heads=4,
    num_hidden_layers=2,
    hidden_act="quick_gelu",
    projection_dim=32,
    max_position_embeddings=77,
    layer_norm_eps=1e-5,
)
# T5 v1.1 (gated GELU) at d_model 32 = the transformer's joint_attention_dim; the vocabulary is the tiny
# tokenizer's (models/components/t5_tokenizer.py).
T5 = dict(
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
    dropout_rate=0.0,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)
# FLUX.1-dev's scheduler_config.json (dynamic shift from the image size).
SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)
# FLUX.1-schnell's: static shift 1 (for the tests' schnell-type checkpoint).
SCHNELL_SCHEDULER = dict(SCHEDULER, shift=1.0, use_dynamic_shifting=False)


def random_flux_path() -> Path:
    """The random tiny Flux's folder, built on first use and reused after (under the model cache root)."""
    return cached_model_folder(VERSION, write_random_flux)


def join_single_proj_out(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our single blocks' two proj_out parts -> the checkpoint's one `proj_out.weight` [dim, inner + mlp]
    (models/transformer_flux.split_single_proj_out inverted)."""
    out = {}
    for key, value in weights.items():
        if key.endswith(".proj_out.from_mlp.weight"):
            continue
        if key.endswith(".proj_out.from_attn.weight"):
            stem = key[: -len(".from_attn.weight")]
            value = np.concatenate([value, weights[f"{stem}.from_mlp.weight"]], axis=1)
            key = f"{stem}.weight"
        out[key] = value
    return out


def write_random_flux(out: Path, seed: int = 0) -> Path:
    """The folder as the real FLUX.1 ones are (their model_index.json's classes)."""
    out = Path(out)
    clip_vocab = build_tiny_clip_tokenizer(out / "tokenizer")
    t5_vocab = build_tiny_t5_tokenizer(out / "tokenizer_2")
    t5_raw = {
        "architectures": ["T5EncoderModel"],
        "model_type": "t5",
        "vocab_size": t5_vocab,
        "is_encoder_decoder": True,
        **T5,
    }
    components = [
        RandomComponent(
            "text_encoder",
            CLIPTextModel,
            CLIPTextConfig,
            clip_text_config("CLIPTextModel", clip_vocab, TEXT_ENCODER),
        ),
        RandomComponent("text_encoder_2", T5EncoderModel, T5Config, t5_raw),
        RandomComponent(
            "transformer",
            FluxTransformer2DModel,
            FluxTransformer2DConfig,
            {"_class_name": "FluxTransformer2DModel", **TRANSFORMER},
            to_checkpoint=lambda weights, rng: join_single_proj_out(weights),
        ),
        RandomComponent("vae", AutoencoderKL, AutoencoderKLConfig, {"_class_name": "AutoencoderKL", **VAE}),
    ]
    return write_pipeline_folder(
        out,
        "FluxPipeline",
        components,
        tokenizers={"tokenizer": "CLIPTokenizer", "tokenizer_2": "T5TokenizerFast"},
        scheduler=("FlowMatchEulerDiscreteScheduler", SCHEDULER),
        seed=seed,
    )

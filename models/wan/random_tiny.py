"""A random tiny Wan: a Wan 2.1 text-to-video checkpoint with random weights, made deterministically on first use.

The tests' Wan checkpoint (the embedded "tiny-wan" is a trained one: models/wan/embedded.py). No
download, no torch: the weights come from our own NNX modules (shapes only) filled by numpy from a fixed seed,
written as an ordinary diffusers WanPipeline folder (model_index.json, configs, safetensors in PyTorch layout, a UMT5-style T5
tokenizer built offline, Wan 2.1's UniPC scheduler config with flow_shift 3), so it goes through exactly the
loading path a real checkpoint takes, and diffusers' WanPipeline.from_pretrained opens it too.

The configs below are also what the tests' diffusers-built checkpoint uses (tests/fixtures/tiny_wan.py), so
both are the same architecture. Its RoPE tables address 32 positions per axis, fewer than diffusers'
default 480x832 grid needs, so models/wan/pipeline.py serves it at its small defaults (32x48 pixels, 5 frames,
4 steps) and caps sizes at what the tables address: a video of noise-like colour in well under a second of
denoising on a CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshserve.models.checkpoints.embedded_folder import (
    RandomComponent,
    cached_model_folder,
    write_pipeline_folder,
)
from meshserve.models.components.t5 import T5Config, T5EncoderModel
from meshserve.models.components.t5_tokenizer import build_tiny_t5_tokenizer
from meshserve.models.wan.autoencoder_kl_wan import AutoencoderKLWan, AutoencoderKLWanConfig
from meshserve.models.wan.transformer_wan import WanTransformer3DConfig, WanTransformer3DModel

VERSION = "tiny-wan-v1"  # bump when anything below changes: the cache folder is keyed by it

# WanTransformer3DModel: 4 heads of 16 (RoPE parts t/h/w = 8/4/4), so tensor=2/4 and Ulysses over 2 or 4
# split the heads; 2 blocks; the real models' patch (1, 2, 2); 4 latent channels = the VAE's z_dim.
TRANSFORMER = dict(
    patch_size=[1, 2, 2],
    num_attention_heads=4,
    attention_head_dim=16,
    in_channels=4,
    out_channels=4,
    text_dim=32,
    freq_dim=32,
    ffn_dim=96,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=32,
)
# UMT5EncoderModel (Wan's text encoder: a relative-position table in every layer); d_model 32 = the
# transformer's text_dim; vocab 64 >= the tiny tokenizer's pieces.
UMT5 = dict(
    vocab_size=64,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    feed_forward_proj="gated-gelu",
    dropout_rate=0.0,
    layer_norm_epsilon=1e-6,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)
# AutoencoderKLWan with Wan 2.1's temporal layout (x4 in time, x8 in space), 4 latent channels; latent
# statistics that are not the identity, so the pipeline's `z / (1 / std) + mean` matters.
VAE = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
    latents_mean=[0.1, -0.2, 0.3, -0.05],
    latents_std=[1.5, 0.7, 2.0, 1.1],
)
# Wan 2.1's scheduler_config.json (Wan-AI/Wan2.1-T2V-1.3B-Diffusers): UniPC in its flow-matching form, shift 3.
SCHEDULER = dict(
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    num_train_timesteps=1000,
    flow_shift=3.0,
)


def random_wan_path() -> Path:
    """The random tiny Wan's folder, built on first use and reused after (under the model cache root)."""
    return cached_model_folder(VERSION, write_random_wan)


def vae_to_diffusers(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our VAE names -> diffusers' (models/autoencoder_kl_wan.diffusers_to_ours inverted): each resample conv is
    `resample.1` of diffusers' nn.Sequential; WanRMS_norm's gamma [C] is [C, 1, 1, 1] ([C, 1, 1] in the
    mid blocks' attention, a 2-D norm)."""
    out = {}
    for key, value in weights.items():
        key = key.replace(".resample.", ".resample.1.")
        if key.endswith(".gamma"):
            value = value.reshape(-1, 1, 1) if ".attentions." in key else value.reshape(-1, 1, 1, 1)
        out[key] = value
    return out


def _perturb_norms(weights: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Norm weights start at 1 (random_weights); give them spread so every multiply matters (a model whose
    norm weights are all 1 would not show a transposed or dropped norm weight)."""
    return {
        key: (value + 0.2 * rng.standard_normal(value.shape).astype(np.float32))
        if key.endswith((".gamma", "norm_q.weight", "norm_k.weight", "norm2.weight"))
        else value
        for key, value in weights.items()
    }


def write_random_wan(out: Path, seed: int = 0) -> Path:
    """The folder as the real Wan 2.1 ones are (their model_index.json's classes)."""
    out = Path(out)
    vocab = build_tiny_t5_tokenizer(out / "tokenizer")
    if vocab > UMT5["vocab_size"]:
        raise AssertionError(
            f"tiny tokenizer has {vocab} pieces, the encoder's vocabulary {UMT5['vocab_size']}"
        )
    umt5_raw = {
        "architectures": ["UMT5EncoderModel"],
        "model_type": "umt5",
        "is_encoder_decoder": True,
        **UMT5,
    }
    components = [
        RandomComponent("text_encoder", T5EncoderModel, T5Config, umt5_raw),
        RandomComponent(
            "transformer",
            WanTransformer3DModel,
            WanTransformer3DConfig,
            {"_class_name": "WanTransformer3DModel", **TRANSFORMER},
            to_checkpoint=_perturb_norms,
        ),
        RandomComponent(
            "vae",
            AutoencoderKLWan,
            AutoencoderKLWanConfig,
            {"_class_name": "AutoencoderKLWan", **VAE},
            to_checkpoint=lambda weights, rng: vae_to_diffusers(_perturb_norms(weights, rng)),
        ),
    ]
    return write_pipeline_folder(
        out,
        "WanPipeline",
        components,
        tokenizers={"tokenizer": "T5TokenizerFast"},
        scheduler=("UniPCMultistepScheduler", SCHEDULER),
        seed=seed,
    )

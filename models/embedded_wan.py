"""The embedded tiny Wan ("tiny-wan"): a Wan 2.1 text-to-video checkpoint made deterministically on first use.

As models/embedded.py and models/embedded_flux.py do for the tiny SDXL and Flux: no download, no torch. The
weights come from our own NNX modules (shapes only) filled by numpy from a fixed seed, written as an ordinary
diffusers WanPipeline folder (model_index.json, configs, safetensors in PyTorch layout, a UMT5-style T5
tokenizer built offline, Wan 2.1's UniPC scheduler config with flow_shift 3), so it goes through exactly the
loading path a real checkpoint takes, and diffusers' WanPipeline.from_pretrained opens it too.

Sizes: the transformer, UMT5 and VAE of tests/fixtures/tiny_wan.py (there built by diffusers/transformers, here
by numpy; the shapes are the same). Its RoPE tables address 32 positions per axis, fewer than diffusers'
default 480x832 grid needs, so models/pipelines/wan.py serves it at its small defaults (32x48 pixels, 5 frames,
4 steps) and caps sizes at what the tables address: a video of noise-like colour in well under a second of
denoising on a CPU. It exists so that `meshserve serve --model tiny-wan` returns an MP4 on a fresh machine.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from meshserve.models.autoencoder_kl_wan import AutoencoderKLWan, AutoencoderKLWanConfig
from meshserve.models.embedded import cache_root, random_weights
from meshserve.models.loading import abstract_module, write_safetensors
from meshserve.models.t5 import T5Config, T5EncoderModel
from meshserve.models.t5_tokenizer import build_tiny_t5_tokenizer
from meshserve.models.transformer_wan import WanTransformer3DConfig, WanTransformer3DModel

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

# diffusers' WanPipeline model_index.json entries (the real Wan 2.1 folders' classes).
MODEL_INDEX = {
    "_class_name": "WanPipeline",
    "scheduler": ["diffusers", "UniPCMultistepScheduler"],
    "text_encoder": ["transformers", "UMT5EncoderModel"],
    "tokenizer": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "WanTransformer3DModel"],
    "vae": ["diffusers", "AutoencoderKLWan"],
}


def embedded_wan_path() -> Path:
    """The embedded tiny Wan's folder, built on first use and reused after (same cache root as tiny-sdxl)."""
    path = cache_root() / "models" / VERSION
    if (path / "model_index.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: two processes starting at once never see half a folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{VERSION}-", dir=path.parent))
    try:
        write_embedded_wan(tmp)
        try:
            tmp.rename(path)
        except OSError:  # another process won the race; its folder is as good as ours
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write_config(folder: Path, config: dict, name: str = "config.json") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(config, indent=2))


def _vae_to_diffusers(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our VAE names -> diffusers' (models/autoencoder_kl_wan._to_our_names inverted): each resample conv is
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


def write_embedded_wan(out: Path, seed: int = 0) -> Path:
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
    transformer_raw = {"_class_name": "WanTransformer3DModel", **TRANSFORMER}
    vae_raw = {"_class_name": "AutoencoderKLWan", **VAE}
    components = [
        (
            "text_encoder",
            umt5_raw,
            "model.safetensors",
            lambda rngs: T5EncoderModel(T5Config.from_config(umt5_raw), dtype=jnp.float32, rngs=rngs),
        ),
        (
            "transformer",
            transformer_raw,
            "diffusion_pytorch_model.safetensors",
            lambda rngs: WanTransformer3DModel(
                WanTransformer3DConfig.from_config(transformer_raw), dtype=jnp.float32, rngs=rngs
            ),
        ),
        (
            "vae",
            vae_raw,
            "diffusion_pytorch_model.safetensors",
            lambda rngs: AutoencoderKLWan(
                AutoencoderKLWanConfig.from_config(vae_raw), dtype=jnp.float32, rngs=rngs
            ),
        ),
    ]
    for i, (name, raw, weights_name, factory) in enumerate(components):
        rng = np.random.default_rng(seed + i)
        weights = random_weights(abstract_module(factory), rng)
        if name != "text_encoder":
            weights = _perturb_norms(weights, rng)
        if name == "vae":
            weights = _vae_to_diffusers(weights)
        _write_config(out / name, raw)
        write_safetensors(out / name / weights_name, weights)
    _write_config(
        out / "scheduler",
        {"_class_name": "UniPCMultistepScheduler", **SCHEDULER},
        "scheduler_config.json",
    )
    _write_config(out, MODEL_INDEX, "model_index.json")
    return out

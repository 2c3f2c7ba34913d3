"""The embedded default model: a tiny SDXL-architecture checkpoint made deterministically on first use.

No download: the weights come from our own NNX modules initialised with a fixed seed, written as an
ordinary diffusers folder (model_index.json, configs, safetensors in PyTorch layout, CLIP tokenizers), so it
goes through exactly the loading path a real checkpoint takes, and diffusers can open it too. It makes
64x64 images of noise-like colour: it exists so that `meshserve generate` and `meshserve serve` work on a
fresh machine, not to draw.

The configs below are also what the tests' diffusers-built checkpoint uses (tests/fixtures/tiny_sdxl.py),
so both are the same architecture.
"""

from __future__ import annotations

from pathlib import Path

from meshserve.models.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig
from meshserve.models.clip import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
from meshserve.models.clip_tokenizer import build_tiny_clip_tokenizer
from meshserve.models.embedded_folder import (
    RandomComponent,
    cached_model_folder,
    clip_text_config,
    write_pipeline_folder,
)
from meshserve.models.embedded_folder import (
    cache_root as cache_root,  # re-exported: models/compile_cache.py keeps its cache beside the models
)
from meshserve.models.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel

VERSION = "tiny-sdxl-v1"  # bump when anything below changes: the cache folder is keyed by it

UNET = dict(
    block_out_channels=[32, 64],
    layers_per_block=2,
    sample_size=32,
    in_channels=4,
    out_channels=4,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"],
    attention_head_dim=[2, 4],
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    transformer_layers_per_block=[1, 2],
    projection_class_embeddings_input_dim=80,  # 6 time ids x 8 + text_encoder_2's projection (32)
    cross_attention_dim=64,  # text_encoder hidden 32 + text_encoder_2 hidden 32
    norm_num_groups=32,
)
VAE = dict(
    block_out_channels=[32, 64],
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
    up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
    latent_channels=4,
    sample_size=64,
    scaling_factor=0.13025,
)
TEXT_ENCODER = dict(
    hidden_size=32,
    intermediate_size=37,
    num_attention_heads=4,
    num_hidden_layers=3,
    hidden_act="quick_gelu",
    projection_dim=32,
    max_position_embeddings=77,
    layer_norm_eps=1e-5,
)
TEXT_ENCODER_2 = dict(TEXT_ENCODER, hidden_act="gelu")
SCHEDULER = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    timestep_spacing="leading",
    steps_offset=1,
    num_train_timesteps=1000,
    prediction_type="epsilon",
)


def embedded_model_path() -> Path:
    """The embedded model's folder, built on first use (under a second) and reused after."""
    return cached_model_folder(VERSION, write_embedded_model)


def write_embedded_model(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    vocab = build_tiny_clip_tokenizer(out / "tokenizer")
    build_tiny_clip_tokenizer(out / "tokenizer_2", pad_token="!")  # SDXL's second tokenizer pads with "!"
    components = [
        RandomComponent(
            "text_encoder",
            CLIPTextModel,
            CLIPTextConfig,
            clip_text_config("CLIPTextModel", vocab, TEXT_ENCODER),
        ),
        RandomComponent(
            "text_encoder_2",
            CLIPTextModelWithProjection,
            CLIPTextConfig,
            clip_text_config("CLIPTextModelWithProjection", vocab, TEXT_ENCODER_2),
        ),
        RandomComponent(
            "unet",
            UNet2DConditionModel,
            UNet2DConditionConfig,
            {"_class_name": "UNet2DConditionModel", **UNET},
        ),
        RandomComponent("vae", AutoencoderKL, AutoencoderKLConfig, {"_class_name": "AutoencoderKL", **VAE}),
    ]
    return write_pipeline_folder(
        out,
        "StableDiffusionXLPipeline",
        components,
        tokenizers={"tokenizer": "CLIPTokenizer", "tokenizer_2": "CLIPTokenizer"},
        scheduler=("EulerDiscreteScheduler", SCHEDULER),
        seed=seed,
        pipeline_config={"force_zeros_for_empty_prompt": True},
    )

"""tiny-flux: FLUX.1's architecture (CLIP pooled + T5 text, joint and single blocks, a 16-channel VAE without
quant convs, flow matching with FLUX.1-dev's dynamic shift) trained on the same pictures as tiny-sdxl.

Sizes: a VAE that halves twice (64x64 pictures, 16x16x16 latents, packed 2x2 into 8x8 = 64 tokens of 64
features) and a transformer of width 96 (4 heads of 24, so tensor 2/4 and Ulysses 2/4 divide the heads) with
2 joint and 2 single blocks. No guidance embedding (a "schnell"-type checkpoint): FLUX.1-dev's is distilled
from a teacher's guided outputs, which a model trained from scratch has not got; guidance here is the
pipeline's true CFG (captions dropped to "" at `caption_dropout`, as the pipeline encodes an empty negative
prompt). The T5 text is 16 tokens, the folder's serving default `max_sequence_length` (Flux attends every pad
token, so the model is served at the length it was trained at; the longest caption is 13 tokens).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshserve.models.checkpoints.embedded_folder import (
    clip_text_config,
    write_component,
    write_json,
    write_model_index,
)
from meshserve.models.components import autoencoder_kl, clip, t5
from meshserve.models.components.clip_tokenizer import load_clip_tokenizer, tokenize
from meshserve.models.components.t5_tokenizer import load_t5_tokenizer, tokenize_t5
from meshserve.models.flux import random_tiny
from meshserve.models.flux import transformer_flux as flux
from meshserve.models.flux.pipeline import pack_latents, unpack_latents
from meshserve.models.schedulers import flux_mu
from meshserve.training import caption_tokenizer, objectives, shapes
from meshserve.training.families.base import Component, TrainingFamily
from meshserve.training.recipe import Recipe

IMAGE_SIZE = 64
VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 3,
    up_block_types=["UpDecoderBlock2D"] * 3,
    block_out_channels=[16, 32, 32],
    layers_per_block=1,
    norm_num_groups=8,
    latent_channels=16,
    sample_size=IMAGE_SIZE,
    use_quant_conv=False,
    use_post_quant_conv=False,
    # scaling_factor and shift_factor come from the trained VAE's latents (latent_normalisation).
)
TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,  # 16 latent channels x the 2x2 packing
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=24,
    num_attention_heads=4,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    guidance_embeds=False,
    axes_dims_rope=[8, 8, 8],
)
TEXT_ENCODER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_hidden_layers=2,
    hidden_act="quick_gelu",
    projection_dim=32,
    max_position_embeddings=77,
    layer_norm_eps=1e-5,
)
# The random tiny Flux's T5 (d_model 32 = joint_attention_dim) and FLUX.1-dev's scheduler_config.json, whose
# shift follows the image's token count (64 here: exp(mu) = 1.60).
T5, SCHEDULER = random_tiny.T5, random_tiny.SCHEDULER
MAX_SEQUENCE_LENGTH = 16
# The size it was trained at (diffusers' Flux default, 128 latents x the VAE factor, would be 512).
SERVING_DEFAULTS = dict(
    num_inference_steps=20, max_sequence_length=MAX_SEQUENCE_LENGTH, width=IMAGE_SIZE, height=IMAGE_SIZE
)
TOKENS = (IMAGE_SIZE // 4 // 2) ** 2  # packed latent tokens of a 64x64 picture


class Family(TrainingFamily):
    name = "flux"
    # 2,200 denoiser steps drew the asked colours as round blobs (shape 42 % held out); 4,400 drew the shapes
    # (85 % held out, docs/embedded-model.md). 2-core EPYC, 2 XLA host devices, 2026-11-24: 0.31 s per VAE step
    # of 16, 0.22 s per denoiser step of 32, 19.4 minutes in all.
    recipe = Recipe(vae_steps=600, denoiser_steps=4400)
    vae = Component(
        "vae", autoencoder_kl.AutoencoderKL, autoencoder_kl.AutoencoderKLConfig, autoencoder_kl.SHARDING_RULES
    )
    denoiser = (
        Component(
            "transformer", flux.FluxTransformer2DModel, flux.FluxTransformer2DConfig, flux.SHARDING_RULES
        ),
        Component("text_encoder", clip.CLIPTextModel, clip.CLIPTextConfig, clip.SHARDING_RULES),
        Component("text_encoder_2", t5.T5EncoderModel, t5.T5Config, t5.SHARDING_RULES),
    )
    command = "meshserve train-embedded --family flux --out models/flux/weights/tiny-flux --seed 0"

    def data(self, rng, batch):
        return shapes.training_batch(rng, batch, IMAGE_SIZE)

    def write_tokenizers(self, out: Path) -> None:
        self.clip_vocab = caption_tokenizer.build_caption_tokenizer(out / "tokenizer")
        self.t5_vocab = caption_tokenizer.build_caption_t5_tokenizer(out / "tokenizer_2")
        self.clip_tokenizer = load_clip_tokenizer(out / "tokenizer")
        self.t5_tokenizer = load_t5_tokenizer(out / "tokenizer_2")
        grid = np.concatenate(
            [np.zeros((MAX_SEQUENCE_LENGTH, 3), np.float32), flux.image_ids(*(2 * [IMAGE_SIZE // 8]))]
        )
        self.rope = flux.flux_rope(grid, TRANSFORMER["axes_dims_rope"])

    def configs(self):
        t5_config = {"architectures": ["T5EncoderModel"], "model_type": "t5", "vocab_size": self.t5_vocab}
        return {
            "vae": {"_class_name": "AutoencoderKL", **VAE},
            "transformer": {"_class_name": "FluxTransformer2DModel", **TRANSFORMER},
            "text_encoder": clip_text_config("CLIPTextModel", self.clip_vocab, TEXT_ENCODER),
            "text_encoder_2": {**t5_config, "is_encoder_decoder": True, **T5},
        }

    def latent_normalisation(self, latents):
        # FLUX.1's VAE config has one shift and one scale for all channels: (z - shift_factor) * scaling_factor.
        shift, std = float(latents.mean()), float(latents.std())
        update = {"shift_factor": shift, "scaling_factor": 1.0 / std}
        return update, np.float32(shift), np.float32(1.0 / std)

    def objective(self):
        return objectives.flow_matching(float(np.exp(flux_mu(TOKENS, SCHEDULER))))

    def text_inputs(self, captions, keep):
        captions = [c if k else "" for c, k in zip(captions, keep, strict=True)]
        return {
            "clip_ids": tokenize(self.clip_tokenizer, captions),
            "t5_ids": tokenize_t5(self.t5_tokenizer, captions, MAX_SEQUENCE_LENGTH).input_ids,
        }

    def predict(self, modules, noisy, t, inputs):
        _, h, w, _ = noisy.shape
        pooled = modules["text_encoder"](inputs["clip_ids"]).pooler_output
        embeds = modules["text_encoder_2"](inputs["t5_ids"]).last_hidden_state
        # t is sigma, the pipeline's timestep / 1000.
        out = modules["transformer"](pack_latents(noisy), embeds, pooled, t, self.rope)
        return unpack_latents(out, h, w)

    def write_folder(self, out, configs, weights, record):
        weights = dict(weights, transformer=random_tiny.join_single_proj_out(weights["transformer"]))
        entries = {name: write_component(out / name, configs[name], w) for name, w in weights.items()}
        write_model_index(
            out,
            "FluxPipeline",
            entries,
            tokenizers={"tokenizer": "CLIPTokenizer", "tokenizer_2": "T5TokenizerFast"},
            scheduler=("FlowMatchEulerDiscreteScheduler", SCHEDULER),
        )
        write_json(out, {"defaults": SERVING_DEFAULTS, "training": record}, "meshserve.json")

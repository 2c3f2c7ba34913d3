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

import json
import os
import shutil
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.models.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig
from meshserve.models.clip import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
from meshserve.models.clip_tokenizer import build_tiny_clip_tokenizer
from meshserve.models.loading import abstract_module, to_torch_layout, torch_key, write_safetensors
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


def cache_root() -> Path:
    base = os.environ.get("MESHSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "meshserve"
    )
    return Path(base)


def embedded_model_path() -> Path:
    """The embedded model's folder, built on first use (under a second) and reused after."""
    path = cache_root() / "models" / VERSION
    if (path / "model_index.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: two processes starting at once never see half a folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{VERSION}-", dir=path.parent))
    try:
        write_embedded_model(tmp)
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


def random_weights(module: nnx.Module, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """PyTorch-named, PyTorch-layout random weights for an (abstract) module, by numpy alone.

    numpy rather than the modules' own initialisers: eager JAX init dispatches one small program per
    parameter (46 s for this tiny model on 2 cores, measured), numpy takes well under a second, and
    numpy's generator gives the same bits on every platform. Kernels ~ N(0, 1/fan_in), norms 1, biases 0.
    """
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        leaf, shape = str(path[-1]), tuple(var.get_value().shape)
        if leaf == "scale":
            value = np.ones(shape, np.float32)
        elif leaf == "bias":
            value = np.zeros(shape, np.float32)
        else:
            fan_in = int(np.prod(shape[:-1])) if leaf == "kernel" else shape[-1]
            value = (rng.standard_normal(shape) / np.sqrt(max(fan_in, 1))).astype(np.float32)
        out[torch_key(path)] = np.ascontiguousarray(to_torch_layout(leaf, value))
    return out


def write_embedded_model(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    vocab = build_tiny_clip_tokenizer(out / "tokenizer")
    build_tiny_clip_tokenizer(out / "tokenizer_2", pad_token="!")  # SDXL's second tokenizer pads with "!"
    # <|startoftext|> and <|endoftext|> are the last two ids; the pooled output reads the first eos.
    special = dict(vocab_size=vocab, bos_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=vocab - 1)

    components = [
        (
            "text_encoder",
            CLIPTextModel,
            CLIPTextConfig,
            {"architectures": ["CLIPTextModel"], "model_type": "clip_text_model", **special, **TEXT_ENCODER},
        ),
        (
            "text_encoder_2",
            CLIPTextModelWithProjection,
            CLIPTextConfig,
            {
                "architectures": ["CLIPTextModelWithProjection"],
                "model_type": "clip_text_model",
                **special,
                **TEXT_ENCODER_2,
            },
        ),
        (
            "unet",
            UNet2DConditionModel,
            UNet2DConditionConfig,
            {"_class_name": "UNet2DConditionModel", **UNET},
        ),
        ("vae", AutoencoderKL, AutoencoderKLConfig, {"_class_name": "AutoencoderKL", **VAE}),
    ]
    for i, (name, cls, config_cls, raw) in enumerate(components):
        config = config_cls.from_config(raw)
        module = abstract_module(lambda rngs: cls(config, dtype=jnp.float32, rngs=rngs))  # noqa: B023
        _write_config(out / name, raw)
        weights_name = (
            "model.safetensors" if name.startswith("text_encoder") else "diffusion_pytorch_model.safetensors"
        )
        write_safetensors(out / name / weights_name, random_weights(module, np.random.default_rng(seed + i)))
    _write_config(
        out / "scheduler", {"_class_name": "EulerDiscreteScheduler", **SCHEDULER}, "scheduler_config.json"
    )
    _write_config(
        out,
        {
            "_class_name": "StableDiffusionXLPipeline",
            "force_zeros_for_empty_prompt": True,
            "scheduler": ["diffusers", "EulerDiscreteScheduler"],
            "text_encoder": ["transformers", "CLIPTextModel"],
            "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "tokenizer_2": ["transformers", "CLIPTokenizer"],
            "unet": ["diffusers", "UNet2DConditionModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        },
        "model_index.json",
    )
    return out

"""The embedded default model: a tiny SDXL trained to draw coloured shapes, shipped inside the package.

`meshserve serve` and `meshserve generate` run it when no model is named. It is the SDXL architecture (two
CLIP text encoders, a text_time UNet with cross-attention, a KL VAE; sizes in training/config.py), so it
runs the same engine, layouts and API as SDXL itself; trained by training/train_shapes.py on procedural
pictures of a circle, square or triangle in one of eight colours on a background of another, it draws
prompts such as "a red circle on a blue background" at 64x64 (docs/embedded-model.md: how it was trained,
in how long, and how well it follows held-out prompts).

The folder is an ordinary diffusers folder (model_index.json, configs, tokenizers, safetensors in PyTorch
layout), so it goes through exactly the loading path a real checkpoint takes and diffusers opens it too.
Its weights' sha256 sums are kept here and checked on first use: a damaged install fails loudly.
"""

from __future__ import annotations

from pathlib import Path

from meshserve.models.checkpoints.shipped import shipped_folder

FOLDER = Path(__file__).resolve().parent / "weights" / "tiny-sdxl"
# The command that made the weights (on a 2-core CPU; docs/embedded-model.md has the run's record).
TRAINING_COMMAND = "meshserve train-embedded --family sdxl --out models/sdxl/weights/tiny-sdxl --seed 0"
# sha256 of each weights file, as training wrote it. A new training run must update these.
SHA256 = {
    "text_encoder/model.safetensors": "691223f63a69b0422c78faef7acaa1fe4f6eb41b215dee99a8751b765b8d4a47",
    "text_encoder_2/model.safetensors": "c03c1acb5d37b1e8f1056660f8efb3c3c1f33b78aa6ef14530674b7034b67af8",
    "unet/diffusion_pytorch_model.safetensors": "157e4aaa6615edde822ed73e5e125d29bce5a5906a53080ce60327a0ac2b3b8a",
    "vae/diffusion_pytorch_model.safetensors": "0ea61bb0e6cb8c2511ab78524ae0c329aebf3819462af6019c000e87b7fc8f7c",
}


# The folder, its weights checked against SHA256 (once per process).
embedded_model_path = shipped_folder(FOLDER, SHA256, TRAINING_COMMAND, "models/sdxl/embedded.py")

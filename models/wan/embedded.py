"""tiny-wan: a tiny Wan 2.1 trained to draw coloured shapes moving, shipped inside the package.

`meshserve serve --model tiny-wan` runs it. It is Wan 2.1's text-to-video architecture (UMT5 text, the 3D
causal VAE, the DiT with cross-attention, flow matching with its shift 3; sizes in training/families/wan.py),
trained by training/train_shapes.py on 9-frame clips of the shapes tiny-sdxl and tiny-flux draw: it draws
prompts such as "a red circle moving left on a blue background" at 64x64, 9 frames (docs/embedded-model.md: the
run, its time, and how well it follows held-out prompts).

An ordinary diffusers WanPipeline folder, so it takes the loading path a real checkpoint takes and diffusers
opens it too; its weights' sha256 sums are kept here and checked on first use.
"""

from __future__ import annotations

from pathlib import Path

from meshserve.models.checkpoints.shipped import shipped_folder

FOLDER = Path(__file__).resolve().parent / "weights" / "tiny-wan"
# The command that made the weights (on a 2-core CPU; docs/embedded-model.md has the run's record).
TRAINING_COMMAND = "meshserve train-embedded --family wan --out models/wan/weights/tiny-wan --seed 0"
# sha256 of each weights file, as training wrote it. A new training run must update these.
SHA256 = {
    "text_encoder/model.safetensors": "f5d19abd48b2b6c8648669a748fbfd9bfb8f1f667e9487698620a01bafff2271",
    "transformer/diffusion_pytorch_model.safetensors": "cf8c4da50a59738133e27464386b98e20d46a9f2e2c53f975c620e1b0909978a",
    "vae/diffusion_pytorch_model.safetensors": "b71428310fd9b5067920e14989366dbea9d43aa080c69842b3b831a6d195cc3f",
}


# The folder, its weights checked against SHA256 (once per process).
embedded_model_path = shipped_folder(FOLDER, SHA256, TRAINING_COMMAND, "models/wan/embedded.py")

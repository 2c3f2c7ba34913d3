"""tiny-flux: a tiny FLUX.1 trained to draw coloured shapes, shipped inside the package.

`meshserve serve --model tiny-flux` runs it. It is FLUX.1's architecture (CLIP pooled + T5 text, joint and
single blocks, a 16-channel VAE, flow matching with the dynamic shift; sizes in training/families/flux.py),
trained by training/train_shapes.py on the pictures tiny-sdxl learned from: it draws prompts such as
"a red circle on a blue background" at 64x64 (docs/embedded-model.md: the run, its time, and how well it
follows held-out prompts).

An ordinary diffusers FluxPipeline folder, so it takes the loading path a real checkpoint takes and diffusers
opens it too; its weights' sha256 sums are kept here and checked on first use.
"""

from __future__ import annotations

from pathlib import Path

from meshserve.models.checkpoints.shipped import shipped_folder

FOLDER = Path(__file__).resolve().parent / "weights" / "tiny-flux"
# The command that made the weights (on a 2-core CPU; docs/embedded-model.md has the run's record).
TRAINING_COMMAND = "meshserve train-embedded --family flux --out models/flux/weights/tiny-flux --seed 0"
# sha256 of each weights file, as training wrote it. A new training run must update these.
SHA256 = {
    "text_encoder/model.safetensors": "edff5a2607140f6f883d936a7f58a7466549904f898ef0b1c831260058cd6074",
    "text_encoder_2/model.safetensors": "ffbe23a555a5dd91763718abd9745baa3c075ffdb255e851538e8e427f38b489",
    "transformer/diffusion_pytorch_model.safetensors": "93f2eafed67e177edbc4c1c78ea3bacd8121f5fa26b68abb5a93d9b087c44819",
    "vae/diffusion_pytorch_model.safetensors": "2ecc68f4e2abafc486190ba1cf3191240e147d9cd1135a34bfe0b036ebb518cb",
}


# The folder, its weights checked against SHA256 (once per process).
embedded_model_path = shipped_folder(FOLDER, SHA256, TRAINING_COMMAND, "models/flux/embedded.py")

"""The embedded default model: deterministic, an ordinary diffusers folder, and equal to diffusers on it."""

import numpy as np

from meshserve.models import load_pipeline
from meshserve.models.embedded import write_embedded_model
from meshserve.models.loading import read_component_weights


def test_embedded_model_is_deterministic(tmp_path):
    a = read_component_weights(write_embedded_model(tmp_path / "a") / "unet")
    b = read_component_weights(write_embedded_model(tmp_path / "b") / "unet")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_diffusers_opens_it_and_agrees(tmp_path):
    import torch
    from diffusers import StableDiffusionXLPipeline

    folder = write_embedded_model(tmp_path / "m")
    reference = StableDiffusionXLPipeline.from_pretrained(str(folder), torch_dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    latents = np.random.default_rng(0).standard_normal((1, 4, 32, 32)).astype(np.float32)
    kw = dict(num_inference_steps=2, guidance_scale=5.0, output_type="np")
    expected = reference("a cat", latents=torch.from_numpy(latents), **kw).images
    got = load_pipeline(folder)("a cat", latents=latents, **kw).images
    assert float(np.abs(got - expected).max()) <= 1e-3 and expected.std() > 1e-3

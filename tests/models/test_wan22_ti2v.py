"""Wan 2.2's TI2V-5B layout (`expand_timesteps`, the Wan 2.2 VAE: residual levels, 2 x 2 patches, 16x in space)
as text-to-video against diffusers' WanPipeline on a tiny folder diffusers wrote: frames and latents, CFG and
without; its serving defaults; its image-to-video refused with the reason.

diffusers gives the transformer one timestep per token (`mask * t`, the mask all ones for text-to-video); the
engine gives it the step's timestep, whose arithmetic per token is the same: the parity below is that claim's
test. The measured errors are logged (`--log-cli-level=INFO`)."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

from meshserve.models import load_pipeline
from meshserve.models.registry import ModelFolderError
from tests.fixtures.tiny_wan import build_tiny_wan22_ti2v

log = logging.getLogger(__name__)

# 64 x 96 px (2 x 3 latent pixels of 32: the VAE's 16 x the transformer's 2 x 2 patch), 9 frames -> latents
# [4, 3, 4, 6] -> 3 x 2 x 3 = 18 tokens.
H, W, F = 64, 96, 9
LATENT = (4, 3, 4, 6)  # diffusers' [C, T, h, w]
PROMPTS = ["a cat", "the dog and the cat"]


@pytest.fixture(scope="module")
def ti2v_path(tiny_wan_path, tmp_path_factory):
    return build_tiny_wan22_ti2v(tmp_path_factory.mktemp("wan22_ti2v"), tiny_wan_path)


@pytest.fixture(scope="module")
def reference(ti2v_path):
    import torch
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(ti2v_path), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.config.expand_timesteps
    return pipe


@pytest.fixture(scope="module")
def ours(ti2v_path):
    return load_pipeline(ti2v_path, dtype="float32")


@pytest.mark.parametrize("output_type", ["np", "latent"])
def test_text_to_video_matches_diffusers(ours, reference, output_type):
    import torch

    latents = np.random.default_rng(0).standard_normal((2, *LATENT)).astype(np.float32)
    kw = dict(height=H, width=W, num_frames=F, num_inference_steps=3, output_type=output_type)
    for guidance, negatives in ((5.0, ["blurry", ""]), (1.0, None)):
        with torch.no_grad():
            expected = reference(
                PROMPTS,
                negative_prompt=negatives,
                guidance_scale=guidance,
                latents=torch.from_numpy(latents),
                **kw,
            ).frames
        expected = expected.float().numpy() if output_type == "latent" else expected
        got = ours(PROMPTS, negative_prompt=negatives, guidance_scale=guidance, latents=latents, **kw).images
        assert got.shape == expected.shape
        err = float(np.abs(got - expected).max())
        scale = float(np.abs(expected).max())
        log.info("TI2V %s, guidance %s: max abs %.2e (of %.2f)", output_type, guidance, err, scale)
        assert err <= 1e-3 * (scale if output_type == "latent" else 1.0)
        assert np.asarray(expected).std() > 1e-2
    if output_type == "np":
        assert got.shape == (2, F, H, W, 3)


def test_serving_defaults_and_limits(ours):
    assert ours.defaults["fps"] == 24
    limits = ours.limits
    assert limits["frames"]["max_frames"] == 121 and limits["frames"]["step"] == 4
    # 16x VAE x 2 x 2 patches: sizes in steps of 32
    assert ours.size_multiple == 32


def test_its_image_to_video_is_refused_with_the_reason(ti2v_path, tmp_path):
    folder = tmp_path / "ti2v_i2v"
    shutil.copytree(ti2v_path, folder)
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    index_path.write_text(json.dumps({**index, "_class_name": "WanImageToVideoPipeline"}))
    with pytest.raises(ModelFolderError, match="expand_timesteps.*only its text-to-video"):
        load_pipeline(folder, dtype="float32")

"""Wan 2.2's TI2V-5B layout (`expand_timesteps`, the Wan 2.2 VAE: residual levels, 2 x 2 patches, 16x in space)
as text-to-video against diffusers' WanPipeline and as image-to-video against its WanImageToVideoPipeline, on a
tiny folder diffusers wrote: frames and latents, CFG and without; its serving defaults.

diffusers gives the transformer one timestep per token (`mask * t`, the mask all ones for text-to-video); the
engine gives it the step's timestep, whose arithmetic per token is the same: the parity below is that claim's
test. The measured errors are logged (`--log-cli-level=INFO`)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from meshserve.models import PipelineError, load_pipeline
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
    assert limits["tasks"] == ["text-to-video", "image-to-video"]
    assert limits["frames"]["max_frames"] == 121 and limits["frames"]["step"] == 4
    # 16x VAE x 2 x 2 patches: sizes in steps of 32
    assert ours.size_multiple == 32


def test_image_to_video_matches_diffusers(ours, ti2v_path, monkeypatch):
    """diffusers' WanImageToVideoPipeline on the same folder (expand_timesteps: the image encoded alone as the
    first latent frame, its tokens at timestep 0, put back at the end), per image, against a batch of two
    images: frames and latents; one row with CFG and one without. A second call with other images compiles
    nothing."""
    import diffusers.pipelines.wan.pipeline_wan as t2v
    import diffusers.pipelines.wan.pipeline_wan_i2v as i2v_module
    import torch
    from diffusers import WanImageToVideoPipeline

    from tests.models.test_wan_i2v import two_images

    monkeypatch.setattr(i2v_module, "basic_clean", t2v.basic_clean)  # no ftfy here (test_wan_i2v.py)
    reference = WanImageToVideoPipeline.from_pretrained(str(ti2v_path), dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    assert reference.config.expand_timesteps
    images = two_images()
    latents = np.random.default_rng(1).standard_normal((2, *LATENT)).astype(np.float32)
    rows = [{"guidance_scale": 5.0, "negative_prompt": "blurry"}, {"guidance_scale": 1.0}]
    kw = dict(height=H, width=W, num_frames=F, num_inference_steps=3)
    outputs = {}
    for output_type in ("np", "latent"):
        got = ours(
            PROMPTS,
            image=images,
            negative_prompt=["blurry", None],
            guidance_scale=[5.0, 1.0],
            latents=latents,
            output_type=output_type,
            **kw,
        ).images
        for row, args in enumerate(rows):
            with torch.no_grad():
                want = reference(
                    image=images[row],
                    prompt=PROMPTS[row],
                    latents=torch.from_numpy(latents[row : row + 1]),
                    output_type=output_type,
                    **kw,
                    **args,
                ).frames
            want = want.float().numpy() if output_type == "latent" else want
            err = float(np.abs(got[row : row + 1] - want).max())
            log.info("TI2V image-to-video %s, row %d: max abs %.2e", output_type, row, err)
            assert err <= 1e-3 * (float(np.abs(want).max()) if output_type == "latent" else 1.0), (
                output_type,
                row,
            )
        outputs[output_type] = got
    plain = ours(PROMPTS, negative_prompt=["blurry", None], guidance_scale=[5.0, 1.0], latents=latents, **kw)
    assert np.abs(plain.images - outputs["np"]).max() > 1e-2  # the image counts
    compiled = ours.compilations
    ours(
        PROMPTS,
        image=images[::-1],
        negative_prompt=["blurry", None],
        guidance_scale=[5.0, 1.0],
        latents=latents,
        **kw,
    )
    assert ours.compilations == compiled
    with pytest.raises(PipelineError, match="last_image|unsupported argument"):
        ours(PROMPTS[0], image=images[0], last_image=images[1], **kw)


def test_image_to_video_on_a_layout_matches_one_device(ours, ti2v_path):
    """cfg2 x context2 (Ulysses; the first frame's tokens on one device of the context pair), the weights split
    over both: the one device's latents."""
    from meshserve.models.attention import AttentionSettings
    from tests.models.test_wan_i2v import two_images

    split = load_pipeline(
        ti2v_path,
        dtype="float32",
        mesh={"cfg": 2, "context": 2},
        devices=list(range(4)),
        attention=AttentionSettings(context_strategy="ulysses"),
        weights={"shard_over": ["cfg", "context"]},
    )
    latents = np.random.default_rng(2).standard_normal((2, *LATENT)).astype(np.float32)
    kw = dict(
        image=two_images(), height=H, width=W, num_frames=F, num_inference_steps=3, output_type="latent"
    )
    kw |= {"negative_prompt": ["blurry", None], "guidance_scale": [5.0, 1.0], "latents": latents}
    err = float(np.abs(split(PROMPTS, **kw).images - ours(PROMPTS, **kw).images).max())
    log.info("TI2V image-to-video cfg2 x context2: max abs %.2e of one device's latents", err)
    assert err <= 1e-4

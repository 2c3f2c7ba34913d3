"""LCM (scheduler "lcm") in the SDXL pipeline against diffusers' StableDiffusionXL(Img2Img)Pipeline with
`LCMScheduler.from_config(pipe.scheduler.config)`, LCM-LoRA's recipe, same weights, fp32.

LCM draws fresh noise at every step but the last: diffusers' draws (scheduling_lcm.randn_tensor) are replaced
by ours, each row's from its own seed's step keys (models/engine/seeds.py), so the two loops see the same
noise; the starting latents (and img2img's noise) are the test's array on both sides.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from meshserve.models import PipelineError, load_pipeline
from meshserve.models.engine.seeds import key_data, row_keys, step_keys
from tests.fixtures.diffusers_noise import same_noise as patch_noise
from tests.fixtures.tiny_sdxl import diffusers_sdxl

H, W = 64, 48
PROMPTS = ["a photo of a cat", "a red car"]
SEEDS = [11, 12]


@pytest.fixture(scope="module")
def ours(tiny_sdxl_path):
    return load_pipeline(tiny_sdxl_path, dtype="float32")


@pytest.fixture(scope="module")
def reference(tiny_sdxl_path):
    from diffusers import LCMScheduler

    pipe = diffusers_sdxl(tiny_sdxl_path)
    pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config)
    return pipe


@pytest.fixture
def step_noise(monkeypatch):
    return patch_lcm_noise(monkeypatch)


def patch_lcm_noise(monkeypatch, seeds=tuple(SEEDS), scheduler="lcm"):
    """diffusers' LCM (or TCD) step draws, step after step, the noise our loop draws from `seeds`' step keys;
    returns (the steps it drew at, [the first step the call runs]: set it for an img2img call)."""
    import importlib

    import torch

    module = importlib.import_module(f"diffusers.schedulers.scheduling_{scheduler}")

    keys, drawn = row_keys(key_data(list(seeds))), []

    def randn(shape, **kw):
        # Our loop's latents are [B, h, w, C]; diffusers' [B, C, h, w]. Step i's noise: the i-th draw of a
        # call (diffusers draws at every step but the last).
        b, c, h, w = shape
        i = len(drawn)
        drawn.append(i)
        rows = jax.vmap(lambda k: jax.random.normal(k, (h, w, c)))(step_keys(keys, i + drawn_from[0]))
        return torch.from_numpy(np.asarray(rows).transpose(0, 3, 1, 2).copy())

    drawn_from = [0]  # the first step a call runs (img2img starts later)
    monkeypatch.setattr(module, "randn_tensor", randn)
    return drawn, drawn_from


def _latents(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 4, H // 2, W // 2)).astype(np.float32)


def _check(got, expected, what):
    err = float(np.abs(got - expected).max())
    print(f"{what}: max abs pixel difference from diffusers {err:.2e}")
    assert err <= 1e-3, f"{what}: max abs pixel difference {err:.2e}"
    assert expected.std() > 1e-3


@pytest.mark.parametrize("guidance", [1.0, 2.0], ids=["no-cfg", "cfg"])
def test_lcm_text_to_image_matches_diffusers(ours, reference, step_noise, guidance):
    import torch

    drawn, _ = step_noise
    latents = _latents(0)
    kw = dict(num_inference_steps=4, guidance_scale=guidance, height=H, width=W, output_type="np")
    expected = reference(PROMPTS, latents=torch.from_numpy(latents), **kw).images
    got = ours(PROMPTS, latents=latents, seed=SEEDS, scheduler="lcm", **kw).images
    assert drawn == [0, 1, 2]  # no draw at the last step
    _check(got, expected, f"lcm text-to-image, guidance {guidance}")


def test_lcm_img2img_matches_diffusers_and_compiles_nothing_new(ours, reference, step_noise, monkeypatch):
    import torch
    from diffusers import StableDiffusionXLImg2ImgPipeline
    from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl_img2img

    from tests.models.test_sdxl_image_inputs import _images

    drawn, drawn_from = step_noise
    holder = patch_noise(monkeypatch, pipeline_stable_diffusion_xl_img2img)
    ref = StableDiffusionXLImg2ImgPipeline.from_pipe(reference)
    ref.set_progress_bar_config(disable=True)
    images, noise = _images(3), _latents(1)
    holder["noise"] = noise
    kw = dict(num_inference_steps=6, guidance_scale=1.0, strength=0.5, output_type="np")
    drawn_from[0] = 3  # 6 steps at strength 0.5 start at step 3
    expected = ref(PROMPTS, image=[torch.from_numpy(i.transpose(2, 0, 1)) for i in images], **kw).images
    got = ours(PROMPTS, image=images, height=H, width=W, latents=noise, seed=SEEDS, scheduler="lcm", **kw)
    assert drawn == [0, 1]
    _check(got.images, expected, "lcm img2img, strength 0.5")
    # Another strength and step count: the padded schedule and traced start compile nothing.
    before = ours.compilations
    other = {**kw, "strength": 0.8, "num_inference_steps": 3}
    out = ours(PROMPTS, image=images, height=H, width=W, latents=noise, seed=SEEDS, scheduler="lcm", **other)
    assert ours.compilations == before and not out.compiled
    assert np.abs(out.images - got.images).max() > 1e-2


@pytest.mark.parametrize("eta", [0.3, 0.0])
def test_tcd_with_its_gamma_matches_diffusers(ours, reference, monkeypatch, eta):
    """TCD (TCD-SDXL-LoRA's recipe: TCDScheduler, 4 steps, eta 0.3): gamma is the call's eta, traced in the
    schedule (a new eta compiles nothing); eta 0 (diffusers' pipelines' default) draws no noise."""
    import torch
    from diffusers import TCDScheduler

    drawn, _ = patch_lcm_noise(monkeypatch, scheduler="tcd")
    original = reference.scheduler
    reference.scheduler = TCDScheduler.from_config(original.config)
    try:
        latents = _latents(4)
        kw = dict(num_inference_steps=4, guidance_scale=1.5, height=H, width=W, output_type="np")
        expected = reference(PROMPTS, latents=torch.from_numpy(latents), eta=eta, **kw).images
    finally:
        reference.scheduler = original
    before = ours.compilations
    got = ours(PROMPTS, latents=latents, seed=SEEDS, scheduler="tcd", eta=eta, **kw)
    assert drawn == ([0, 1, 2] if eta else [])
    _check(got.images, expected, f"tcd, eta {eta}")
    if eta == 0.0:  # the second run: the program of the first serves it
        assert ours.compilations == before and not got.compiled


def test_lcm_step_cap_is_published_and_enforced(ours):
    rules = ours.limits["scheduler_arguments"]["lcm"]
    assert rules["max_steps"] == 50 and rules["timesteps"] and not rules["sigmas"]
    with pytest.raises(PipelineError, match="num_inference_steps must be at most 50 with scheduler 'lcm'"):
        ours("a cat", scheduler="lcm", num_inference_steps=51, height=H, width=W)
    # A custom schedule of LCM's own timesteps sets the steps (diffusers' timesteps= call argument).
    out = ours("a cat", scheduler="lcm", timesteps=[999, 759, 499, 259], height=H, width=W, output_type="np")
    assert out.images.shape == (1, H, W, 3)


# -------------------------------------------------------------------------------------------------
# An LCM-distilled UNet (latent-consistency/lcm-sdxl's kind): the guidance scale enters as an embedding


@pytest.fixture(scope="module")
def lcm_folder(tiny_sdxl_path, tmp_path_factory):
    """The tiny SDXL with an LCM-distilled UNet's shape (time_cond_proj_dim) and LCMScheduler as its own."""
    import json
    import shutil

    import torch
    from diffusers import LCMScheduler, UNet2DConditionModel

    from tests.fixtures.tiny_sdxl import SCHEDULER, UNET

    folder = tmp_path_factory.mktemp("tiny_lcm_sdxl") / "sdxl"
    shutil.copytree(tiny_sdxl_path, folder)
    torch.manual_seed(5)
    UNet2DConditionModel(**UNET, time_cond_proj_dim=32).save_pretrained(str(folder / "unet"))
    LCMScheduler(**{k: v for k, v in SCHEDULER.items() if k != "steps_offset"}).save_config(
        str(folder / "scheduler")
    )
    index = json.loads((folder / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "LCMScheduler"]
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def test_lcm_unet_guidance_embedding_matches_diffusers(lcm_folder):
    """The UNet alone with timestep_cond, the guidance embedding as diffusers' pipeline computes it."""
    import jax.numpy as jnp
    import torch
    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
    from flax import nnx

    from meshserve.models.components.layers import guidance_scale_embedding
    from meshserve.models.sdxl.unet_2d_condition import load_unet
    from tests.models.test_unet_2d_condition import nchw, rel_err, sdxl_inputs

    ref = UNet2DConditionModel.from_pretrained(str(lcm_folder / "unet")).eval()
    w = torch.tensor([7.0, 0.5])  # guidance 8 (lcm-sdxl's card) and 1.5
    cond = StableDiffusionXLPipeline.get_guidance_scale_embedding(None, w, embedding_dim=32)
    ours_cond = guidance_scale_embedding(jnp.asarray(w.numpy()), 32)
    assert np.abs(np.asarray(ours_cond) - cond.numpy()).max() <= 1e-3  # sines of w x 1000 (module docstring)
    sample, context, text_embeds, time_ids = sdxl_inputs()
    with torch.no_grad():
        expected = ref(
            torch.from_numpy(sample),
            torch.tensor(759.0),
            torch.from_numpy(context),
            timestep_cond=cond,
            added_cond_kwargs=dict(
                text_embeds=torch.from_numpy(text_embeds), time_ids=torch.from_numpy(time_ids)
            ),
        ).sample.numpy()
    unet = load_unet(lcm_folder / "unet")
    assert unet.time_embedding.cond_proj is not None
    graphdef, state = nnx.split(unet)

    @jax.jit
    def forward(state, timestep_cond):
        x = jnp.asarray(sample.transpose(0, 2, 3, 1))
        return nnx.merge(graphdef, state)(x, 759.0, context, text_embeds, time_ids, timestep_cond)

    got = forward(state, jnp.asarray(cond.numpy()))
    assert rel_err(nchw(got), expected) <= 1e-4
    # Another guidance moves the output: the condition is not ignored.
    other = forward(state, guidance_scale_embedding(jnp.asarray([1.0, 3.0]), 32))
    assert rel_err(nchw(other), expected) > 1e-3


def test_lcm_sdxl_folder_matches_diffusers_without_cfg(lcm_folder, step_noise):
    """lcm-sdxl's recipe: the folder's own LCMScheduler, 4 steps, guidance 8 (an embedding, no CFG: a
    negative prompt changes nothing, as in diffusers); per-row guidance is traced (no compile)."""
    import torch
    from diffusers import StableDiffusionXLPipeline

    drawn, _ = step_noise
    ref = StableDiffusionXLPipeline.from_pretrained(str(lcm_folder), torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    assert type(ref.scheduler).__name__ == "LCMScheduler"
    ours = load_pipeline(lcm_folder, dtype="float32")
    assert not ours.guided_by_cfg and type(ours.scheduler(None)).__name__ == "LCMScheduler"
    latents = _latents(2)
    kw = dict(num_inference_steps=4, height=H, width=W, output_type="np")
    expected = ref(PROMPTS, latents=torch.from_numpy(latents), guidance_scale=8.0, **kw).images
    got = ours(PROMPTS, latents=latents, seed=SEEDS, guidance_scale=8.0, negative_prompt="blurry", **kw)
    assert drawn == [0, 1, 2]
    _check(got.images, expected, "lcm-sdxl, guidance 8 embedded")
    before = ours.compilations
    other = ours(PROMPTS, latents=latents, seed=SEEDS, guidance_scale=[8.0, 2.0], **kw)
    assert ours.compilations == before
    np.testing.assert_allclose(other.images[0], got.images[0], atol=1e-6)
    assert np.abs(other.images[1] - got.images[1]).max() > 1e-3

"""diffusers' `callback_on_step_end` (models/engine/step_end.py) against diffusers' own loops, same weights and
noise, fp32: the steps and timesteps it is called with, the latents it sees (diffusers' layout: SDXL's [B, C,
h, w], Flux's packed [B, S, C]), latents it hands back, `pipe._interrupt`, an inpaint's first step and blend;
a second callback compiles nothing; the refusals; cfg2 x context2 against one device."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from meshserve.models import PipelineError, load_pipeline
from tests.fixtures.diffusers_noise import same_noise as patch_noise
from tests.fixtures.tiny_sdxl import diffusers_sdxl

H, W = 64, 48
PROMPTS = ["a photo of a cat", "a red car"]
SDXL_CALL = dict(num_inference_steps=5, guidance_scale=5.0, negative_prompt=["blurry", ""], height=H, width=W)


def recorder(calls: list, *, scale_at: int | None = 1, interrupt_at: int | None = None):
    """A callback in diffusers' form that notes (i, t, latents), scales the latents by 0.9 at step `scale_at`
    and sets the interrupt at step `interrupt_at`. Both sides' tensors are read as numpy."""

    def on_step_end(pipe, i, t, callback_kwargs):
        latents = callback_kwargs["latents"]
        as_numpy = np.array(latents.float().numpy() if hasattr(latents, "float") else latents, np.float32)
        calls.append((i, float(t), as_numpy))
        if i == interrupt_at:
            pipe._interrupt = True
        return {"latents": latents * 0.9} if i == scale_at else {}

    return on_step_end


def check_calls(got: list, expected: list):
    assert [(i, t) for i, t, _ in got] == [(i, t) for i, t, _ in expected]
    for (i, _, ours), (_, _, theirs) in zip(got, expected, strict=True):
        assert ours.shape == theirs.shape, (i, ours.shape, theirs.shape)
        # latents of scale ~10 at the first steps (sigma x noise): relative to that
        err = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
        assert err <= 1e-5, (i, err)


@pytest.fixture(scope="module")
def ours(tiny_sdxl_path):
    return load_pipeline(tiny_sdxl_path, dtype="float32")


@pytest.fixture(scope="module")
def reference(tiny_sdxl_path):
    return diffusers_sdxl(tiny_sdxl_path)


def _noise(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 4, H // 2, W // 2)).astype(np.float32)


def test_sdxl_sees_and_replaces_the_latents_and_interrupts_as_diffusers(ours, reference):
    import torch

    noise, theirs, got = _noise(), [], []
    kw = dict(SDXL_CALL, output_type="np")
    expected = reference(
        PROMPTS,
        latents=torch.from_numpy(noise),
        callback_on_step_end=recorder(theirs, interrupt_at=3),
        **kw,
    ).images
    out = ours(PROMPTS, latents=noise, callback_on_step_end=recorder(got, interrupt_at=3), **kw)
    assert [i for i, *_ in got] == [0, 1, 2, 3]  # interrupted after step 3 of 5, as diffusers was
    check_calls(got, theirs)
    err = float(np.abs(np.asarray(out.images) - expected).max())
    assert err <= 1e-3 and expected.std() > 1e-2, err
    assert ours.interrupt  # the flag the callback set, read as diffusers' property

    # Another callback (no change, no interrupt): the same program, all five steps, the latents untouched; the
    # interrupt of the last call was reset.
    before, seen = ours.compilations, []
    plain = ours(PROMPTS, latents=noise, callback_on_step_end=recorder(seen, scale_at=None), **kw)
    assert ours.compilations == before
    assert [i for i, *_ in seen] == [0, 1, 2, 3, 4]
    assert not ours.interrupt
    without = ours(PROMPTS, latents=noise, **kw)  # the program without the callback
    assert float(np.abs(np.asarray(plain.images) - np.asarray(without.images)).max()) <= 1e-6
    assert float(np.abs(np.asarray(plain.images) - np.asarray(out.images)).max()) > 1e-2


def test_an_inpaint_counts_from_its_first_step_and_the_callback_sees_the_blend(ours, reference, monkeypatch):
    """A strength below 1 runs the last steps: i counts them from 0 (diffusers' enumerate over the cut
    timesteps), and the 4-channel inpaint's latents are seen after the known region is laid back."""
    import torch
    from diffusers import StableDiffusionXLInpaintPipeline
    from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl_inpaint

    holder = patch_noise(monkeypatch, pipeline_stable_diffusion_xl_inpaint)
    ref = StableDiffusionXLInpaintPipeline.from_pipe(reference)
    ref.set_progress_bar_config(disable=True)
    y, x = np.mgrid[0:H, 0:W] / max(H, W)
    image = np.clip(np.stack([x + 0.2, y + 0.1, 1 - x * y], axis=-1), 0, 1).astype(np.float32)
    mask = ((np.mgrid[0:H, 0:W][0] > 16) & (np.mgrid[0:H, 0:W][1] < 30)).astype(np.float32)
    noise = _noise(1)
    holder["noise"] = noise
    kw = dict(SDXL_CALL, strength=0.6, output_type="np")
    theirs, got = [], []
    expected = ref(
        PROMPTS,
        image=torch.from_numpy(image.transpose(2, 0, 1))[None].repeat(2, 1, 1, 1),
        mask_image=torch.from_numpy(mask)[None, None].repeat(2, 1, 1, 1),
        callback_on_step_end=recorder(theirs, scale_at=0),
        **kw,
    ).images
    out = ours(
        PROMPTS,
        image=image,
        mask_image=mask,
        latents=noise,
        callback_on_step_end=recorder(got, scale_at=0),
        **kw,
    )
    assert [i for i, *_ in got] == [0, 1, 2]  # int(5 x 0.6) = 3 steps
    check_calls(got, theirs)
    assert float(np.abs(np.asarray(out.images) - expected).max()) <= 1e-3


def test_flux_hands_the_packed_latents_as_diffusers(tiny_flux_dev_path):
    import torch
    from diffusers import FluxPipeline

    ref = FluxPipeline.from_pretrained(str(tiny_flux_dev_path), torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    pipe = load_pipeline(tiny_flux_dev_path, dtype="float32")
    h, w = 36, 44
    latents = np.random.default_rng(2).standard_normal((2, (h // 4) * (w // 4), 16)).astype(np.float32)
    kw = dict(height=h, width=w, num_inference_steps=3, max_sequence_length=24, guidance_scale=3.5)
    theirs, got = [], []
    expected = ref(
        PROMPTS,
        latents=torch.from_numpy(latents),
        callback_on_step_end=recorder(theirs),
        output_type="np",
        **kw,
    ).images
    out = pipe(PROMPTS, latents=latents, callback_on_step_end=recorder(got), output_type="np", **kw)
    check_calls(got, theirs)
    assert float(np.abs(np.asarray(out.images) - expected).max()) <= 1e-3


def test_refusals_name_the_argument_and_a_callbacks_error_is_the_calls(ours):
    kw = dict(SDXL_CALL, output_type="np")
    for bad, match in (
        ({"callback_on_step_end": lambda *a: {}, "callback_on_step_end_tensor_inputs": ["prompt_embeds"]},
         "prompt_embeds"),
        ({"callback_on_step_end_tensor_inputs": ["latents"]}, "needs a callback_on_step_end"),
        ({"callback_on_step_end": "not a function"}, "must be callable"),
        ({"callback_on_step_end": lambda *a: {}, "callback_on_step_end_tensor_inputs": "latents"},
         "list of names"),
    ):  # fmt: skip
        with pytest.raises(PipelineError, match=match):
            ours(PROMPTS, **kw, **bad)

    from diffusers.callbacks import SDXLCFGCutoffCallback

    # diffusers' own callback objects declare what they read: this one the embeddings, refused by name
    with pytest.raises(PipelineError, match="add_text_embeds"):
        ours(PROMPTS, callback_on_step_end=SDXLCFGCutoffCallback(cutoff_step_ratio=0.4), **kw)

    def wrong_shape(pipe, i, t, kwargs):
        return {"latents": kwargs["latents"][:1]}

    def raises(pipe, i, t, kwargs):
        if i == 2:
            raise ValueError("the user's own error")
        return None

    with pytest.raises(PipelineError, match="keep the shape"):
        ours(PROMPTS, callback_on_step_end=wrong_shape, **kw)
    with pytest.raises(PipelineError, match="return a dict"):
        ours(PROMPTS, callback_on_step_end=lambda *a: 3, **kw)
    with pytest.raises(ValueError, match="the user's own error"):
        ours(PROMPTS, callback_on_step_end=raises, **kw)

    # Latents changed in place are what the loop goes on from, as diffusers' tensors are.
    def in_place(pipe, i, t, kwargs):
        if i == 1:
            kwargs["latents"] *= 0.9

    scaled = ours(PROMPTS, latents=_noise(), callback_on_step_end=recorder([]), **kw).images
    changed = ours(PROMPTS, latents=_noise(), callback_on_step_end=in_place, **kw).images
    assert float(np.abs(np.asarray(changed) - np.asarray(scaled)).max()) <= 1e-6
    # The pipeline is fine afterwards.
    assert np.asarray(ours(PROMPTS, callback_on_step_end=lambda *a: None, **kw).images).shape == (2, H, W, 3)


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (XLA_FLAGS host device count)")
def test_on_cfg2_x_context2_the_callback_sees_and_sets_what_one_device_does(tiny_sdxl_path, ours):
    mesh = load_pipeline(
        tiny_sdxl_path, dtype="float32", mesh={"cfg": 2, "context": 2}, devices=jax.devices()[:4]
    )
    noise, kw = _noise(3), dict(SDXL_CALL, output_type="np")
    one, four = [], []
    expected = ours(PROMPTS, latents=noise, callback_on_step_end=recorder(one), **kw).images
    got = mesh(PROMPTS, latents=noise, callback_on_step_end=recorder(four), **kw).images
    check_calls(four, one)
    assert float(np.abs(np.asarray(got) - np.asarray(expected)).max()) <= 1e-4

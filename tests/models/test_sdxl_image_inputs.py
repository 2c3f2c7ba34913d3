"""SDXL image inputs against diffusers: img2img (StableDiffusionXLImg2ImgPipeline), inpainting with the base
4-channel UNet and with a 9-channel inpainting UNet (StableDiffusionXLInpaintPipeline), same weights, fp32.

Both sides get the same noise: diffusers' `randn_tensor` is replaced by the test's array (its `latents=` means
the starting latents, ours the noise the image is noised with), and its posterior `sample()` by `mode()`
(ours encodes deterministically). One diffusers run per pipeline covers most points: a batch of 2 prompts
with different images, non-square, CFG with negatives, strength < 1.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshserve.models import PipelineError, load_pipeline
from tests.fixtures.diffusers_noise import same_noise as patch_noise
from tests.fixtures.tiny_sdxl import diffusers_sdxl

H, W = 64, 48  # non-square; latents 32 x 24
PROMPTS = ["a photo of a cat", "a red car"]
NEGATIVE = ["blurry", "low quality"]
STEPS = 4


def _images(seed: int, height: int = H, width: int = W) -> list[np.ndarray]:
    """Two different smooth images (a random image's VAE latents are near noise; gradients look like one)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    out = []
    for _ in range(2):
        a, b, c = rng.uniform(0.2, 0.8, 3)
        img = np.stack([a * x + 0.2, b * y + 0.1, c * (1 - x * y)], axis=-1)
        img += 0.05 * rng.standard_normal(img.shape)
        out.append(np.clip(img, 0, 1).astype(np.float32))
    return out


def _masks() -> list[np.ndarray]:
    """Two different masks (1: repaint): a rectangle and a disc, [H, W] floats."""
    y, x = np.mgrid[0:H, 0:W]
    rect = ((y > 16) & (y < 48) & (x > 8) & (x < 32)).astype(np.float32)
    disc = ((y - 30) ** 2 + (x - 26) ** 2 < 15**2).astype(np.float32)
    return [rect, disc]


@pytest.fixture
def same_noise(monkeypatch):
    """diffusers' SDXL image pipelines draw `holder["noise"]` and encode to the posterior's mode."""
    from diffusers.pipelines.stable_diffusion_xl import (
        pipeline_stable_diffusion_xl_img2img,
        pipeline_stable_diffusion_xl_inpaint,
    )

    return patch_noise(
        monkeypatch, pipeline_stable_diffusion_xl_img2img, pipeline_stable_diffusion_xl_inpaint
    )


@pytest.fixture(scope="module")
def ours(tiny_sdxl_path):
    return load_pipeline(tiny_sdxl_path, dtype="float32")


@pytest.fixture(scope="module")
def base_reference(tiny_sdxl_path):
    return diffusers_sdxl(tiny_sdxl_path)


@pytest.fixture(scope="module")
def inpaint_path(tmp_path_factory):
    from tests.fixtures.tiny_sdxl import build_tiny_sdxl

    return build_tiny_sdxl(tmp_path_factory.mktemp("tiny_sdxl_inpaint"), inpaint=True)


def _check(got, expected, what):
    assert got.shape == expected.shape, (got.shape, expected.shape)
    err = float(np.abs(got - expected).max())
    print(f"{what}: max abs pixel difference from diffusers {err:.2e}")  # the figure the note quotes (-rP)
    assert err <= 1e-3, f"{what}: max abs pixel difference {err:.2e}"
    assert expected.std() > 1e-3  # a real image, not a constant


def test_img2img_matches_diffusers_and_never_recompiles(ours, base_reference, same_noise):
    import torch
    from diffusers import StableDiffusionXLImg2ImgPipeline

    ref = StableDiffusionXLImg2ImgPipeline.from_pipe(base_reference)
    ref.set_progress_bar_config(disable=True)
    images, noise = _images(0), np.random.default_rng(1).standard_normal((2, 4, H // 2, W // 2))
    noise = noise.astype(np.float32)
    same_noise["noise"] = noise
    kw = dict(negative_prompt=NEGATIVE, num_inference_steps=STEPS, guidance_scale=5.0, strength=0.6)
    expected = ref(
        PROMPTS, image=[torch.from_numpy(i.transpose(2, 0, 1)) for i in images], output_type="np", **kw
    )
    got = ours(PROMPTS, image=images, height=H, width=W, latents=noise, output_type="np", **kw)
    _check(got.images, expected.images, "img2img")
    assert "image_encode" in got.timings

    # Another strength, other images and seeds: nothing compiles; the output moves.
    before = ours.compilations
    steps = []
    other = ours(
        PROMPTS,
        image=_images(5)[::-1],
        height=H,
        width=W,
        latents=noise[::-1].copy(),
        negative_prompt=NEGATIVE,
        num_inference_steps=STEPS,
        strength=0.3,
        callback=lambda s, t: steps.append((s, t)),
        output_type="np",
    )
    assert ours.compilations == before and not other.compiled
    assert steps == [(1, 1)]  # int(4 x 0.3) = 1 step runs, reported as 1 of 1
    assert not np.allclose(other.images, got.images)


def test_img2img_with_unipc_matches_diffusers(ours, base_reference, same_noise):
    """UniPC's VP form started mid-schedule: diffusers' add_noise at the strength's start step, then its
    history, orders and corrector restarted there (6 steps at strength 0.7: 4 run, reaching order 2)."""
    import torch
    from diffusers import StableDiffusionXLImg2ImgPipeline, UniPCMultistepScheduler

    ref = StableDiffusionXLImg2ImgPipeline.from_pipe(base_reference)
    ref.scheduler = UniPCMultistepScheduler.from_config(base_reference.scheduler.config)
    ref.set_progress_bar_config(disable=True)
    images = _images(3)
    same_noise["noise"] = noise = (
        np.random.default_rng(2).standard_normal((2, 4, H // 2, W // 2)).astype(np.float32)
    )
    kw = dict(negative_prompt=NEGATIVE, num_inference_steps=6, guidance_scale=5.0, strength=0.7)
    expected = ref(
        PROMPTS, image=[torch.from_numpy(i.transpose(2, 0, 1)) for i in images], output_type="np", **kw
    )
    got = ours(
        PROMPTS, image=images, height=H, width=W, latents=noise, scheduler="unipc", output_type="np", **kw
    )
    _check(got.images, expected.images, "img2img with unipc")


def test_heun_from_a_strength_and_a_split_matches_diffusers(ours, base_reference, same_noise):
    """A second-order scheduler started mid-schedule. At a strength diffusers starts on step t_start's first call
    (t_start x order) from the image noised to that call's sigma; from a denoising_start it keeps one call more
    when the kept count is even, so that it starts on a step's first call. Heun: 5 steps are 9 calls; the split
    at 0.6 cuts them 5 + 4 (kept 4, even: the refiner runs 5, the base's last call again)."""
    import torch
    from diffusers import HeunDiscreteScheduler, StableDiffusionXLImg2ImgPipeline

    base = type(base_reference).from_pipe(base_reference)
    base.scheduler = HeunDiscreteScheduler.from_config(base_reference.scheduler.config)
    refiner = StableDiffusionXLImg2ImgPipeline.from_pipe(base)
    for pipe in (base, refiner):
        pipe.set_progress_bar_config(disable=True)
    kw = dict(negative_prompt=NEGATIVE, num_inference_steps=5, guidance_scale=5.0)
    images = _images(4)
    same_noise["noise"] = noise = (
        np.random.default_rng(4).standard_normal((2, 4, H // 2, W // 2)).astype(np.float32)
    )
    pixels = [torch.from_numpy(i.transpose(2, 0, 1)) for i in images]
    expected = refiner(PROMPTS, image=pixels, strength=0.6, output_type="np", **kw).images
    kw["scheduler"] = "heun"
    steps = []
    got = ours(
        PROMPTS,
        image=images,
        height=H,
        width=W,
        latents=noise,
        strength=0.6,
        callback=lambda s, t: steps.append(t),
        output_type="np",
        **kw,
    )
    _check(got.images, expected, "img2img with heun")
    assert steps == [5] * 5  # int(5 x 0.6) = 3 steps from step 2: calls 4 to 8

    latents = np.random.default_rng(9).standard_normal((2, 4, H // 2, W // 2)).astype(np.float32)
    del kw["scheduler"]
    handed = base(
        PROMPTS,
        height=H,
        width=W,
        latents=torch.from_numpy(latents),
        denoising_end=0.6,
        output_type="latent",
        **kw,
    )
    expected = refiner(PROMPTS, image=handed.images, denoising_start=0.6, output_type="np", **kw).images
    kw["scheduler"] = "heun"
    ours_handed = ours(
        PROMPTS, height=H, width=W, latents=latents, denoising_end=0.6, output_type="latent", **kw
    )
    assert float(np.abs(ours_handed.images - handed.images.numpy()).max()) <= 1e-3
    steps.clear()
    got = ours(
        PROMPTS,
        image=ours_handed.images,
        denoising_start=0.6,
        callback=lambda s, t: steps.append(t),
        output_type="np",
        **kw,
    )
    _check(got.images, expected, "heun base + refiner")
    assert steps == [5] * 5


def test_img2img_denoising_end_cuts_the_strengths_steps_as_diffusers(ours, base_reference, same_noise):
    """diffusers' img2img applies denoising_end to the steps its strength left: 8 steps at strength 0.75 run
    the last 6 timesteps; denoising_end 0.5 keeps those >= 500 of them."""
    import torch
    from diffusers import StableDiffusionXLImg2ImgPipeline

    ref = StableDiffusionXLImg2ImgPipeline.from_pipe(base_reference)
    ref.set_progress_bar_config(disable=True)
    images, noise = _images(2), np.random.default_rng(3).standard_normal((2, 4, H // 2, W // 2))
    same_noise["noise"] = noise = noise.astype(np.float32)
    kw = dict(negative_prompt=NEGATIVE, num_inference_steps=8, guidance_scale=5.0, strength=0.75)
    kw |= dict(denoising_end=0.5, output_type="latent")
    pixels = [torch.from_numpy(i.transpose(2, 0, 1)) for i in images]
    expected = ref(PROMPTS, image=pixels, **kw).images.numpy()
    steps = []
    got = ours(
        PROMPTS, image=images, height=H, width=W, latents=noise, callback=lambda s, t: steps.append(t), **kw
    )
    assert float(np.abs(got.images - expected).max()) <= 1e-3 * float(np.abs(expected).max())
    assert steps == [2, 2]  # Euler's 8 timesteps (999, 856.3, 713.6, 570.9, 428.1...) from the 3rd: 2 >= 500
    whole = ours(PROMPTS, image=images, height=H, width=W, latents=noise, **{**kw, "denoising_end": None})
    assert float(np.abs(whole.images - got.images).max()) > 0.1  # the cut moved the latents


def test_base_then_refiner_by_denoising_end_and_start_matches_diffusers(ours, base_reference, same_noise):
    """SDXL's ensemble of experts, as diffusers documents it: the base stops at denoising_end and returns
    latents, which image-to-image takes as `image=` from denoising_start on, adding no noise (the same folder
    stands in for the refiner: the split is the point). DPM-Solver restarts its multistep history at the
    split, so the two calls differ from one whole run; they equal diffusers' two calls."""
    import torch
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionXLImg2ImgPipeline

    base = type(base_reference).from_pipe(base_reference)  # the same modules; a scheduler of its own below
    base.scheduler = DPMSolverMultistepScheduler.from_config(base_reference.scheduler.config)
    refiner = StableDiffusionXLImg2ImgPipeline.from_pipe(base)
    for pipe in (base, refiner):
        pipe.set_progress_bar_config(disable=True)
    latents = np.random.default_rng(7).standard_normal((2, 4, H // 2, W // 2)).astype(np.float32)
    kw = dict(negative_prompt=NEGATIVE, num_inference_steps=8, guidance_scale=5.0)
    handed = base(
        PROMPTS,
        height=H,
        width=W,
        latents=torch.from_numpy(latents),
        denoising_end=0.7,
        output_type="latent",
        **kw,
    )
    expected = refiner(PROMPTS, image=handed.images, denoising_start=0.7, output_type="np", **kw).images
    # Latents as image= without denoising_start: noised to the strength's start step (diffusers' add_noise).
    same_noise["noise"] = noise = np.random.default_rng(8).standard_normal(latents.shape).astype(np.float32)
    noised = refiner(PROMPTS, image=handed.images, strength=0.5, output_type="np", **kw).images

    kw["scheduler"] = "dpmpp_2m"
    ours_handed = ours(
        PROMPTS, height=H, width=W, latents=latents, denoising_end=0.7, output_type="latent", **kw
    )
    assert float(np.abs(ours_handed.images - handed.images.numpy()).max()) <= 1e-3
    steps = []
    got = ours(
        PROMPTS,
        image=ours_handed.images,
        denoising_start=0.7,
        callback=lambda s, t: steps.append(t),
        output_type="np",
        **kw,
    )
    _check(got.images, expected, "base + refiner")
    again = ours(PROMPTS, image=ours_handed.images, strength=0.5, latents=noise, output_type="np", **kw)
    _check(again.images, noised, "img2img from latents at strength 0.5")
    assert steps == [2, 2]  # DPM-Solver's 8 timesteps (leading): 2 under the cut-off 300
    # Other fractions (and the other base's latents) compile nothing: the start and stop are traced.
    before = ours.compilations
    again = ours(
        PROMPTS,
        image=ours_handed.images[::-1].copy(),
        denoising_start=0.5,
        denoising_end=0.9,
        output_type="np",
        **kw,
    )
    assert ours.compilations == before and not again.compiled
    # Bad splits are clear.
    with pytest.raises(PipelineError, match=r"denoising_end \(0.5\) must be above denoising_start \(0.7\)"):
        ours(PROMPTS, image=ours_handed.images, denoising_start=0.7, denoising_end=0.5, **kw)
    with pytest.raises(
        PipelineError, match="denoising_start applies to image-to-image .*, not text-to-image"
    ):
        ours(PROMPTS, height=H, width=W, denoising_start=0.7, **kw)
    with pytest.raises(PipelineError, match="denoising_start 0.9999 leaves no step"):
        ours(PROMPTS, image=ours_handed.images, denoising_start=0.9999, **kw)
    with pytest.raises(
        PipelineError, match=r"image: expected shape \(2, 4, 32, 24\) \[B, C, h, w\], got \(2, 4, 16, 12\)"
    ):
        ours(PROMPTS, image=ours_handed.images[:, :, ::2, ::2], height=H, width=W, denoising_start=0.7, **kw)


def test_inpaint_base_then_refiner_matches_diffusers(ours, base_reference, same_noise):
    """diffusers' inpainting with a refiner: the base inpaints to denoising_end and returns latents whose known
    region is the clean image's (its blend's `i < len(timesteps) - 1` counts the cut timesteps: the last step
    puts the image back unnoised); the refiner inpaints from those latents (image=latents, the same masks) from
    denoising_start on, adding no noise, its known region those latents noised to each next step. A picture
    with denoising_start starts from its own clean latents, as diffusers does."""
    import torch
    from diffusers import StableDiffusionXLInpaintPipeline

    ref = StableDiffusionXLInpaintPipeline.from_pipe(base_reference)
    ref.set_progress_bar_config(disable=True)
    images, masks = _images(6), _masks()
    pixels = [torch.from_numpy(i.transpose(2, 0, 1)) for i in images]
    torch_masks = [torch.from_numpy(m[None]) for m in masks]
    rng = np.random.default_rng(9)
    noise, noise_2 = (rng.standard_normal((2, 4, H // 2, W // 2)).astype(np.float32) for _ in range(2))
    kw = dict(negative_prompt=NEGATIVE, num_inference_steps=8, guidance_scale=5.0)
    theirs = dict(mask_image=torch_masks, height=H, width=W, **kw)
    same_noise["noise"] = noise
    handed = ref(PROMPTS, image=pixels, denoising_end=0.6, output_type="latent", **theirs).images
    same_noise["noise"] = noise_2
    expected = ref(PROMPTS, image=handed, denoising_start=0.6, output_type="np", **theirs).images
    from_picture = ref(PROMPTS, image=pixels, denoising_start=0.6, output_type="np", **theirs).images

    kw |= dict(mask_image=masks, output_type="np")
    ours_handed = ours(
        PROMPTS,
        image=images,
        height=H,
        width=W,
        latents=noise,
        denoising_end=0.6,
        **{**kw, "output_type": "latent"},
    )
    handed = handed.numpy()
    assert float(np.abs(ours_handed.images - handed).max()) <= 1e-3 * float(np.abs(handed).max())
    steps = []  # no size below: the latents' own
    got = ours(
        PROMPTS,
        image=ours_handed.images,
        denoising_start=0.6,
        latents=noise_2,
        callback=lambda s, t: steps.append(t),
        **kw,
    )
    _check(got.images, expected, "inpaint base + refiner")
    assert steps == [4, 4, 4, 4]  # Euler's 8 leading timesteps (876, 751, ..., 126, 1): 4 under 400
    again = ours(PROMPTS, image=images, height=H, width=W, denoising_start=0.6, latents=noise_2, **kw)
    _check(again.images, from_picture, "inpaint from a picture at denoising_start")
    # Another fraction and other masks compile nothing.
    before = ours.compilations
    other = ours(
        PROMPTS,
        image=ours_handed.images,
        denoising_start=0.3,
        latents=noise,
        **{**kw, "mask_image": masks[::-1]},
    )
    assert ours.compilations == before and not other.compiled


def test_img2img_without_a_size_takes_the_images_own_as_diffusers(ours, base_reference, same_noise):
    """StableDiffusionXLImg2ImgPipeline has no height/width: the output is the (first) image's size, rounded
    down to the VAE factor; ours does the same when a call names no size, rounded down to the model's size
    multiple (8 = SDXL's VAE factor; the tiny VAE's factor is 2, so a size of 8s is compared). Inpaint keeps the
    model's default size, as diffusers' inpaint pipeline."""
    from diffusers import StableDiffusionXLImg2ImgPipeline
    from PIL import Image

    from meshserve.models.components.image_processor import image_size

    ref = StableDiffusionXLImg2ImgPipeline.from_pipe(base_reference)
    ref.set_progress_bar_config(disable=True)
    photo = Image.fromarray((_images(2, 72, 40)[0] * 255).astype(np.uint8))  # 40 wide, 72 high
    noise = np.random.default_rng(3).standard_normal((1, 4, 36, 20)).astype(np.float32)
    same_noise["noise"] = noise
    kw = dict(num_inference_steps=STEPS, guidance_scale=5.0, strength=0.7, output_type="np")
    expected = ref(PROMPTS[:1], image=photo, **kw).images
    got = ours(PROMPTS[:1], image=photo, latents=noise, **kw).images
    assert got.shape == (1, 72, 40, 3)
    _check(got, expected, "img2img at the image's size")
    assert image_size([photo.resize((45, 75))], "image", 8) == (72, 40)  # rounded down, the first image's
    d = ours.defaults
    masked = ours(PROMPTS[:1], image=photo, mask_image=Image.new("L", (40, 72), 255), **kw).images
    assert masked.shape == (1, d["height"], d["width"], 3) != got.shape


def test_img2img_micro_conditioning_matches_diffusers(ours, base_reference, same_noise):
    """The img2img pipeline's micro-conditioning rule differs from text-to-image's: each negative size defaults
    to the prompt's (so one acts alone) and the negative takes the prompt's crop (a negative crop is ignored)."""
    import torch
    from diffusers import StableDiffusionXLImg2ImgPipeline

    ref = StableDiffusionXLImg2ImgPipeline.from_pipe(base_reference)
    ref.set_progress_bar_config(disable=True)
    images, noise = _images(2), np.random.default_rng(3).standard_normal((2, 4, H // 2, W // 2))
    same_noise["noise"] = noise = noise.astype(np.float32)
    micro = dict(
        original_size=(256, 192),
        crops_coords_top_left=(8, 8),
        negative_original_size=(32, 32),
        negative_crops_coords_top_left=(4, 0),
    )
    kw = dict(negative_prompt=NEGATIVE, num_inference_steps=STEPS, guidance_scale=5.0, strength=0.8)
    expected = ref(
        PROMPTS,
        image=[torch.from_numpy(i.transpose(2, 0, 1)) for i in images],
        output_type="np",
        **micro,
        **kw,
    )
    got = ours(PROMPTS, image=images, height=H, width=W, latents=noise, output_type="np", **micro, **kw)
    _check(got.images, expected.images, "img2img micro-conditioning")
    plain = ours(PROMPTS, image=images, height=H, width=W, latents=noise, output_type="np", **kw)
    assert float(np.abs(plain.images - got.images).max()) > 1e-2


def test_the_refiner_matches_diffusers_img2img(tmp_path, same_noise):
    """A refiner folder (stable-diffusion-xl-refiner-1.0's kind: requires_aesthetics_score, no first text
    encoder) loads as image-to-image and inpaint only, conditions on text_encoder_2 alone, and takes diffusers'
    aesthetic_score / negative_aesthetic_score per row in its five time ids (with the negative's own crop):
    each row equals StableDiffusionXLImg2ImgPipeline on the same folder, fp32."""
    import torch
    from diffusers import StableDiffusionXLImg2ImgPipeline

    from tests.fixtures.tiny_sdxl import build_tiny_sdxl

    folder = build_tiny_sdxl(tmp_path / "refiner", refiner=True)
    refiner = load_pipeline(folder, dtype="float32")
    assert refiner.tasks == ("image-to-image", "inpaint") and refiner.encoders == ("text_encoder_2",)
    assert (refiner.defaults["aesthetic_score"], refiner.defaults["negative_aesthetic_score"]) == (6.0, 2.5)
    reference = StableDiffusionXLImg2ImgPipeline.from_pretrained(str(folder), torch_dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    images, noise = _images(7), np.random.default_rng(8).standard_normal((2, 4, H // 2, W // 2))
    noise = noise.astype(np.float32)
    kw = dict(negative_prompt=NEGATIVE, num_inference_steps=STEPS, guidance_scale=5.0, strength=0.8)
    micro = dict(crops_coords_top_left=(8, 4), negative_crops_coords_top_left=(2, 2))
    scores = {"aesthetic_score": [7.5, 6.0], "negative_aesthetic_score": [1.0, 2.5]}
    got = refiner(
        PROMPTS, image=images, height=H, width=W, latents=noise, output_type="np", **scores, **micro, **kw
    )
    worst = 0.0
    for row in range(2):
        same_noise["noise"] = noise[row : row + 1]
        expected = reference(
            PROMPTS[row],
            image=torch.from_numpy(images[row].transpose(2, 0, 1))[None],
            output_type="np",
            aesthetic_score=scores["aesthetic_score"][row],
            negative_aesthetic_score=scores["negative_aesthetic_score"][row],
            **micro,
            **{**kw, "negative_prompt": NEGATIVE[row]},
        ).images[0]
        worst = max(worst, float(np.abs(got.images[row] - expected).max()))
    print(f"refiner img2img: max abs pixel difference from diffusers {worst:.2e}")
    assert worst <= 1e-3
    plain = refiner(PROMPTS, image=images, height=H, width=W, latents=noise, output_type="np", **micro, **kw)
    assert float(np.abs(plain.images[0] - got.images[0]).max()) > 100 * max(worst, 1e-5)  # row 0's 7.5 acted
    with pytest.raises(PipelineError, match="needs an image|image-to-image"):
        refiner("a cat", height=H, width=W, num_inference_steps=STEPS)
    with pytest.raises(PipelineError, match="prompt_2"):
        refiner("a cat", image=images[0], prompt_2="oil", height=H, width=W, num_inference_steps=STEPS)


def test_inpaint_base_unet_matches_diffusers(ours, base_reference, same_noise):
    from diffusers import StableDiffusionXLInpaintPipeline
    from PIL import Image

    ref = StableDiffusionXLInpaintPipeline.from_pipe(base_reference)
    ref.set_progress_bar_config(disable=True)
    # PIL inputs at another size: both sides resize them (Lanczos) to 64 x 48.
    images = [Image.fromarray((i * 255).astype(np.uint8)) for i in _images(2, 80, 56)]
    masks = [Image.fromarray((m * 255).astype(np.uint8)).resize((56, 80)) for m in _masks()]
    noise = np.random.default_rng(3).standard_normal((2, 4, H // 2, W // 2)).astype(np.float32)
    same_noise["noise"] = noise
    kw = dict(
        image=images,
        mask_image=masks,
        height=H,
        width=W,
        negative_prompt=NEGATIVE,
        num_inference_steps=STEPS,
        guidance_scale=5.0,
        output_type="np",
    )
    for strength in (0.6, 1.0):  # 1.0: diffusers starts from pure noise x init sigma
        expected = ref(PROMPTS, strength=strength, **kw).images
        got = ours(PROMPTS, strength=strength, latents=noise, **kw).images
        _check(got, expected, f"inpaint (4-channel UNet) strength {strength}")


def test_padding_mask_crop_matches_diffusers(ours, base_reference, same_noise):
    """Only the masked region, at the call's size, laid back into the image (its own size): diffusers' call
    takes one PIL image and mask and gives PIL images, so the comparison is in 8-bit pixels."""
    from diffusers import StableDiffusionXLInpaintPipeline
    from PIL import Image

    ref = StableDiffusionXLInpaintPipeline.from_pipe(base_reference)
    ref.set_progress_bar_config(disable=True)
    image = Image.fromarray((_images(6, 90, 70)[0] * 255).astype(np.uint8))
    values = np.zeros((90, 70), np.uint8)
    values[30:52, 12:40] = 255
    values[30:52, 12] = 120  # a soft edge: blended by the overlay
    mask = Image.fromarray(values)
    noise = np.random.default_rng(8).standard_normal((2, 4, H // 2, W // 2)).astype(np.float32)
    same_noise["noise"] = noise
    kw = dict(image=image, mask_image=mask, height=H, width=W, negative_prompt=NEGATIVE, strength=0.75)
    kw |= dict(num_inference_steps=STEPS, guidance_scale=5.0, padding_mask_crop=4, output_type="pil")
    expected = np.stack([np.asarray(im) for im in ref(PROMPTS, **kw).images])
    got = ours(PROMPTS, latents=noise, **kw).images
    assert [im.size for im in got] == [(70, 90)] * 2  # the image's size, not the call's
    got = np.stack([np.asarray(im) for im in got])
    diff = np.abs(got.astype(int) - expected.astype(int))
    print(f"padding_mask_crop: max {diff.max()} / 255, {np.mean(diff > 0):.2%} of pixel values differ")
    # The outputs are 8-bit: a float 1e-4 apart can round to the next level, which the Lanczos scaling
    # back into the box spreads to its neighbours.
    assert diff.max() <= 2 and np.mean(diff > 0) < 0.02
    assert np.array_equal(
        got[:, values == 0], np.broadcast_to(np.asarray(image)[values == 0], got[:, values == 0].shape)
    )
    plain = np.asarray(ours(PROMPTS, latents=noise, **{**kw, "padding_mask_crop": None}).images[0])
    assert plain.shape == (H, W, 3)  # without it: the call's size
    assert np.std(got[0][values > 0].astype(float)) > 1  # the region was repainted, not copied
    with pytest.raises(PipelineError, match="applies to inpaint"):
        ours("a cat", image=image, padding_mask_crop=4, num_inference_steps=STEPS)
    for bad in (-1, 2.5, True):
        with pytest.raises(PipelineError, match="int >= 0"):
            ours("a cat", image=image, mask_image=mask, padding_mask_crop=bad, num_inference_steps=STEPS)
    with pytest.raises(PipelineError, match="output_type 'latent'"):
        ours(
            "a",
            image=image,
            mask_image=mask,
            padding_mask_crop=0,
            output_type="latent",
            num_inference_steps=2,
        )


def test_inpaint_unet_9_channels_matches_diffusers(inpaint_path, same_noise):
    import torch
    from diffusers import StableDiffusionXLInpaintPipeline

    pipe = load_pipeline(inpaint_path, dtype="float32")
    assert pipe.tasks == ("inpaint",) and pipe.limits["tasks"] == ["inpaint"]
    ref = StableDiffusionXLInpaintPipeline.from_pretrained(str(inpaint_path), torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    images, masks = _images(4), _masks()
    noise = np.random.default_rng(5).standard_normal((2, 4, H // 2, W // 2)).astype(np.float32)
    same_noise["noise"] = noise
    kw = dict(
        negative_prompt=NEGATIVE,
        num_inference_steps=STEPS,
        guidance_scale=5.0,
        strength=0.75,
        output_type="np",
    )
    expected = ref(
        PROMPTS,
        image=[torch.from_numpy(i.transpose(2, 0, 1)) for i in images],
        mask_image=[torch.from_numpy(m[None]) for m in masks],
        height=H,
        width=W,
        **kw,
    ).images
    got = pipe(PROMPTS, image=images, mask_image=masks, height=H, width=W, latents=noise, **kw).images
    _check(got, expected, "inpaint (9-channel UNet)")
    with pytest.raises(PipelineError, match="needs an image"):
        pipe("a cat", height=H, width=W, num_inference_steps=1)
    with pytest.raises(PipelineError, match="image-to-image"):
        pipe("a cat", image=images[0], height=H, width=W, num_inference_steps=1)
    latents = np.zeros((2, 4, H // 2, W // 2), np.float32)  # diffusers has no masked image latents for them
    with pytest.raises(PipelineError, match="latents given as image= inpaint with a 4-channel UNet only"):
        pipe(PROMPTS, image=latents, mask_image=masks, denoising_start=0.5, num_inference_steps=STEPS)


def test_tasks_limits_batch_key_and_bad_inputs(ours):
    assert ours.tasks == ("text-to-image", "image-to-image", "inpaint")
    limits = ours.limits
    assert limits["tasks"] == list(ours.tasks)
    assert limits["strength"] == {
        "min": 0.0,
        "max": 1.0,
        "defaults": {"image-to-image": 0.3, "inpaint": 0.9999},
    }
    text = ours.batch_key({"width": W, "height": H})
    img = ours.batch_key({"width": W, "height": H, "image": "ref"})
    assert text[:2] == ("text-to-image", None) and img[:2] == ("image-to-image", 0.3)
    assert ours.batch_key({"image": "ref", "strength": 0.5}) != ours.batch_key({"image": "ref"})
    image = _images(0)[0]
    kw = dict(height=H, width=W, num_inference_steps=4)
    bad = [
        (dict(image=image, strength=0.0), "strength must be in"),
        (dict(image=image, strength=1.5), "strength must be in"),
        (dict(image=image, strength=0.1), "runs no step"),
        (dict(strength=0.5), "strength applies to image-to-image"),
        (dict(mask_image=image[..., 0]), "needs an image"),
        (dict(image=image[..., :2]), r"\[H, W, 3\]"),
        (dict(image=image * 2), r"in \[0, 1\]"),
        (dict(image=[image] * 3), "one per prompt"),
        (dict(image=image, mask_image=image), r"\[H, W\] or \[H, W, 1\]"),
        (dict(image="a path"), "PIL image or a numpy array"),
    ]
    for extra, match in bad:
        with pytest.raises(PipelineError, match=match):
            ours("a cat", **kw, **extra)


def test_warm_up_runs_each_task_with_an_image(ours, monkeypatch):
    calls = []
    monkeypatch.setattr(type(ours), "__call__", lambda self, prompt, **kw: calls.append(kw))
    ours.warm_up(batch_sizes=(1,), tasks=["image-to-image", "inpaint"])
    assert len(calls) == 4  # 2 tasks x CFG off/on
    img2img, inpaint = calls[0], calls[2]
    assert (
        img2img["image"].shape == (64, 64, 3) and img2img["strength"] == 1.0 and "mask_image" not in img2img
    )
    assert inpaint["mask_image"].shape == (64, 64) and inpaint["strength"] == 1.0
    calls.clear()
    ours.warm_up(batch_sizes=(1,))  # the text task only, as before
    assert len(calls) == 2 and all("image" not in kw for kw in calls)
    with pytest.raises(PipelineError, match="does not take"):
        ours.warm_up(tasks=["image-to-video"])


@pytest.mark.parametrize(
    "name",
    [
        "euler", "euler_ancestral", "ddim", "dpmpp_2m", "lcm", "unipc", "lms", "heun", "dpm2", "dpmpp_sde",
        "dpm2_ancestral", "edm_dpm", "edm_euler", "ddpm", "deis", "pndm", "dpmpp_2s",
    ],
)  # fmt: skip
def test_noise_to_and_start_step_equal_diffusers(tiny_sdxl_path, name):
    """The image noised to the start step (each scheduler's add_noise at its begin index) and the start step
    of a strength (diffusers' SDXL and Flux get_timesteps), for the schedulers the parity runs above do not
    use; no model involved."""
    import json
    import types

    import diffusers
    import torch
    from diffusers import FluxImg2ImgPipeline, StableDiffusionXLImg2ImgPipeline

    from meshserve.models.engine.image_inputs import noise_to, start_step
    from meshserve.models.schedulers import make_scheduler

    config = json.loads((tiny_sdxl_path / "scheduler" / "scheduler_config.json").read_text())
    classes = {
        "euler": "EulerDiscreteScheduler",
        "euler_ancestral": "EulerAncestralDiscreteScheduler",
        "ddim": "DDIMScheduler",
        "dpmpp_2m": "DPMSolverMultistepScheduler",
        "lcm": "LCMScheduler",
        "unipc": "UniPCMultistepScheduler",
        "lms": "LMSDiscreteScheduler",
        "heun": "HeunDiscreteScheduler",
        "dpm2": "KDPM2DiscreteScheduler",
        "dpmpp_sde": "DPMSolverSDEScheduler",
        "dpm2_ancestral": "KDPM2AncestralDiscreteScheduler",
        "edm_dpm": "EDMDPMSolverMultistepScheduler",
        "edm_euler": "EDMEulerScheduler",
        "ddpm": "DDPMScheduler",
        "deis": "DEISMultistepScheduler",
        "pndm": "PNDMScheduler",
        "dpmpp_2s": "DPMSolverSinglestepScheduler",
    }
    edm = name.startswith("edm")
    if edm:  # an EDM folder's (by class name: no beta-schedule model runs on them)
        config = {**config, "sigma_min": 0.002, "sigma_max": 80.0}
    ref = getattr(diffusers, classes[name]).from_config(config)
    ours = make_scheduler(classes[name] if edm else name, config)
    rng = np.random.default_rng(0)
    x, noise = rng.standard_normal((2, 4, 6, 5)).astype(np.float32), rng.standard_normal((2, 4, 6, 5))
    noise = noise.astype(np.float32)
    for steps, strength in ((10, 0.3), (7, 0.75), (4, 0.6), (25, 1.0)):
        holder = types.SimpleNamespace(scheduler=ref)
        ref.set_timesteps(steps)
        timesteps, _ = StableDiffusionXLImg2ImgPipeline.get_timesteps(holder, steps, strength, "cpu")
        start = start_step(steps, strength, "int")
        # The first model call it runs: step `start`'s first (order 2: two calls a step but the last).
        assert start * ours.order == len(ref.timesteps) - len(timesteps)
        expected = ref.add_noise(
            torch.from_numpy(x), torch.from_numpy(noise), timesteps[:1].repeat(2)
        ).numpy()
        got = np.asarray(noise_to(ours, ours.schedule(steps), x, noise, start * ours.order))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        if (
            ours.model_calls(steps) == steps
        ):  # (Flux's rule, for its flow schedulers: one call a step is enough)
            flux_timesteps, _ = FluxImg2ImgPipeline.get_timesteps(holder, steps, strength, "cpu")
            assert start_step(steps, strength, "float") == steps - len(flux_timesteps)


def test_vae_latents_statistics_scale_img2img_not_inpaint(tiny_sdxl_path, tmp_path, same_noise):
    """A VAE config with latents_mean / latents_std: diffusers' img2img encodes (z - mean) x scaling / std,
    its inpaint pipeline z x scaling alone (and both decode with the statistics); so do ours."""
    import json
    import shutil

    import torch
    from diffusers import StableDiffusionXLImg2ImgPipeline, StableDiffusionXLInpaintPipeline

    folder = tmp_path / "sdxl"
    shutil.copytree(tiny_sdxl_path, folder)
    path = folder / "vae" / "config.json"
    stats = {"latents_mean": [0.1, -0.2, 0.3, 0.05], "latents_std": [0.5, 2.0, 1.5, 0.8]}
    path.write_text(json.dumps({**json.loads(path.read_text()), **stats}))
    pipe = load_pipeline(folder, dtype="float32")
    noise = np.random.default_rng(4).standard_normal((2, 4, H // 2, W // 2)).astype(np.float32)
    same_noise["noise"] = noise
    kw = dict(
        image=_images(5), height=H, width=W, num_inference_steps=STEPS, guidance_scale=5.0, output_type="np"
    )
    for cls, extra in (
        (StableDiffusionXLImg2ImgPipeline, {}),
        (StableDiffusionXLInpaintPipeline, {"mask_image": _masks()}),
    ):
        ref = cls.from_pretrained(str(folder), torch_dtype=torch.float32)
        ref.set_progress_bar_config(disable=True)
        expected = ref(PROMPTS, strength=0.6, **extra, **kw).images
        got = pipe(PROMPTS, strength=0.6, latents=noise, **extra, **kw).images
        _check(got, expected, f"{cls.__name__} with latents_mean/std")


def test_a_schedule_shorter_than_the_steps_starts_where_diffusers_does(tiny_sdxl_path, tmp_path, same_noise):
    """DPM-Solver with lambda_min_clipped makes fewer steps than asked (10 trailing steps of squaredcos_cap_v2
    at -1: 8). diffusers' get_timesteps takes the start from the requested count: strength 0.5 starts at
    step 5 and runs 3; we ran 4 (0.32 max abs pixel off diffusers), and strength 0.3 (start 7) 2 for its 1."""
    import json
    import shutil

    import torch
    from diffusers import StableDiffusionXLImg2ImgPipeline

    folder = tmp_path / "dpm_clipped"
    shutil.copytree(tiny_sdxl_path, folder)
    config_file = folder / "scheduler" / "scheduler_config.json"
    config = json.loads(config_file.read_text())
    config.update(
        _class_name="DPMSolverMultistepScheduler",
        beta_schedule="squaredcos_cap_v2",
        lambda_min_clipped=-1.0,
        timestep_spacing="trailing",
    )
    config_file.write_text(json.dumps(config))
    index = json.loads((folder / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "DPMSolverMultistepScheduler"]
    (folder / "model_index.json").write_text(json.dumps(index))

    ref = StableDiffusionXLImg2ImgPipeline.from_pretrained(str(folder), torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    ours = load_pipeline(folder, dtype="float32")
    images = _images(3)[:1]
    noise = np.random.default_rng(2).standard_normal((1, 4, H // 2, W // 2)).astype(np.float32)
    same_noise["noise"] = noise
    for strength, runs in ((0.5, 3), (0.3, 1)):
        kw = dict(num_inference_steps=10, guidance_scale=5.0, strength=strength)
        expected = ref(
            PROMPTS[:1], image=[torch.from_numpy(images[0].transpose(2, 0, 1))], output_type="np", **kw
        )
        assert len(ref.scheduler.timesteps) - ref.scheduler._begin_index == runs
        totals = []
        got = ours(
            PROMPTS[:1],
            image=images,
            height=H,
            width=W,
            latents=noise,
            output_type="np",
            callback=lambda s, t, totals=totals: totals.append(t),
            **kw,
        )
        assert totals[-1] == runs
        _check(got.images, expected.images, f"img2img at strength {strength}, a clipped schedule")

"""The whole SDXL pipeline against diffusers' StableDiffusionXLPipeline on the same weights and latents."""

import numpy as np
import pytest

from meshserve.models import GenerationCancelled, PipelineError, load_pipeline
from tests.fixtures.tiny_sdxl import diffusers_sdxl

H, W = 64, 48  # non-square on purpose


@pytest.fixture(scope="module")
def ours(tiny_sdxl_path):
    return load_pipeline(tiny_sdxl_path, dtype="float32")


@pytest.fixture(scope="module")
def reference(tiny_sdxl_path):
    return diffusers_sdxl(tiny_sdxl_path)


def _diffusers_scheduler(pipe, name):
    from diffusers import (
        DDIMScheduler,
        DEISMultistepScheduler,
        DPMSolverMultistepScheduler,
        DPMSolverSinglestepScheduler,
        EulerDiscreteScheduler,
        HeunDiscreteScheduler,
        PNDMScheduler,
        UniPCMultistepScheduler,
    )

    base = name.removesuffix("_karras")
    cls = {
        "euler": EulerDiscreteScheduler,
        "ddim": DDIMScheduler,
        "dpmpp_2m": DPMSolverMultistepScheduler,
        "dpmpp_2s": DPMSolverSinglestepScheduler,
        "unipc": UniPCMultistepScheduler,
        "heun": HeunDiscreteScheduler,
        "deis": DEISMultistepScheduler,
        "pndm": PNDMScheduler,
    }[base]
    # diffusers' docs: A1111's "Karras". Said either way: from_config keeps what an earlier test's scheduler set.
    pipe.scheduler = cls.from_config(pipe.scheduler.config, use_karras_sigmas=base != name)


# Each scheduler's step and loop are held to diffusers' in tests/models/test_schedulers.py; here the pipeline
# runs them. DDIM (test_ddim_eta_...), plain DPM-Solver++ (test_custom_sigmas_..., test_denoising_end_...)
# and UniPC (test_sdxl_image_inputs.py's img2img) meet diffusers' pipeline in other tests of their own.
@pytest.mark.parametrize(
    "scheduler,prompt,negative,steps",
    [
        ("euler", ["a photo of a cat", "the dog and the cat"], None, 4),
        ("dpmpp_2m_karras", ["mountains at dawn", ""], ["blurry", "low quality"], 4),
        # Heun: 3 steps are 5 UNet calls (the padded loop's trip count is the calls, not the steps).
        ("heun", ["a photo of a cat", "a red car"], ["blurry", ""], 3),
        ("deis", ["mountains at dawn", "the dog and the cat"], None, 4),
        # PNDM without skip_prk_steps (this folder's config): 4 steps are 13 calls, Runge-Kutta then PLMS.
        ("pndm", ["a photo of a cat", "a red car"], None, 4),
        # DPM-Solver singlestep: 5 steps are groups [1, 2], [1, 2] and a last first-order step.
        ("dpmpp_2s", ["mountains at dawn", "a red car"], "ugly", 5),
    ],
)
def test_pipeline_matches_diffusers_fp32(ours, reference, scheduler, prompt, negative, steps):
    import torch

    latents = np.random.default_rng(0).standard_normal((2, 4, H // 2, W // 2)).astype(np.float32)
    _diffusers_scheduler(reference, scheduler)
    expected = reference(
        prompt,
        negative_prompt=negative,
        height=H,
        width=W,
        num_inference_steps=steps,
        guidance_scale=5.0,
        latents=torch.from_numpy(latents),
        output_type="np",
    ).images
    got = ours(
        prompt,
        negative_prompt=negative,
        height=H,
        width=W,
        num_inference_steps=steps,
        guidance_scale=5.0,
        latents=latents,
        scheduler=scheduler,
        output_type="np",
    ).images
    assert got.shape == expected.shape == (2, H, W, 3)
    err = float(np.abs(got - expected).max())
    assert err <= 1e-3, f"max abs pixel difference {err:.2e}"
    # A real image, not a constant: guards against a test that passes on two blank outputs.
    assert expected.std() > 1e-3


# Playground v2.5's scheduler_config.json (an EDM-trained SDXL-architecture model).
EDM_SCHEDULER = {
    "_class_name": "EDMDPMSolverMultistepScheduler",
    "algorithm_type": "dpmsolver++",
    "dynamic_thresholding_ratio": 0.995,
    "euler_at_final": False,
    "final_sigmas_type": "zero",
    "lower_order_final": True,
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "rho": 7.0,
    "sample_max_value": 1.0,
    "sigma_data": 0.5,
    "sigma_max": 80.0,
    "sigma_min": 0.002,
    "solver_order": 2,
    "solver_type": "midpoint",
    "thresholding": False,
}


def test_an_edm_folder_runs_its_own_scheduler_as_diffusers(tiny_sdxl_path, tmp_path):
    """A folder of Playground v2.5's kind: model_index and scheduler_config name EDMDPMSolverMultistepScheduler
    (EDM's sigmas, c_in / c_noise / c_skip / c_out preconditioning) and its VAE has latents_mean / latents_std.
    With no scheduler named, ours runs the folder's, as diffusers' pipeline loaded from the folder does."""
    import json
    import shutil

    import torch
    from diffusers import StableDiffusionXLPipeline

    folder = tmp_path / "edm-sdxl"
    shutil.copytree(tiny_sdxl_path, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "EDMDPMSolverMultistepScheduler"]
    (folder / "model_index.json").write_text(json.dumps(index))
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(EDM_SCHEDULER))
    vae_config = folder / "vae" / "config.json"
    stats = {"latents_mean": [0.1, -0.2, 0.3, 0.05], "latents_std": [0.5, 2.0, 1.5, 0.8]}
    vae_config.write_text(json.dumps({**json.loads(vae_config.read_text()), **stats}))

    reference = StableDiffusionXLPipeline.from_pretrained(str(folder), torch_dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    assert type(reference.scheduler).__name__ == "EDMDPMSolverMultistepScheduler"
    latents = np.random.default_rng(6).standard_normal((2, 4, H // 2, W // 2)).astype(np.float32)
    kw = dict(negative_prompt=["blurry", ""], height=H, width=W, num_inference_steps=5, guidance_scale=3.0)
    prompts = ["a photo of a cat", "a red car"]
    expected = reference(prompts, latents=torch.from_numpy(latents), output_type="np", **kw).images
    pipe = load_pipeline(folder, dtype="float32")
    assert type(pipe.scheduler(None)).__name__ == "EDMDPMSolverMultistepScheduler"
    got = pipe(prompts, latents=latents, output_type="np", **kw).images
    err = float(np.abs(got - expected).max())
    assert err <= 1e-3, f"max abs pixel difference {err:.2e}"
    assert expected.std() > 1e-3


def test_second_order_schedulers_cap_their_steps_to_the_loops_trips(ours):
    """Heun and DPM2 call the UNet 2N - 1 times for N steps: the loop's 200 trips hold 100 steps, published in
    limits.scheduler_arguments and refused past it; LMS calls it once a step and has no cap."""
    rules = ours.limits["scheduler_arguments"]
    assert rules["heun"]["max_steps"] == rules["dpm2_karras"]["max_steps"] == 100 and "lms" not in rules
    with pytest.raises(PipelineError, match="num_inference_steps must be at most 100 with scheduler 'heun'"):
        ours("a cat", scheduler="heun", num_inference_steps=101, height=H, width=W)
    # PNDM on this folder's config (no skip_prk_steps): a Runge-Kutta start of 12 calls for 3 steps, N + 9 in
    # all, so 191 steps fit and 4 is the fewest.
    assert (rules["pndm"]["max_steps"], rules["pndm"]["min_steps"]) == (191, 4)
    with pytest.raises(PipelineError, match="num_inference_steps must be at least 4 with scheduler 'pndm'"):
        ours("a cat", scheduler="pndm", num_inference_steps=3, height=H, width=W)


def test_pipeline_without_guidance_matches_diffusers(ours, reference):
    import torch

    latents = np.random.default_rng(1).standard_normal((1, 4, H // 2, W // 2)).astype(np.float32)
    _diffusers_scheduler(reference, "euler")
    expected = reference(
        "a cat",
        height=H,
        width=W,
        num_inference_steps=3,
        guidance_scale=1.0,
        latents=torch.from_numpy(latents),
        output_type="np",
    ).images
    got = ours(
        "a cat",
        height=H,
        width=W,
        num_inference_steps=3,
        guidance_scale=1.0,
        latents=latents,
        output_type="np",
    ).images
    assert float(np.abs(got - expected).max()) <= 1e-3


def _rows_against_diffusers(ours, reference, prompts, latents, per_row: dict, **kw):
    """Ours on the batch of `prompts` with `per_row`'s values (one per prompt), against diffusers called once
    per row with that row's values (its arguments are one per call; a None is left out, diffusers' default):
    (our images, the largest |difference| in a pixel)."""
    import torch

    got = ours(prompts, latents=latents, **per_row, **kw).images
    worst = 0.0
    for row, prompt in enumerate(prompts):
        one = {name: values[row] for name, values in per_row.items() if values[row] is not None}
        expected = reference(prompt, latents=torch.from_numpy(latents[row : row + 1]), **one, **kw).images[0]
        worst = max(worst, float(np.abs(got[row] - expected).max()))
    return got, worst


def _latents(seed: int, rows: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 4, H // 2, W // 2)).astype(np.float32)


def test_guidance_rescale_matches_diffusers_per_row(ours, reference):
    """diffusers' guidance_rescale (rescale_noise_cfg) is one number per call; ours is per row: a batch whose
    rows take 0.7 and 0 gives each row what diffusers gives that row alone. A row without CFG is not rescaled
    (diffusers rescales only under CFG)."""
    latents = _latents(3)
    _diffusers_scheduler(reference, "euler")
    kw = dict(height=H, width=W, num_inference_steps=3, output_type="np", negative_prompt="blur")
    prompts, per_row = ["a cat", "a red car", "a dog"], {"guidance_scale": [7.0, 7.0, 1.0]}
    per_row["guidance_rescale"] = [0.7, 0.0, 0.7]
    got, worst = _rows_against_diffusers(ours, reference, prompts, latents, per_row, **kw)
    assert worst <= 1e-3
    # The rescale moves the picture by far more than the two sides differ (a test that cannot fail otherwise):
    # row 0 without it, on this random tiny UNet, by 5.2e-3 (the sides: 2.0e-6).
    plain = ours(prompts[0], guidance_scale=7.0, latents=latents[:1], **kw).images[0]
    moved = float(np.abs(plain - got[0]).max())
    assert moved > max(1e-3, 100 * worst), (moved, worst)


def test_prompt_2_and_negative_prompt_2_match_diffusers_per_row(ours, reference):
    """diffusers' prompt_2 / negative_prompt_2 (text_encoder_2's texts, each falling back to the first
    encoder's) are one value per call there; ours take one per prompt, None falling back per row. A row whose
    negative prompt is None keeps zeros whatever its negative_prompt_2 (force_zeros_for_empty_prompt)."""
    latents = _latents(4)
    _diffusers_scheduler(reference, "euler")
    kw = dict(height=H, width=W, num_inference_steps=3, guidance_scale=5.0, output_type="np")
    prompts = ["a cat", "a red car", "a dog"]
    per_row = {"prompt_2": ["a blue sky", None, "grass"], "negative_prompt": ["blur", "ugly", None]}
    per_row["negative_prompt_2"] = [None, "dark", "x"]
    got, worst = _rows_against_diffusers(ours, reference, prompts, latents, per_row, **kw)
    assert worst <= 1e-3
    # The second texts move the pictures by far more than the two sides differ (measured: 2.3e-2 to 3.2e-2
    # against 1.2e-6).
    plain = ours(prompts, negative_prompt=per_row["negative_prompt"], latents=latents, **kw).images
    for row in range(3):
        moved = float(np.abs(plain[row] - got[row]).max())
        assert moved > max(1e-3, 100 * worst), (row, moved, worst)


def test_clip_skip_matches_diffusers_per_prompt(ours, reference):
    """diffusers' clip_skip (both encoders' hidden_states[-(clip_skip + 2)] for the prompt; the negative's
    stay at [-2]) is one value per call there; ours is one per prompt, a traced index: a batch whose prompts
    take 1, none and the deepest skip gives each what diffusers gives it alone, and compiles nothing new."""
    assert ours.limits["max_clip_skip"] == ours.max_clip_skip >= 1
    latents = _latents(5)
    _diffusers_scheduler(reference, "euler")
    kw = dict(height=H, width=W, num_inference_steps=3, guidance_scale=5.0, output_type="np")
    kw["negative_prompt"] = "blur"
    prompts, per_row = ["a cat", "a red car", "a dog"], {"clip_skip": [1, None, ours.max_clip_skip]}
    plain = ours(prompts, latents=latents, **kw).images  # compiles the programs
    compiled = ours.compilations
    got, worst = _rows_against_diffusers(ours, reference, prompts, latents, per_row, **kw)
    assert ours.compilations == compiled
    assert worst <= 1e-3
    for row in (0, 2):  # the skipped layers moved the pictures by far more than the sides differ
        moved = float(np.abs(plain[row] - got[row]).max())
        assert moved > max(1e-3, 100 * worst), (row, moved, worst)
    with pytest.raises(
        PipelineError, match=f"clip_skip must be an integer between 0 and {ours.max_clip_skip}"
    ):
        ours("a cat", clip_skip=ours.max_clip_skip + 1, **kw)
    with pytest.raises(PipelineError, match="clip_skip must be an integer between 0 and .*, got -1"):
        ours(["a cat", "a dog"], clip_skip=[0, -1], **kw)
    with pytest.raises(PipelineError, match="clip_skip must be an integer"):
        ours("a cat", clip_skip=1.5, **kw)


# diffusers' micro-conditioning arguments, per row: rows 0 and 1 exercise text-to-image's rule that the negative
# sizes act only as a pair (row 1's negative crop alone is ignored: the negative takes the prompt's ids).
MICRO = [
    dict(original_size=(128, 96), crops_coords_top_left=(8, 4)),
    dict(target_size=(32, 24), crops_coords_top_left=(16, 0), negative_crops_coords_top_left=(4, 4)),
    dict(
        negative_original_size=(32, 32), negative_target_size=(64, 48), negative_crops_coords_top_left=(2, 2)
    ),
]


def test_micro_conditioning_matches_diffusers_per_row(ours, reference):
    """diffusers' original_size, crops_coords_top_left, target_size and their negatives are one value per call
    there; ours are one per row (traced: nothing compiles)."""
    latents = _latents(6)
    _diffusers_scheduler(reference, "euler")
    kw = dict(height=H, width=W, num_inference_steps=3, guidance_scale=5.0, output_type="np")
    kw["negative_prompt"] = "blur"
    prompts = ["a cat", "a red car", "a dog"]
    plain = ours(prompts, latents=latents, **kw).images
    compiled = ours.compilations
    per_row = {name: [m.get(name) for m in MICRO] for name in ours.pair_fields}
    got, worst = _rows_against_diffusers(ours, reference, prompts, latents, per_row, **kw)
    assert ours.compilations == compiled
    assert worst <= 1e-3
    for row in range(3):
        moved = float(np.abs(plain[row] - got[row]).max())
        assert moved > max(1e-3, 100 * worst), (row, moved, worst)
    for bad, match in [
        ((64,), "must be a pair"),
        ((64, float("nan")), "finite"),
        ("64x64", "must be a pair"),
    ]:
        with pytest.raises(PipelineError, match=match):
            ours("a cat", original_size=bad, **kw)


@pytest.mark.parametrize(
    "scheduler,custom",
    [
        ("euler", {"sigmas": [14.6, 6.0, 1.1, 0.0]}),
        ("euler", {"timesteps": [999, 640, 120]}),
        ("dpmpp_2m", {"timesteps": [960, 500, 250]}),
    ],
)
def test_custom_sigmas_and_timesteps_match_diffusers(ours, reference, scheduler, custom):
    """diffusers' `sigmas` / `timesteps` call arguments: the schedule and the step count are the caller's,
    and no program is compiled for them (a 3-step default call compiled the same program first)."""
    import torch

    latents = _latents(4, rows=2)
    _diffusers_scheduler(reference, scheduler)
    kw = dict(height=H, width=W, guidance_scale=5.0, output_type="np")
    expected = reference(["a red car", "a cat"], latents=torch.from_numpy(latents), **custom, **kw).images
    ours(["a red car", "a cat"], latents=latents, scheduler=scheduler, num_inference_steps=3, **kw)
    before = ours.compilations
    out = ours(["a red car", "a cat"], latents=latents, scheduler=scheduler, **custom, **kw)
    assert float(np.abs(out.images - expected).max()) <= 1e-3
    assert ours.compilations == before and not out.compiled
    default = ours(["a red car", "a cat"], latents=latents, scheduler=scheduler, num_inference_steps=3, **kw)
    assert float(np.abs(default.images - expected).max()) > 1e-2  # the custom schedule was used


@pytest.mark.parametrize("scheduler", ["euler", "dpmpp_2m"])
def test_denoising_end_matches_diffusers_and_compiles_nothing(ours, reference, scheduler):
    """diffusers' denoising_end (the base's share of a base + refiner schedule): the latents after the steps
    whose timesteps are >= round(1000 - 1000 x denoising_end), as diffusers returns them (output "latent"),
    the steps reported as the ones run; a traced stop, so no value compiles a program."""
    import torch

    latents = _latents(8, rows=2)
    _diffusers_scheduler(reference, scheduler)
    kw = dict(height=H, width=W, num_inference_steps=6, guidance_scale=5.0, output_type="latent")
    prompts = ["a cat", "a red car"]
    full = ours(prompts, latents=latents, scheduler=scheduler, **kw).images
    before = ours.compilations
    for end in (0.3, 0.8):
        expected = reference(
            prompts, latents=torch.from_numpy(latents), denoising_end=end, **kw
        ).images.numpy()
        steps = []
        out = ours(
            prompts,
            latents=latents,
            scheduler=scheduler,
            denoising_end=end,
            callback=lambda s, t, steps=steps: steps.append((s, t)),
            **kw,
        )
        # Relative to the latents' size (Euler's are sigma-scaled, ~25): a first run of this comparison on other
        # latents (2026-11-29) gave 1.4e-5 to 2.9e-5 apart on latents of 12 to 26.
        assert float(np.abs(out.images - expected).max()) <= 1e-3 * float(np.abs(expected).max())
        # Euler's 6 timesteps keep 1 step at 0.3 and 4 at 0.8; DPM-Solver's (leading spacing) 2 and 5.
        kept = {"euler": {0.3: 1, 0.8: 4}, "dpmpp_2m": {0.3: 2, 0.8: 5}}[scheduler][end]
        assert steps == [(i, kept) for i in range(1, kept + 1)]
        # The stop moved the latents (a test that cannot fail otherwise): the whole schedule's are > 0.5 away.
        assert float(np.abs(out.images - full).max()) > 0.5
    assert ours.compilations == before and not out.compiled


@pytest.mark.parametrize(
    "end,match",
    [
        (0.0, r"denoising_end must be in \(0, 1\), got 0.0"),
        (1.0, r"denoising_end must be in \(0, 1\)"),
        (float("nan"), r"denoising_end must be in \(0, 1\)"),
        (True, "denoising_end must be a number"),
        ("0.5", "denoising_end must be a number"),
        (0.0001, "denoising_end 0.0001 keeps no step: its cut-off timestep 1000"),
    ],
)
def test_bad_denoising_end_is_clear(ours, end, match):
    with pytest.raises(PipelineError, match=match):
        ours("cat", height=H, width=W, num_inference_steps=2, denoising_end=end)


def test_ddim_eta_is_traced_seeded_per_row_and_zero_is_deterministic_ddim(ours, reference):
    """diffusers' eta (DDIM): 0 is the deterministic loop (equal to diffusers'); another value adds noise drawn
    from each row's seed (diffusers draws it from torch's generator: not comparable bit for bit; the step
    itself is, in tests/models/test_scheduler_arguments.py) and compiles nothing."""
    import torch

    latents = _latents(6, rows=2)
    kw = dict(height=H, width=W, guidance_scale=5.0, output_type="np", num_inference_steps=3)
    _diffusers_scheduler(reference, "ddim")
    expected = reference(["a red car", "a cat"], latents=torch.from_numpy(latents), eta=0.0, **kw).images
    zero = ours(["a red car", "a cat"], latents=latents, scheduler="ddim", eta=0.0, **kw)
    assert float(np.abs(zero.images - expected).max()) <= 1e-3
    plain = ours(["a red car", "a cat"], seed=[1, 2], scheduler="ddim", **kw)
    ours(["a cat"], seed=[2], scheduler="ddim", **kw)
    before = ours.compilations
    noisy = ours(["a red car", "a cat"], seed=[1, 2], scheduler="ddim", eta=0.8, **kw)
    again = ours(["a cat"], seed=[2], scheduler="ddim", eta=0.8, **kw)  # row 2 alone: the same picture
    assert ours.compilations == before
    assert float(np.abs(again.images[0] - noisy.images[1]).max()) <= 1e-5
    assert float(np.abs(noisy.images - plain.images).max()) > 1e-2  # eta acted


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(scheduler="euler", eta=0.5), "takes no eta with scheduler 'euler'"),
        (dict(scheduler="ddim", eta=2.0), r"eta must be in \[0, 1\]"),
        (dict(scheduler="ddim", sigmas=[3.0, 1.0, 0.0]), "takes no custom sigmas with scheduler 'ddim'"),
        (dict(scheduler="dpmpp_2m", sigmas=[3.0, 1.0, 0.0]), "takes no custom sigmas"),
        (dict(scheduler="euler_karras", timesteps=[900, 10]), "takes no custom timesteps"),
        (dict(sigmas=[3.0, 1.0, 0.0], timesteps=[900, 10]), "only one of sigmas or timesteps"),
        (dict(sigmas=[3.0, 1.0, 0.0], num_inference_steps=3), r"num_inference_steps \(3\) differs"),
        (dict(timesteps=[10, 900]), "must decrease strictly"),
    ],
)
def test_bad_scheduler_arguments_are_clear(ours, kw, match):
    with pytest.raises(PipelineError, match=match):
        ours("cat", height=H, width=W, output_type="np", **kw)


def test_bf16_runs_close_to_fp32(tiny_sdxl_path, ours, record_property):
    latents = np.random.default_rng(2).standard_normal((1, 4, H // 2, W // 2)).astype(np.float32)
    bf16 = load_pipeline(tiny_sdxl_path, dtype="bfloat16")
    kw = dict(height=H, width=W, num_inference_steps=3, guidance_scale=5.0, latents=latents, output_type="np")
    a, b = ours("a cat", **kw).images, bf16("a cat", **kw).images
    err = float(np.abs(a - b).max())
    record_property("bf16_max_abs_pixel_error", err)
    # Not the fp32 standard (1e-3 against diffusers, the tests above): bf16 keeps 8 significant bits, so every
    # weight and activation is rounded by up to 2^-9 relative, and the rounding of ~60 UNet layers x 3 steps
    # and the text encoders reaches the pixels. Measured 0.0129 (= 3.3 of 255 levels); 0.03 (7.7 levels)
    # leaves room for other XLA fusions, and still fails a real bf16 bug (a wrong cast, an fp16 overflow
    # or a dropped upcast in the VAE moves pixels by tenths).
    assert np.isfinite(b).all() and err < 0.03


def test_prompt_seed_guidance_never_recompile(ours):
    kw = dict(height=H, width=W, num_inference_steps=2, output_type="np")
    ours("first prompt", seed=1, guidance_scale=5.0, **kw)
    before = ours.compilations
    for prompt, seed, g, r in (
        ("another prompt", 2, 7.5, 0.7),
        ("a third, longer prompt about cats", 99, 3.0, 0),
    ):
        out = ours(prompt, seed=seed, guidance_scale=g, guidance_rescale=r, **kw)
        assert not out.compiled
    assert ours.compilations == before
    # A new shape does compile: the counter is live, not a constant.
    ours("x", seed=1, guidance_scale=5.0, height=H, width=H, num_inference_steps=2, output_type="np")
    assert ours.compilations > before


def test_seed_is_reproducible_and_distinct(ours):
    kw = dict(height=H, width=W, num_inference_steps=2, output_type="np")
    a = ours("cat", seed=7, **kw)
    b = ours("cat", seed=7, **kw)
    c = ours("cat", seed=8, **kw)
    assert a.seeds == [7] and np.array_equal(a.images, b.images)
    assert not np.allclose(a.images, c.images)


def test_progress_callback_and_cancel(ours):
    seen = []
    ours(
        "cat",
        height=H,
        width=W,
        num_inference_steps=3,
        output_type="np",
        callback=lambda s, t: seen.append((s, t)),
    )
    assert seen == [(1, 3), (2, 3), (3, 3)]
    with pytest.raises(GenerationCancelled):
        ours("cat", height=H, width=W, num_inference_steps=3, output_type="np", callback=lambda s, t: s < 2)


def test_images_per_prompt_and_pil(ours):
    out = ours(["a", "b"], height=H, width=W, num_inference_steps=1, num_images_per_prompt=2, seed=3)
    assert len(out.images) == 4 and out.images[0].size == (W, H) and out.seeds == [3, 4, 5, 6]


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(height=60), "multiple of 8"),
        (dict(num_inference_steps=0), "between 1"),
        (dict(scheduler="nope"), "nope"),
        (dict(num_images_per_prompt=9), "num_images_per_prompt must be an integer between 1 and 8"),
        (dict(foo=1), "unsupported argument 'foo'"),
        # diffusers' SDXL takes no text length (its CLIP texts are 77 tokens); neither do we.
        (dict(max_sequence_length=77), "unsupported argument 'max_sequence_length'"),
        (dict(num_frames=5), "unsupported argument 'num_frames'"),
    ],
)
def test_bad_arguments_are_clear(ours, kw, match):
    with pytest.raises(PipelineError, match=match):
        ours("cat", **{"height": H, "width": W, "num_inference_steps": 1, **kw})


def test_an_unsupported_argument_is_a_type_error_too(ours):
    with pytest.raises(TypeError, match="unsupported argument 'ip_adapter_image'"):
        ours("cat", ip_adapter_image=np.zeros((8, 8, 3)))


def test_vae_shift_factor_and_missing_sample_size_read_as_diffusers_does(tiny_sdxl_path, tmp_path):
    """A folder whose VAE config carries a shift_factor (Flux's and SD3's VAEs have one) and whose UNet has no
    sample_size: diffusers' SDXL pipeline never reads the shift, and its default size falls back to 128
    latents; a (height, width) sample_size is read as one."""
    import json
    import shutil

    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    folder = tmp_path / "sdxl"
    shutil.copytree(tiny_sdxl_path, folder)
    for name, edit in (("vae", {"shift_factor": 2.0}), ("unet", {"sample_size": None})):
        path = folder / name / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))

    ours = load_pipeline(folder, dtype="float32")
    assert (ours.defaults["height"], ours.defaults["width"]) == (128 * ours.vae_scale_factor,) * 2
    ref = StableDiffusionXLPipeline.from_pretrained(str(folder), torch_dtype=torch.float32)
    ref.scheduler = EulerDiscreteScheduler.from_config(ref.scheduler.config)
    ref.set_progress_bar_config(disable=True)
    latents = np.random.default_rng(3).standard_normal((1, 4, H // 2, W // 2)).astype(np.float32)
    kw = dict(height=H, width=W, num_inference_steps=2, guidance_scale=5.0, output_type="np")
    expected = ref("a cat", latents=torch.from_numpy(latents), **kw).images
    got = ours("a cat", latents=latents, scheduler="euler", **kw).images
    assert float(np.abs(got - expected).max()) <= 1e-3

    path = folder / "unet" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "sample_size": [16, 24]}))
    size = load_pipeline(folder, dtype="float32").defaults
    assert (size["height"], size["width"]) == (16 * ours.vae_scale_factor, 24 * ours.vae_scale_factor)


def test_a_first_text_encoder_with_projection_gives_the_pooled_embedding(tiny_sdxl_path, tmp_path):
    """diffusers' encode_prompt pools from the first encoder whose output [0] is 2-D: a text_encoder saved as
    CLIPTextModelWithProjection gives the pooled embedding (its text_embeds), text_encoder_2's goes unused."""
    import json
    import shutil

    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTextModelWithProjection

    folder = tmp_path / "sdxl"
    shutil.copytree(tiny_sdxl_path, folder)
    projection = json.loads((folder / "text_encoder_2" / "config.json").read_text())["projection_dim"]
    torch.manual_seed(0)
    encoder = CLIPTextModelWithProjection.from_pretrained(
        str(folder / "text_encoder"), projection_dim=projection
    )  # the projection is new, random
    shutil.rmtree(folder / "text_encoder")
    encoder.save_pretrained(str(folder / "text_encoder"))
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    index_path.write_text(
        json.dumps({**index, "text_encoder": ["transformers", "CLIPTextModelWithProjection"]})
    )

    ours = load_pipeline(folder, dtype="float32")
    ref = StableDiffusionXLPipeline.from_pretrained(str(folder), torch_dtype=torch.float32)
    ref.scheduler = EulerDiscreteScheduler.from_config(ref.scheduler.config)
    ref.set_progress_bar_config(disable=True)
    latents = np.random.default_rng(5).standard_normal((2, 4, H // 2, W // 2)).astype(np.float32)
    kw = dict(negative_prompt=["ugly", "blurry"], height=H, width=W, num_inference_steps=2, output_type="np")
    expected = ref(["a cat", "the dog"], latents=torch.from_numpy(latents), guidance_scale=5.0, **kw).images
    got = ours(["a cat", "the dog"], latents=latents, scheduler="euler", guidance_scale=5.0, **kw).images
    assert float(np.abs(got - expected).max()) <= 1e-3


def test_sizes_diffusers_takes_at_sdxls_depth_match(tiny_sdxl_deep_path):
    """SDXL's depth (three UNet levels, VAE factor 8): a size that is a multiple of 8 but not of 32, whose
    latents (5 x 7) halve cleanly on neither side, at either level below, as diffusers runs them (before:
    refused, multiples of 32). One size: a second (72 x 40) compiled a second program, 8 s of the suite."""
    import torch
    from diffusers import StableDiffusionXLPipeline

    ours = load_pipeline(tiny_sdxl_deep_path, dtype="float32")
    assert ours.limits["size_multiple"] == 8
    reference = StableDiffusionXLPipeline.from_pretrained(str(tiny_sdxl_deep_path), torch_dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    for h, w in ((40, 56),):
        latents = np.random.default_rng(h).standard_normal((1, 4, h // 8, w // 8)).astype(np.float32)
        kw = dict(height=h, width=w, num_inference_steps=2, guidance_scale=5.0, output_type="np")
        expected = reference("a cat", latents=torch.from_numpy(latents), **kw).images
        got = ours("a cat", latents=latents, **kw).images
        err = float(np.abs(got - expected).max())
        assert got.shape == (1, h, w, 3) and err <= 1e-3, f"{h}x{w}: max abs pixel difference {err:.2e}"
        assert expected.std() > 1e-3


def test_the_scheduler_is_the_class_model_index_names(tiny_sdxl_path, tmp_path):
    """diffusers builds the scheduler class model_index.json names, reading scheduler_config.json for its
    settings: a folder whose config says DPMSolverMultistepScheduler but whose index says Euler runs Euler (we
    ran DPM-Solver: 4.7e-2 max abs pixel off diffusers)."""
    import json
    import shutil

    from diffusers import StableDiffusionXLPipeline

    folder = tmp_path / "disagreeing"
    shutil.copytree(tiny_sdxl_path, folder)
    config_file = folder / "scheduler" / "scheduler_config.json"
    config_file.write_text(
        json.dumps({**json.loads(config_file.read_text()), "_class_name": "DPMSolverMultistepScheduler"})
    )
    reference = StableDiffusionXLPipeline.from_pretrained(str(folder))
    assert type(reference.scheduler).__name__ == "EulerDiscreteScheduler"
    ours = load_pipeline(folder, dtype="float32")
    assert type(ours.scheduler(None)).__name__ == "EulerDiscreteScheduler"
    assert ours.scheduler_config["steps_offset"] == reference.scheduler.config.steps_offset


def test_a_folder_without_the_first_text_encoder_is_refused_naming_it(tiny_sdxl_path, tmp_path):
    """The SDXL refiner's layout (`text_encoder: [null, null]`, no CLIP-L) around a base UNet: its context is
    wider than the second encoder's states, and its time ids are 6, not the refiner's 5 (a refiner folder
    loads: tests/models/test_sdxl_image_inputs.py). Before, a tokenizer error about a missing vocab.json."""
    import json
    import shutil

    from meshserve.models import ModelFolderError

    folder = tmp_path / "refiner_like"
    shutil.copytree(tiny_sdxl_path, folder, ignore=shutil.ignore_patterns("text_encoder", "tokenizer"))
    index = json.loads((folder / "model_index.json").read_text())
    index.update(text_encoder=[None, None], tokenizer=[None, None])
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFolderError, match="cross_attention_dim 64 is not the width of the text states"):
        load_pipeline(folder)
    index.update(requires_aesthetics_score=True)
    (folder / "model_index.json").write_text(json.dumps(index))
    shutil.rmtree(folder / "text_encoder_2")
    with pytest.raises(ModelFolderError, match="no text_encoder_2; meshserve's SDXL needs the second"):
        load_pipeline(folder)


def test_prompt_embeds_match_diffusers(ours, reference):
    """diffusers' prompt_embeds and its kin (made by diffusers' own encode_prompt) instead of texts: the same
    pictures as diffusers given them, and as the texts themselves; a side given as text beside embeddings of the
    other; diffusers' rules for what goes together."""
    import torch

    _diffusers_scheduler(reference, "euler")  # the shared reference's, whatever an earlier test set
    prompts, negatives = ["a photo of a cat", "a red car"], ["blurry", "low quality"]
    with torch.no_grad():
        pe, npe, ppe, nppe = reference.encode_prompt(prompts, device="cpu", negative_prompt=negatives)
    latents = np.random.default_rng(4).standard_normal((2, 4, H // 2, W // 2)).astype(np.float32)
    kw = dict(height=H, width=W, num_inference_steps=3, guidance_scale=5.0, output_type="np")
    kw_ours = dict(kw, scheduler="euler")
    given = dict(prompt_embeds=pe, pooled_prompt_embeds=ppe)
    negative = dict(negative_prompt_embeds=npe, negative_pooled_prompt_embeds=nppe)
    expected = reference(**given, **negative, latents=torch.from_numpy(latents), **kw).images
    as_numpy = {k: v.numpy() for k, v in {**given, **negative}.items()}
    got = ours(latents=latents, **as_numpy, **kw_ours).images
    assert np.abs(got - expected).max() <= 1e-3 and expected.std() > 1e-2
    texts = ours(prompts, negative_prompt=negatives, latents=latents, **kw_ours).images
    assert np.abs(got - texts).max() <= 1e-4
    # prompts as embeddings, negatives as text; and no negative (this folder zeroes it, as diffusers does)
    for negative_kw in ({"negative_prompt": negatives}, {}):
        expected = reference(**given, **negative_kw, latents=torch.from_numpy(latents), **kw).images
        mine = {k: as_numpy[k] for k in given}
        got = ours(latents=latents, **mine, **negative_kw, **kw_ours).images
        assert np.abs(got - expected).max() <= 1e-3, negative_kw
    for bad, match in (
        ({"prompt": "a cat", **as_numpy}, "not both"),
        ({"prompt_embeds": as_numpy["prompt_embeds"]}, "pooled_prompt_embeds"),
        ({**as_numpy, "prompt_embeds": as_numpy["prompt_embeds"][:, :10]}, "expected shape"),
        ({**as_numpy, "prompt_2": "a dog"}, "not both"),
        ({}, "prompt"),
    ):
        with pytest.raises(PipelineError, match=match):
            ours(**{"prompt": None, **bad}, height=H, width=W, num_inference_steps=1)

"""The whole Wan 2.1 pipeline against diffusers' WanPipeline (torch fp32, CPU) on the same tiny folder and the
same initial latents: CFG on and off, UniPC (the folder's) and flow-match Euler; plus per-row seeds in a batch,
recompilation, the request checks and the contract fields the serving side reads.

The measured errors are logged: `pytest tests/models/test_wan_pipeline.py --log-cli-level=INFO` shows them.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from meshserve.models import GenerationCancelled, PipelineError, load_pipeline
from meshserve.models.engine.seeds import initial_noise, key_data, row_keys
from meshserve.models.wan.pipeline import WanPipeline

log = logging.getLogger(__name__)

# 48 x 80 px, 9 frames -> latents 3 x 6 x 10 (VAE x4 in time, x8 in space) -> 3 x 3 x 5 = 45 patches: an odd
# token count, a non-square frame, more than one latent frame (the VAE's time upsampling runs).
H, W, F = 48, 80, 9
LATENT = (4, 3, 6, 10)  # diffusers' [C, T, h, w]
PROMPTS = ["a cat", "the dog and the cat"]
NEGATIVES = ["a dog", ""]


def latents_for(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, *LATENT)).astype(np.float32)


def max_abs(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max())


def rel_err(ours, ref) -> float:
    return max_abs(ours, ref) / float(np.abs(np.asarray(ref, np.float32)).max())


@pytest.fixture(scope="module")
def wan(tiny_wan_path):
    return load_pipeline(tiny_wan_path, dtype="float32")


@pytest.fixture(scope="module")
def reference(tiny_wan_path):
    import torch
    from diffusers import WanPipeline as TorchWanPipeline

    pipe = TorchWanPipeline.from_pretrained(str(tiny_wan_path), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_reference(pipe, prompt, latents, *, output_type="np", **kw):
    import torch

    kw = {"height": H, "width": W, "num_frames": F, "num_inference_steps": 3, **kw}
    with torch.no_grad():
        out = pipe(prompt, latents=torch.from_numpy(latents), output_type=output_type, **kw).frames
    return out.float().numpy() if output_type == "latent" else out


def run_ours(pipe, prompt, *, output_type="np", **kw):
    kw = {"height": H, "width": W, "num_frames": F, "num_inference_steps": 3, **kw}
    return pipe(prompt, output_type=output_type, **kw).images


# --------------------------------------------------------------------------------------------------
# Parity with diffusers


def test_cfg_matches_diffusers(wan, reference):
    """CFG (guidance 5) with a negative prompt per prompt, UniPC: frames and latents."""
    assert isinstance(wan, WanPipeline)
    latents = latents_for(2)
    kw = dict(negative_prompt=NEGATIVES, guidance_scale=5.0)
    expected = run_reference(reference, PROMPTS, latents, **kw)
    got = run_ours(wan, PROMPTS, latents=latents, **kw)
    assert got.shape == expected.shape == (2, F, H, W, 3)
    err = max_abs(got, expected)
    log.info("wan fp32 CFG, np: max abs frame error %.2e (frame std %.3f)", err, expected.std())
    assert err <= 1e-3
    assert expected.std() > 1e-2  # real videos, not blanks
    assert max_abs(expected[:, 0], expected[:, -1]) > 1e-2  # frames differ over time

    expected = run_reference(reference, PROMPTS, latents, output_type="latent", **kw)
    got = run_ours(wan, PROMPTS, latents=latents, output_type="latent", **kw)
    assert got.shape == expected.shape == (2, *LATENT)
    err = rel_err(got, expected)
    log.info("wan fp32 CFG, latents: max rel error %.2e", err)
    assert err <= 1e-3
    assert max_abs(expected, latents) > 0.1  # the loop moved the latents


def test_no_cfg_matches_diffusers(wan, reference):
    """guidance 1: no negative pass (the negative prompt is ignored, as diffusers does)."""
    latents = latents_for(1, seed=1)
    expected = run_reference(reference, PROMPTS[1], latents, guidance_scale=1.0, num_inference_steps=4)
    got = run_ours(wan, PROMPTS[1], latents=latents, guidance_scale=1.0, num_inference_steps=4)
    err = max_abs(got, expected)
    log.info("wan fp32 no CFG, np: max abs frame error %.2e", err)
    assert err <= 1e-3 and expected.std() > 1e-2
    ignored = run_ours(
        wan, PROMPTS[1], latents=latents, guidance_scale=1.0, num_inference_steps=4, negative_prompt="x"
    )
    np.testing.assert_array_equal(ignored, got)


def test_flow_match_euler_matches_diffusers(wan, reference):
    """The other flow scheduler: diffusers' FlowMatchEulerDiscreteScheduler with the folder's flow_shift (3.0)
    as its shift, the scheduler's own sigmas (the Wan pipeline passes none)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    original = reference.scheduler
    reference.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    try:
        latents = latents_for(1, seed=2)
        expected = run_reference(reference, PROMPTS[0], latents, guidance_scale=4.0, output_type="latent")
    finally:
        reference.scheduler = original
    got = run_ours(
        wan,
        PROMPTS[0],
        latents=latents,
        guidance_scale=4.0,
        output_type="latent",
        scheduler="flow_match_euler",
    )
    err = rel_err(got, expected)
    log.info("wan fp32 flow-match Euler, latents: max rel error %.2e", err)
    assert err <= 1e-3


@pytest.mark.parametrize(
    "name, class_name",
    [
        ("dpmpp_2m", "DPMSolverMultistepScheduler"),
        ("dpmpp_2s", "DPMSolverSinglestepScheduler"),
        ("deis", "DEISMultistepScheduler"),
    ],
)
def test_dpm_solver_on_flow_sigmas_matches_diffusers(wan, reference, name, class_name):
    """Wan 2.1's other sample solver ("dpm++"): DPM-Solver++ on the folder's flow sigmas, as diffusers' class
    reads the folder's UniPC config (flow sigmas, flow_shift 3, bh2 read as midpoint); 5 steps reach order 2."""
    import diffusers

    original = reference.scheduler
    reference.scheduler = getattr(diffusers, class_name).from_config(original.config)
    try:
        latents = latents_for(1, seed=3)
        kw = dict(guidance_scale=4.0, num_inference_steps=5, output_type="latent")
        expected = run_reference(reference, PROMPTS[1], latents, **kw)
    finally:
        reference.scheduler = original
    got = run_ours(wan, PROMPTS[1], latents=latents, scheduler=name, **kw)
    err = rel_err(got, expected)
    log.info("wan fp32 %s, latents: max rel error %.2e", name, err)
    assert err <= 1e-3 and max_abs(expected, latents) > 0.1


def test_bf16_is_as_close_to_fp32_as_diffusers_bf16(tiny_wan_path, reference):
    """bf16 UMT5 and transformer, fp32 latents and VAE (as diffusers' Wan examples load it), against diffusers
    fp32; diffusers' own bf16 run (same component dtypes) measured beside it. Not bit parity: bf16 matmuls
    round differently in XLA and torch, so the bound is a multiple of diffusers' own bf16 error."""
    import torch
    from diffusers import WanPipeline as TorchWanPipeline

    latents = latents_for(1, seed=3)
    kw = dict(negative_prompt="a dog", guidance_scale=5.0, output_type="latent")
    expected = run_reference(reference, PROMPTS[0], latents, **kw)
    dtypes = {"transformer": torch.bfloat16, "text_encoder": torch.bfloat16, "default": torch.float32}
    theirs_pipe = TorchWanPipeline.from_pretrained(str(tiny_wan_path), dtype=dtypes)
    theirs_pipe.set_progress_bar_config(disable=True)
    theirs = run_reference(theirs_pipe, PROMPTS[0], latents, **kw)
    got = run_ours(load_pipeline(tiny_wan_path, dtype="bfloat16"), PROMPTS[0], latents=latents, **kw)
    err, ref_err = rel_err(got, expected), rel_err(theirs, expected)
    log.info("wan bf16 vs fp32 diffusers, latents: ours %.2e, diffusers bf16 %.2e (max rel)", err, ref_err)
    assert np.isfinite(got).all() and err <= max(3 * ref_err, 1e-2)


# --------------------------------------------------------------------------------------------------
# Seeds, batching, compilation


def test_seed_noise_and_batch_equal_each_alone(wan, reference):
    """A seed's initial noise is its row key's normal draw in [T, h, w, C] (checked against diffusers given
    that noise); a batch of two prompts with different seeds, one with CFG and one without, gives each row
    what it gives alone."""
    seeds = [11, 12]
    noise = np.asarray(initial_noise(row_keys(key_data(seeds)), (3, 6, 10, 4)))  # [B, T, h, w, C]
    expected = run_reference(
        reference,
        PROMPTS[0],
        noise[:1].transpose(0, 4, 1, 2, 3).copy(),
        guidance_scale=5.0,
        num_inference_steps=2,
    )
    alone = [
        run_ours(wan, PROMPTS[0], seed=seeds[0], guidance_scale=5.0, num_inference_steps=2),
        run_ours(wan, PROMPTS[1], seed=seeds[1], guidance_scale=1.0, num_inference_steps=2),
    ]
    assert max_abs(alone[0], expected) <= 1e-3
    both = run_ours(wan, PROMPTS, seed=seeds, guidance_scale=[5.0, 1.0], num_inference_steps=2)
    for i in range(2):
        err = max_abs(both[i : i + 1], alone[i])
        log.info("wan batch row %d vs alone: max abs %.2e", i, err)
        assert err <= 1e-5
    assert max_abs(both[0], both[1]) > 1e-2


def test_prompt_seed_guidance_and_steps_do_not_recompile(wan):
    wan(PROMPTS[0], height=H, width=W, num_frames=F, num_inference_steps=2, guidance_scale=3.0, seed=1)
    before = wan.compilations
    out = wan(
        "a different prompt", negative_prompt="blurry", height=H, width=W, num_frames=F,
        num_inference_steps=5, guidance_scale=7.5, seed=99,
    )  # fmt: skip
    assert not out.compiled and wan.compilations == before
    assert out.images.shape == (1, F, H, W, 3)


def test_callback_reports_and_cancels(wan):
    seen = []
    wan(PROMPTS[0], height=H, width=W, num_frames=F, num_inference_steps=3, seed=0,
        callback=lambda step, total: seen.append((step, total)))  # fmt: skip
    assert seen == [(1, 3), (2, 3), (3, 3)]
    with pytest.raises(GenerationCancelled):
        wan(PROMPTS[0], height=H, width=W, num_frames=F, num_inference_steps=3, seed=0,
            callback=lambda step, total: step < 2)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# The contract and the request checks


def test_contract_fields(wan):
    assert (wan.family, wan.task, wan.pads_batches) == ("wan", "text-to-video", False)
    assert "num_frames" in wan.batch_fields
    assert wan.compiled_batch_size(3, 1) == 3  # exact sizes, no padded video
    d, lim = wan.defaults, wan.limits
    # The tiny model's RoPE tables (32 positions) cannot address 480x832: its small documented default.
    assert (d["height"], d["width"], d["num_inference_steps"], d["guidance_scale"], d["fps"]) == (
        32,
        48,
        4,
        5.0,
        16,
    )
    assert lim["frames"] == {"min_frames": 1, "max_frames": 81, "step": 4, "offset": 1, "default": 5}
    assert lim["size_multiple"] == 16 and lim["max_size"] == 512  # 32 patches x 2 x 8
    assert lim["schedulers"] == ["flow_match_euler", "unipc", "dpmpp_2m", "dpmpp_2s", "deis"]
    from meshserve.service.contract import VIDEO_FORMATS, ModelDefaults, ModelLimits

    ModelDefaults(**d)  # what the worker publishes validates
    assert ModelLimits(**lim).output_formats == list(VIDEO_FORMATS)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_frames": 8}, "4k\\+1"),
        ({"num_frames": 0}, "between 1 and 81"),
        ({"num_frames": 85}, "between 1 and 81"),
        ({"height": 40}, "multiple of 16"),
        ({"width": 528}, "between 16 and 512"),
        ({"scheduler": "euler"}, "scheduler must be one of"),
        ({"guidance_scale": float("nan")}, "finite"),
        ({"negative_prompt": ["a", "b"]}, "one per prompt"),
        ({"latents": np.zeros((1, 4, 2, 6, 10), np.float32)}, "latents: expected shape"),
    ],
)
def test_bad_requests_raise_pipeline_errors(wan, kwargs, match):
    kw = {"height": H, "width": W, "num_frames": F, "num_inference_steps": 1, **kwargs}
    with pytest.raises(PipelineError, match=match):
        wan(PROMPTS[0], **kw)


def test_diffusers_call_frames_and_max_sequence_length(wan, reference):
    """A call written for diffusers' WanPipeline: `max_sequence_length` (a shorter text than the default 512,
    equal to diffusers'), the output's `frames`, `return_dict=False`; an argument we do not take is named."""
    latents = latents_for(1, seed=5)
    kw = dict(guidance_scale=1.0, num_inference_steps=2, max_sequence_length=64)
    expected = run_reference(reference, PROMPTS[0], latents, **kw)
    out = wan(PROMPTS[0], height=H, width=W, num_frames=F, latents=latents, **kw)
    assert out.frames is out.images and max_abs(out.frames, expected) <= 1e-3
    (frames,) = wan(PROMPTS[0], height=H, width=W, num_frames=F, latents=latents, return_dict=False, **kw)
    np.testing.assert_array_equal(frames, out.frames)
    # diffusers' video pipelines name the videos per prompt `num_videos_per_prompt`
    kw = dict(kw, height=H, width=W, num_frames=F, seed=3)
    two = wan(PROMPTS[0], num_videos_per_prompt=2, **kw).frames
    assert two.shape[0] == 2 and max_abs(two[0], two[1]) > 1e-2
    np.testing.assert_array_equal(two, wan(PROMPTS[0], num_images_per_prompt=2, **kw).frames)
    with pytest.raises(PipelineError, match="one setting"):
        wan(PROMPTS[0], num_videos_per_prompt=2, num_images_per_prompt=3)
    with pytest.raises(PipelineError, match="unsupported argument 'foo'"):
        wan(PROMPTS[0], foo=1)
    with pytest.raises(PipelineError, match="unsupported argument 'prompt_2'"):  # one text encoder
        wan(PROMPTS[0], prompt_2="a dog")
    with pytest.raises(PipelineError, match="max_sequence_length must be an integer between 1 and 512"):
        wan(PROMPTS[0], max_sequence_length=513)


def test_pil_output_is_a_list_of_frames_per_video(wan):
    out = wan(
        PROMPTS, height=H, width=W, num_frames=5, num_inference_steps=1, seed=0, output_type="pil"
    ).images
    assert len(out) == 2 and all(len(v) == 5 for v in out)
    assert out[0][0].size == (W, H)


def test_warm_up_compiles_what_a_default_request_needs(wan):
    """The serving side warms a pool up at its default size and frame count; a default request (CFG or not)
    then compiles nothing."""
    wan.warm_up(batch_sizes=(1,))
    before = wan.compilations
    for guidance in (5.0, 1.0):
        out = wan("a lighthouse", guidance_scale=guidance, seed=3, num_inference_steps=1)
        assert not out.compiled
        assert out.images.shape == (1, 5, 32, 48, 3)
    assert wan.compilations == before


def test_a_temporal_patch_serves_whole_patches_and_matches_diffusers(tiny_wan_path, tmp_path):
    """A transformer whose patch takes three latent frames ((3, 2, 2), a tiny-wan trial's): the frame
    counts are those whose latent frames fill whole patches (9, 21, ...: diffusers would drop the rest
    silently), and a 9-frame CFG generation matches diffusers' WanPipeline on the same folder."""
    import shutil

    import torch
    from diffusers import WanPipeline as TorchWanPipeline

    from tests.fixtures.tiny_wan import build_tiny_wan_transformer

    folder = tmp_path / "wan-patch3"
    shutil.copytree(tiny_wan_path, folder)
    shutil.rmtree(folder / "transformer")
    build_tiny_wan_transformer(folder / "transformer", seed=2, patch_size=[3, 2, 2])
    ours = load_pipeline(folder, dtype="float32")
    assert ours.limits["frames"] == {"min_frames": 9, "max_frames": 81, "step": 12, "offset": 9, "default": 9}
    for frames, match in ((5, "between 9 and 81"), (13, "12k\\+9"), (93, "between 9 and 81")):
        with pytest.raises(PipelineError, match=match):
            ours(PROMPTS[0], height=H, width=W, num_frames=frames, num_inference_steps=1)
    reference = TorchWanPipeline.from_pretrained(str(folder), dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    latents = latents_for(1, seed=3)
    kw = dict(negative_prompt=NEGATIVES[0], guidance_scale=5.0)
    expected = run_reference(reference, PROMPTS[0], latents, **kw)
    got = run_ours(ours, PROMPTS[0], latents=latents, **kw)
    err = max_abs(got, expected)
    log.info("wan patch (3, 2, 2) fp32 CFG: max abs frame error %.2e", err)
    assert got.shape == (1, F, H, W, 3) and err <= 1e-3 and expected.std() > 1e-2


def test_folder_readings_diffusers_shares(tiny_wan_path, tmp_path):
    """A folder with boundary_ratio but no transformer_2 (half of Wan 2.2's two-expert layout, which
    test_wan_two_experts.py runs) is refused: one transformer would silently make another video. A folder whose own scheduler is Euler reads no flow_shift (diffusers'
    FlowMatchEulerDiscreteScheduler has no such key: shift 1), while Euler asked for on a UniPC folder
    takes the folder's flow_shift as its shift."""
    import json
    import shutil

    from meshserve.models.registry import ModelFolderError

    folder = tmp_path / "wan"
    shutil.copytree(tiny_wan_path, folder)
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    index_path.write_text(json.dumps({**index, "boundary_ratio": 0.875}))
    with pytest.raises(ModelFolderError, match=r"\['boundary_ratio'\] \(Wan 2.2's two-expert model\)"):
        load_pipeline(folder, dtype="float32")

    index_path.write_text(
        json.dumps({**index, "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]})
    )
    (folder / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"_class_name": "FlowMatchEulerDiscreteScheduler", "flow_shift": 5.0})
    )
    assert load_pipeline(folder, dtype="float32").make_scheduler(None).inner.shift == 1.0
    # A DPM-Solver folder: in its flow form, its own scheduler; in its beta-schedule form, refused (it would
    # sample the velocity model as a noise predictor).
    index_path.write_text(json.dumps({**index, "scheduler": ["diffusers", "DPMSolverMultistepScheduler"]}))
    dpm = {"_class_name": "DPMSolverMultistepScheduler", "flow_shift": 5.0}
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(dpm))
    with pytest.raises(ModelFolderError, match="flow matching's form"):
        load_pipeline(folder, dtype="float32")
    dpm.update(use_flow_sigmas=True, prediction_type="flow_prediction")
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(dpm))
    own = load_pipeline(folder, dtype="float32").make_scheduler(None).inner
    assert (type(own).__name__, own.use_flow_sigmas, own.flow_shift) == (
        "DPMSolverMultistepScheduler",
        True,
        5.0,
    )
    unipc = load_pipeline(tiny_wan_path, dtype="float32")
    flow_shift = unipc.scheduler_config["flow_shift"]
    assert unipc.make_scheduler("flow_match_euler").inner.shift == flow_shift != 1.0


def test_prompt_embeds_match_diffusers(wan, reference):
    """diffusers' prompt_embeds / negative_prompt_embeds (its own encode_prompt's) instead of texts."""
    import torch

    with torch.no_grad():
        pe, npe = reference.encode_prompt(
            PROMPTS, NEGATIVES, do_classifier_free_guidance=True, max_sequence_length=64, device="cpu"
        )
    latents = latents_for(2, seed=6)
    kw = dict(guidance_scale=5.0, num_inference_steps=2)
    expected = run_reference(reference, None, latents, prompt_embeds=pe, negative_prompt_embeds=npe, **kw)
    got = run_ours(
        wan, None, latents=latents, prompt_embeds=pe.numpy(), negative_prompt_embeds=npe.numpy(), **kw
    )
    assert max_abs(got, expected) <= 1e-3
    texts = run_ours(wan, PROMPTS, negative_prompt=NEGATIVES, latents=latents, max_sequence_length=64, **kw)
    assert max_abs(got, texts) <= 1e-4

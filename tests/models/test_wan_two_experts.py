"""Wan 2.2's two experts (A14B: `transformer` for the steps at t >= boundary_ratio x 1000, `transformer_2` below,
with diffusers' guidance_scale_2) against diffusers' WanPipeline on a tiny two-expert folder written by
diffusers, on one device and on a cfg2 x context2 layout with the weights split; and what it refuses.

The tiny UniPC schedule of 4 steps is [999, 900, 750, 500]: at boundary_ratio 0.8 two steps run each expert.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from meshserve.models import PipelineError, load_pipeline
from meshserve.models.attention import AttentionSettings
from tests.fixtures.tiny_wan import build_tiny_wan22

H, W, F, STEPS = 48, 80, 9, 4
PROMPTS = ["a cat", "the dog and the cat"]


def latents_for(batch: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((batch, 4, 3, 6, 10)).astype(np.float32)


def call(pipe, **kw):
    kw = {"height": H, "width": W, "num_frames": F, "num_inference_steps": STEPS, "output_type": "np", **kw}
    kw.setdefault("latents", latents_for(2))
    return pipe(PROMPTS, negative_prompt=["blurry", ""], **kw)


@pytest.fixture(scope="module")
def wan22_path(tiny_wan_path, tmp_path_factory):
    return build_tiny_wan22(tmp_path_factory.mktemp("wan22"), tiny_wan_path)


@pytest.fixture(scope="module")
def ours(wan22_path):
    return load_pipeline(wan22_path, dtype="float32")


@pytest.fixture(scope="module")
def expected(wan22_path, tiny_wan_path):
    """diffusers' videos: guidance_scale_2 given, left out (guidance_scale's), and the first expert alone."""
    import torch
    from diffusers import WanPipeline

    def run(folder, **kw):
        pipe = WanPipeline.from_pretrained(str(folder), dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        with torch.no_grad():
            return call(pipe, latents=torch.from_numpy(latents_for(2)), **kw).frames

    return {
        "two_scales": run(wan22_path, guidance_scale=5.0, guidance_scale_2=2.0),
        "one_scale": run(wan22_path, guidance_scale=4.0),
        "first_expert_alone": run(tiny_wan_path, guidance_scale=4.0),
    }


def test_two_experts_match_diffusers(ours, expected):
    assert ours.boundary_timestep == 800.0
    assert ours.defaults["guidance_scale_2"] == ours.defaults["guidance_scale"]  # published: the API takes it
    two = call(ours, guidance_scale=5.0, guidance_scale_2=2.0).images
    one = call(ours, guidance_scale=4.0).images
    assert np.abs(two - expected["two_scales"]).max() <= 1e-3
    assert np.abs(one - expected["one_scale"]).max() <= 1e-3
    # Both experts and both scales count: neither the first expert alone nor one scale for all steps is it (the
    # low-noise steps' scale moves this tiny model's frames by 1.7e-3, against parity errors of about 3e-6).
    assert np.abs(one - expected["first_expert_alone"]).max() > 1e-2
    same = call(ours, guidance_scale=5.0).images
    assert np.abs(same - two).max() > 5e-4
    # Per row, None is the row's guidance_scale (how the serving side passes a job without it).
    mixed = call(ours, guidance_scale=5.0, guidance_scale_2=[None, 2.0]).images
    assert np.abs(mixed[0] - same[0]).max() <= 1e-5 and np.abs(mixed[1] - two[1]).max() <= 1e-5


def test_a_layout_with_split_weights_matches_one_device(wan22_path, ours):
    """cfg2 x context2 x data2 (Ulysses), both experts' weights stored split 8 ways: the one-device video, with
    a step cache too (each expert's state, the one device's decisions)."""
    pipe = load_pipeline(
        wan22_path,
        dtype="float32",
        mesh={"data": 2, "cfg": 2, "context": 2},
        devices=list(range(8)),
        attention=AttentionSettings(context_strategy="ulysses"),
        weights={"shard_over": ["data", "cfg", "context"]},
    )
    kw = {"guidance_scale": 5.0, "guidance_scale_2": 2.0, "output_type": "latent"}
    assert np.abs(call(pipe, **kw).images - call(ours, **kw).images).max() <= 1e-4
    kw["cache"] = {"method": "teacache", "threshold": 0.1}
    split, single = call(pipe, **kw), call(ours, **kw)
    assert split.cached_steps == single.cached_steps == [1, 1]
    assert np.abs(split.images - single.images).max() <= 1e-4


@pytest.mark.parametrize("method", ["first_block", "teacache"])
def test_a_step_cache_keeps_a_state_per_expert(ours, method):
    """Threshold 0 is the uncached program; at threshold 1 each expert's first step computes (the other
    expert's features are no reference for it) and, for the first-block rule, its second one skips: 2 of the
    4 steps per row, where one state for both would skip 3."""
    kw = {"guidance_scale": 5.0, "guidance_scale_2": 2.0, "output_type": "latent"}
    plain = call(ours, **kw).images
    exact = call(ours, cache={"method": method, "threshold": 0.0}, **kw)
    assert exact.cached_steps == [0, 0] and np.abs(exact.images - plain).max() <= 1e-5
    compiled = ours.compilations
    lazy = call(ours, cache={"method": method, "threshold": 1.0}, **kw)
    assert ours.compilations == compiled
    if method == "first_block":
        assert lazy.cached_steps == [2, 2]
    else:
        assert all(0 < skipped <= 2 for skipped in lazy.cached_steps), lazy.cached_steps
    assert np.abs(lazy.images - plain).max() > 1e-4


def test_what_two_experts_refuse(ours, wan22_path, tiny_wan_path, tmp_path):
    one_transformer = load_pipeline(tiny_wan_path, dtype="float32")
    with pytest.raises(PipelineError, match="unsupported argument .guidance_scale_2."):
        one_transformer("a cat", guidance_scale_2=2.0)
    with pytest.raises(PipelineError, match="load_into_transformer_2: this model has one transformer"):
        one_transformer.load_lora("ink", tmp_path / "none.safetensors", load_into_transformer_2=True)

    from meshserve.models.registry import ModelFolderError

    folder = tmp_path / "wan22"
    shutil.copytree(wan22_path, folder)
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    index_path.write_text(json.dumps({**index, "transformer_2": [None, None]}))
    with pytest.raises(
        ModelFolderError, match=r"\['boundary_ratio'\] \(Wan 2.2's two-expert model\) without"
    ):
        load_pipeline(folder, dtype="float32")
    index_path.write_text(json.dumps({**index, "expand_timesteps": True}))
    with pytest.raises(ModelFolderError, match="expand_timesteps"):
        load_pipeline(folder, dtype="float32")


def test_int8_quantizes_both_experts(wan22_path, ours):
    """Each expert's Linears take int8 weights with their own scales (a scale kept under the wrong expert's
    path fails the load): the latents within int8's error of fp32 (1.4e-3 of their range when written)."""
    pipe = load_pipeline(wan22_path, dtype="float32", quantize="int8")
    kw = {"guidance_scale": 5.0, "guidance_scale_2": 2.0, "output_type": "latent"}
    got, fp32 = call(pipe, **kw).images, call(ours, **kw).images
    assert 0 < np.abs(got - fp32).max() <= 1e-2 * np.abs(fp32).max()


def test_image_to_video_experts_match_diffusers(tiny_wan_path, tmp_path_factory, monkeypatch):
    """Wan 2.2 I2V-A14B's layout (two experts taking the noise, the mask and the first frame's latents, no CLIP
    image tokens, no image encoder): a batch of two images, CFG with guidance_scale_2 on one row, none on the
    other, against diffusers' WanImageToVideoPipeline per image, without and with a last frame. Its 2-step
    schedule [999, 750] at boundary_ratio 0.9 runs one step on each expert."""
    import diffusers.pipelines.wan.pipeline_wan as t2v
    import diffusers.pipelines.wan.pipeline_wan_i2v as i2v_module
    import torch
    from diffusers import WanImageToVideoPipeline

    from tests.fixtures.tiny_wan_i2v import build_tiny_wan22_i2v
    from tests.models.test_wan_i2v import NOISE, PIPE, two_images

    monkeypatch.setattr(i2v_module, "basic_clean", t2v.basic_clean)  # no ftfy here (test_wan_i2v.py)
    path = build_tiny_wan22_i2v(tmp_path_factory.mktemp("wan22_i2v"), tiny_wan_path)
    reference = WanImageToVideoPipeline.from_pretrained(str(path), torch_dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    ours = load_pipeline(path, dtype="float32")
    assert ours.tasks == ("image-to-video",) and not ours.image_tokens
    images, prompts = two_images(), ["a cat", "the dog and the cat"]
    noise = np.random.default_rng(0).standard_normal((2, *NOISE)).astype(np.float32)
    rows = [
        {"guidance_scale": 4.0, "guidance_scale_2": 2.0, "negative_prompt": "blurry"},
        {"guidance_scale": 1.0},
    ]
    got = ours(
        prompts,
        image=images,
        negative_prompt=["blurry", None],
        guidance_scale=[4.0, 1.0],
        guidance_scale_2=[2.0, None],
        latents=noise,
        **PIPE,
    ).images
    for row, kw in enumerate(rows):
        with torch.no_grad():
            want = reference(
                image=images[row],
                prompt=prompts[row],
                latents=torch.from_numpy(noise[row : row + 1]),
                output_type="np",
                **PIPE,
                **kw,
            ).frames
        assert want.std() > 1e-2 and np.abs(got[row : row + 1] - want).max() <= 1e-3, row

    # A last frame (diffusers' last_image: the condition video ends with it, the mask keeps its frame), per row,
    # by the same program as without one: nothing compiles.
    assert ours.limits["last_image"] and ours.limits["last_image_optional"]
    compiled = ours.compilations
    got_last = ours(
        prompts,
        image=images,
        last_image=images[::-1],
        negative_prompt=["blurry", None],
        guidance_scale=[4.0, 1.0],
        guidance_scale_2=[2.0, None],
        latents=noise,
        **PIPE,
    ).images
    assert ours.compilations == compiled
    for row, kw in enumerate(rows):
        with torch.no_grad():
            want = reference(
                image=images[row],
                last_image=images[1 - row],
                prompt=prompts[row],
                latents=torch.from_numpy(noise[row : row + 1]),
                output_type="np",
                **PIPE,
                **kw,
            ).frames
        assert np.abs(got_last[row : row + 1] - want).max() <= 1e-3, row
        assert np.abs(got_last[row : row + 1] - got[row : row + 1]).max() > 1e-2, row  # the last frame counts
    with pytest.raises(PipelineError, match="more than one frame"):
        ours(prompts[0], image=images[0], last_image=images[1], **{**PIPE, "num_frames": 1})


def test_a_lora_per_expert_matches_diffusers(wan22_path, tmp_path):
    """A high-noise adapter loaded into `transformer` and a low-noise one into `transformer_2` (diffusers'
    load_into_transformer_2), given per request at their scales, together or alone: diffusers' latents after 4
    CFG steps (two per expert) with the same adapters set."""
    import torch
    from diffusers import WanPipeline

    from tests.fixtures.tiny_lora import random_factors, write_diffusers_lora
    from tests.models.test_lora import WAN_TARGETS, loras, reference_with

    ref = WanPipeline.from_pretrained(str(wan22_path), dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    files = {
        name: write_diffusers_lora(
            tmp_path / f"{name}.safetensors",
            random_factors(model, WAN_TARGETS, rank=4, seed=seed),
            prefix="transformer",
        )
        for name, model, seed in (("high", ref.transformer, 1), ("low", ref.transformer_2, 2))
    }
    ref.load_lora_weights(str(files["high"]), adapter_name="high")
    ref.load_lora_weights(str(files["low"]), adapter_name="low", load_into_transformer_2=True)
    ours = load_pipeline(
        wan22_path, dtype="float32", max_loras=2, max_lora_rank=4, lora_budget_mb=4, lora_targets=WAN_TARGETS
    )
    high = ours.load_lora("high", files["high"])
    low = ours.load_lora("low", files["low"], load_into_transformer_2=True)
    assert {t.split(".", 1)[0] for t in high["targets"]} == {"transformer"}
    assert {t.split(".", 1)[0] for t in low["targets"]} == {"transformer_2"}
    latents = latents_for(1)
    kw = {"height": H, "width": W, "num_frames": F, "num_inference_steps": STEPS, "guidance_scale": 5.0}
    kw |= {"negative_prompt": "blurry", "output_type": "latent"}
    for names, scales in ((["high", "low"], [0.7, 0.9]), (["low"], [1.0])):
        reference_with(ref, names, scales)
        with torch.no_grad():
            expected = ref("a cat", latents=torch.from_numpy(latents), **kw).frames.float().numpy()
        got = ours("a cat", latents=latents, loras=loras(names, scales), **kw).images
        assert np.abs(got - expected).max() <= 1e-4, names
    plain = ours("a cat", latents=latents, **kw).images
    assert np.abs(got - plain).max() > 1e-2  # the low-noise adapter alone moves the latents


def test_a_served_adapter_goes_into_the_expert_it_was_registered_for(wan22_path, tmp_path):
    """The pool's path (workers/adapters.py over PipelineRunner): an adapter registered with
    load_into_transformer_2 adapts transformer_2's layers, and again when it is loaded back after an eviction;
    the model's LoRA limits publish the argument."""
    from diffusers import WanTransformer3DModel

    from meshserve.service.contract import LoraSpec
    from meshserve.workers.adapters import Adapters
    from meshserve.workers.runner import PipelineRunner
    from tests.fixtures.tiny_lora import random_factors, write_diffusers_lora
    from tests.models.test_lora import WAN_TARGETS

    lora = dict(max_loras=2, max_lora_rank=4, lora_budget_mb=4, lora_targets=WAN_TARGETS)
    runner = PipelineRunner("wan22", str(wan22_path), "float32", None, None, **lora)
    runner.load()
    assert runner.info().limits.loras.load_into_transformer_2 is True
    model = WanTransformer3DModel.from_pretrained(str(wan22_path / "transformer_2"))
    factors = random_factors(model, WAN_TARGETS, rank=4, seed=1)
    write_diffusers_lora(tmp_path / "a.safetensors", factors, prefix="transformer")
    adapters = Adapters(runner, model="wan22", root=str(tmp_path))

    def parts(name):
        return {t.split(".", 1)[0] for t in runner.pipe.lora._info[name]["targets"]}

    low = LoraSpec(source="a.safetensors", load_into_transformer_2=True)
    assert adapters.add("low", low, origin="config").error is None
    assert parts("low") == {"transformer_2"}
    assert adapters.add("high", LoraSpec(source="a.safetensors"), origin="config").error is None
    assert parts("high") == {"transformer"}
    runner.unload_lora("low")  # off the devices as an eviction leaves it: still registered
    adapters.ensure([["low"]])
    assert "low" in runner.resident_loras() and parts("low") == {"transformer_2"}

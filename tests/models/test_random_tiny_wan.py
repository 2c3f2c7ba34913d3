"""The random tiny Wan (the tests' Wan checkpoint): deterministic, an ordinary diffusers WanPipeline folder (every
key of every component read by diffusers/transformers, none missing), equal to diffusers' WanPipeline on it.

The measured errors are logged: `pytest tests/models/test_embedded_wan.py --log-cli-level=INFO` shows them.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from meshserve.models import load_pipeline
from meshserve.models.wan.pipeline import WanPipeline
from meshserve.models.wan.random_tiny import VERSION, random_wan_path, write_random_wan

log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_random_wan(tmp_path_factory.mktemp("tiny-wan") / "m")


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_two_builds_are_equal_bytes(folder, tmp_path):
    again = _files(write_random_wan(tmp_path / "again"))
    first = _files(folder)
    assert first.keys() == again.keys()
    assert [name for name in first if first[name] != again[name]] == []
    assert {"model_index.json", "scheduler/scheduler_config.json", "tokenizer/tokenizer.json"} <= first.keys()


def test_components_load_in_diffusers_without_missing_keys(folder):
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    for cls, sub in (
        (WanTransformer3DModel, "transformer"),
        (AutoencoderKLWan, "vae"),
        (UMT5EncoderModel, "text_encoder"),
    ):
        _, info = cls.from_pretrained(str(folder / sub), output_loading_info=True)
        problems = {k: v for k, v in info.items() if k != "error_msgs" and v}
        assert problems == {} and not info.get("error_msgs"), (sub, problems)


def test_diffusers_wan_pipeline_agrees(folder):
    """Same folder, same initial latents, the pipeline's own defaults (32x48, 5 frames, 4 UniPC steps, CFG 5)."""
    import torch
    from diffusers import WanPipeline as TorchWanPipeline

    reference = TorchWanPipeline.from_pretrained(str(folder), dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    ours = load_pipeline(folder)
    assert isinstance(ours, WanPipeline)
    d, frames = ours.defaults, ours.limits["frames"]["default"]
    assert (d["height"], d["width"], frames, d["num_inference_steps"]) == (32, 48, 5, 4)
    latents = np.random.default_rng(0).standard_normal((1, 4, 2, 4, 6)).astype(np.float32)
    kw = dict(
        height=d["height"],
        width=d["width"],
        num_frames=frames,
        num_inference_steps=d["num_inference_steps"],
        guidance_scale=5.0,
        negative_prompt="blurry",
    )
    with torch.no_grad():
        expected = reference("a cat", latents=torch.from_numpy(latents), output_type="np", **kw).frames
        expected_latents = reference(
            "a cat", latents=torch.from_numpy(latents), output_type="latent", **kw
        ).frames.numpy()
    got = ours("a cat", latents=latents, output_type="np", **kw).images
    got_latents = ours("a cat", latents=latents, output_type="latent", **kw).images
    assert got.shape == expected.shape == (1, 5, 32, 48, 3)
    err = float(np.abs(got - expected).max())
    latent_err = float(np.abs(got_latents - expected_latents).max() / np.abs(expected_latents).max())
    log.info("tiny-wan vs diffusers: frames max abs %.2e, latents max rel %.2e", err, latent_err)
    assert err <= 1e-3 and latent_err <= 1e-3
    assert expected.std() > 1e-2  # not a flat video: the comparison can fail
    assert float(np.abs(expected_latents - latents).max()) > 0.1  # the loop moved the latents


def test_the_random_folder_is_built_once(tmp_path, monkeypatch):
    """The random tiny Wan's folder is built once under the cache root (keyed by VERSION) and loads."""
    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path))
    path = random_wan_path()
    assert path == tmp_path / "models" / VERSION and (path / "model_index.json").is_file()
    assert random_wan_path() == path  # reused, not rebuilt
    pipe = load_pipeline(path)
    assert isinstance(pipe, WanPipeline)

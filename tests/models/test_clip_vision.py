"""CLIP vision encoders and their image preprocessing: ours (JAX, numpy/PIL) against transformers' on tiny random
checkpoints written by transformers' save_pretrained (tests/fixtures/tiny_wan_i2v.py).

The measured errors are logged: `pytest tests/models/test_clip_vision.py --log-cli-level=INFO` shows them.
"""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from PIL import Image

from meshserve.models.checkpoints.loading import CheckpointError, read_component_weights
from meshserve.models.components.clip_vision import (
    CLIPImagePreprocessor,
    CLIPVisionModelWithProjection,
    load_clip_vision_model,
)
from tests.fixtures.tiny_wan_i2v import build_tiny_clip_vision, build_tiny_image_processor

log = logging.getLogger(__name__)


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def images() -> list[Image.Image]:
    """A landscape RGB, a portrait RGBA and a grey image, of sizes that do not divide evenly."""
    rs = np.random.RandomState(0)
    return [
        Image.fromarray(rs.randint(0, 256, (37, 53, 3), np.uint8)),
        Image.fromarray(rs.randint(0, 256, (61, 40, 4), np.uint8), "RGBA"),
        Image.fromarray(rs.randint(0, 256, (30, 30), np.uint8), "L"),
    ]


@pytest.fixture(scope="module")
def processor_folder(tmp_path_factory):
    return build_tiny_image_processor(tmp_path_factory.mktemp("clip_vision") / "image_processor")


def test_preprocessing_equals_transformers(processor_folder):
    """Shortest side resized (bicubic), center-cropped, rescaled, normalised with the folder's statistics: the
    same pixels as transformers' CLIPImageProcessor (PIL backend) for odd-sized, RGBA and grey images."""
    from transformers import CLIPImageProcessor

    reference = CLIPImageProcessor.from_pretrained(str(processor_folder))
    ours = CLIPImagePreprocessor.from_folder(processor_folder)
    assert ours.image_mean == (0.5, 0.4, 0.3) and ours.output_size() == (28, 28)
    for image in images():
        want = reference(images=image, return_tensors="np")["pixel_values"].transpose(0, 2, 3, 1)
        got = ours([image])
        assert got.shape == want.shape == (1, 28, 28, 3)
        err = float(np.abs(got - want).max())
        log.info("preprocess %s %s: max abs diff %.2e", image.mode, image.size, err)
        assert err <= 1e-5


def test_preprocessing_errors(tmp_path):
    bad = tmp_path / "preprocessor_config.json"
    bad.write_text(json.dumps({"size": {"longest_edge": 5}}))
    with pytest.raises(CheckpointError, match="shortest_edge or height and width"):
        CLIPImagePreprocessor.from_folder(tmp_path)
    small = CLIPImagePreprocessor(shortest_edge=16, crop_height=28, crop_width=28)
    with pytest.raises(ValueError, match="smaller than the 28x28 crop"):
        small([images()[0]])


@pytest.mark.parametrize("with_projection", [True, False])
def test_vision_model_equals_transformers(tmp_path, with_projection):
    """Every hidden state (Wan reads hidden_states[-2]), the pooled output and the projection equal
    transformers' on the same weights, fp32 <= 1e-4. transformers 5 saves a plain CLIPVisionModel without the
    `vision_model.` prefix, the projection model with it: both load."""
    import transformers

    folder = build_tiny_clip_vision(tmp_path / "image_encoder", with_projection=with_projection)
    prefixed = any(k.startswith("vision_model.") for k in read_component_weights(folder))
    assert prefixed == with_projection
    cls = transformers.CLIPVisionModelWithProjection if with_projection else transformers.CLIPVisionModel
    reference = cls.from_pretrained(str(folder)).eval()
    pixels = np.random.RandomState(1).randn(2, 28, 28, 3).astype(np.float32)
    with torch.no_grad():
        want = reference(torch.from_numpy(pixels.transpose(0, 3, 1, 2)), output_hidden_states=True)

    model = load_clip_vision_model(folder)
    assert isinstance(model, CLIPVisionModelWithProjection) == with_projection
    graphdef, state = nnx.split(model)
    got = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(state, jnp.asarray(pixels))
    assert len(got.hidden_states) == len(want.hidden_states) == 4
    errors = {
        f"hidden_states[{i}]": rel_err(g, w)
        for i, (g, w) in enumerate(zip(got.hidden_states, want.hidden_states, strict=True))
    }
    errors["last_hidden_state"] = rel_err(got.last_hidden_state, want.last_hidden_state)
    if with_projection:
        errors["image_embeds"] = rel_err(got.image_embeds, want.image_embeds)
    else:
        errors["pooler_output"] = rel_err(got.pooler_output, want.pooler_output)
    log.info("CLIP vision (projection %s): %s", with_projection, {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(errors.values()) <= 1e-4, errors
    with pytest.raises(ValueError, match="the model takes 28x28"):
        model(jnp.zeros((1, 21, 28, 3)))
    # The penultimate states are not the last (a test that would pass on an off-by-one cannot fail).
    assert rel_err(got.hidden_states[-2], want.hidden_states[-1]) > 1e-2


def test_loader_errors(tmp_path):
    folder = build_tiny_clip_vision(tmp_path / "image_encoder")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["SiglipVisionModel"]}))
    with pytest.raises(CheckpointError, match="not a CLIP vision encoder"):
        load_clip_vision_model(folder)
    (folder / "config.json").write_text(json.dumps({**config, "image_size": 30}))
    with pytest.raises(CheckpointError, match="not a multiple of patch_size"):
        load_clip_vision_model(folder)

"""Live previews (models/engine/previews.py): the latent-to-RGB map is a least-squares fit that recovers a
known linear map, Flux's packing and Wan's frames are undone, and on the embedded model (a trained VAE) the
preview of the last step looks like the decoded picture; turning previews on or changing the period compiles
nothing."""

import jax.numpy as jnp
import numpy as np
import pytest

from meshserve.models.engine.common import PipelineError
from meshserve.models.engine.previews import (
    apply_map,
    blocky_latents,
    default_every,
    encode_preview,
    fit_map,
    to_channels_last,
)
from meshserve.models.flux.pipeline import pack_latents

PROMPT = "a red circle on a blue background"


@pytest.fixture
def pipe(embedded_sdxl):
    return embedded_sdxl


def test_fit_recovers_a_linear_decoder():
    rng = np.random.default_rng(0)
    m = rng.normal(size=(5, 3)).astype(np.float32) * 0.1
    m[4] = 0.5
    z = blocky_latents((8, 6, 4), 4)
    # A "VAE" that is exactly linear per latent pixel, upsampled 8x: the fit must find its map.
    images = np.concatenate([z, np.ones((*z.shape[:-1], 1), np.float32)], -1) @ m
    images = np.repeat(np.repeat(images, 8, axis=1), 8, axis=2)
    np.testing.assert_allclose(fit_map(z, images), m, atol=1e-5)


def test_flux_patches_and_video_frames_are_undone():
    x = np.random.default_rng(1).normal(size=(2, 4, 6, 3)).astype(np.float32)
    np.testing.assert_array_equal(
        to_channels_last(pack_latents, pack_latents(jnp.asarray(x)), x.shape[1:]), x
    )
    video = np.random.default_rng(2).normal(size=(2, 5, 4, 6, 3)).astype(np.float32)
    got = to_channels_last(lambda v: v, jnp.asarray(video), video.shape[1:])
    np.testing.assert_array_equal(got, video[:, 2])
    rgb = apply_map(jnp.asarray(x), jnp.ones((4, 3)) * 0.1)
    assert rgb.dtype == jnp.uint8 and rgb.shape == (2, 4, 6, 3)


def test_preview_of_the_last_step_resembles_the_picture(pipe):
    rgb_map = pipe.previews.prepare()  # fitted, or read from the cache file an earlier fit wrote
    assert rgb_map.shape == (5, 3) and np.isfinite(rgb_map).all() and pipe.previews.fit_seconds > 0
    assert pipe.previews.cache_path().is_file()
    np.testing.assert_allclose(pipe.previews.fit(), rgb_map, atol=1e-6)  # the fit is deterministic
    seen = []
    out = pipe(
        [PROMPT, PROMPT],  # the batch of the next test: one compiled program for both
        seed=[0, 1],
        guidance_scale=2.0,
        num_inference_steps=8,
        output_type="np",
        preview_every=4,
        preview_callback=lambda step, total, rows: seen.append((step, total, rows)),
    )
    assert [(s, t, sorted(r)) for s, t, r in seen] == [(4, 8, [0, 1]), (8, 8, [0, 1])]
    preview = seen[-1][2][0]
    assert preview.dtype == np.uint8 and preview.shape == (16, 16, 3)
    image = out.images[0].reshape(16, 4, 16, 4, 3).mean(axis=(1, 3))  # the picture at the latents' size
    corr = np.corrcoef(image.ravel(), preview.ravel() / 255.0)[0, 1]
    assert corr > 0.7, corr  # measured 0.85 on seed 0, 20 steps
    url = encode_preview(preview)
    assert url.startswith("data:image/webp;base64,") and len(url) < 16_000


def test_preview_every_compiles_nothing(pipe):
    kw = dict(seed=[0, 1], num_inference_steps=6, output_type="np", guidance_scale=2.0)
    plain = pipe([PROMPT, PROMPT], **kw).images
    before = pipe.compilations
    seen = []
    out = pipe(
        [PROMPT, PROMPT],
        preview_every=[2, 3],  # per row: each row has its own period
        preview_callback=lambda step, total, rows: seen.append((step, sorted(rows))),
        **kw,
    )
    assert pipe.compilations == before
    assert seen == [(2, [0]), (3, [1]), (4, [0]), (6, [0, 1])]
    np.testing.assert_array_equal(out.images, plain)  # previews change nothing in the pictures
    with pytest.raises(PipelineError, match="preview_every"):
        pipe(PROMPT, preview_every=-1, num_inference_steps=1)
    assert default_every(50) == 5 and default_every(3) == 1


def test_a_dropped_pipeline_is_freed():
    # Every denoise program keeps its preview callback alive from C++, out of the collector's sight; the
    # callback once held its pipeline, so no pipeline a process loaded was ever freed (its weights, and its
    # executables' memory mappings, until XLA:CPU crashed at vm.max_map_count). It holds it weakly now.
    import gc
    import weakref

    from meshserve.models import load_pipeline

    pipe = load_pipeline(None)
    pipe([PROMPT, PROMPT], seed=[0, 1], guidance_scale=2.0, num_inference_steps=2, output_type="np")
    assert pipe.compilations > 0
    dropped = weakref.ref(pipe)
    del pipe
    gc.collect()
    assert dropped() is None

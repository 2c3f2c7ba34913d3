"""The VAE's dtype (docs/outputs.md): a bf16 SDXL pipeline decodes in bf16, which is allowed because our bf16
decode's error against our fp32 decode stays within diffusers' own bf16-vs-fp32 error on the same weights and
latents (bound 1.5x, max and mean abs per pixel in [0, 1]); a pool's vae_dtype overrides the default."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from meshserve.models import PipelineError, load_pipeline
from meshserve.models.components.autoencoder_kl import load_autoencoder_kl

log = logging.getLogger(__name__)

LATENTS = np.random.RandomState(5).randn(2, 4, 16, 24).astype(np.float32)


def _pixels(x) -> np.ndarray:
    """[B, C, H, W] or [B, H, W, C] in [-1, 1] -> float32 pixels in [0, 1], as every decode ends."""
    return np.clip(np.asarray(x, np.float32) / 2 + 0.5, 0.0, 1.0)


def _ours(folder, dtype) -> np.ndarray:
    graphdef, state = nnx.split(load_autoencoder_kl(folder, dtype=dtype))
    decode = jax.jit(lambda s, z: nnx.merge(graphdef, s).decode(z.astype(dtype)).astype(jnp.float32))
    return _pixels(decode(state, jnp.asarray(LATENTS.transpose(0, 2, 3, 1))))


def _diffusers(folder, dtype) -> np.ndarray:
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(str(folder), torch_dtype=dtype).eval()
    with torch.no_grad():
        out = vae.decode(torch.from_numpy(LATENTS).to(dtype)).sample
    return _pixels(out.float().numpy().transpose(0, 2, 3, 1))


def _errors(a, b) -> tuple[float, float]:
    d = np.abs(a - b)
    return float(d.max()), float(d.mean())


@pytest.mark.parametrize("model", ["tiny-random", "embedded-trained"])
def test_bf16_decode_error_is_within_diffusers_own(model, tiny_sdxl_path, record_property):
    if model == "tiny-random":
        folder = tiny_sdxl_path / "vae"
    else:
        from meshserve.models.sdxl.embedded import embedded_model_path

        folder = embedded_model_path() / "vae"
    ours = _errors(_ours(folder, jnp.bfloat16), _ours(folder, jnp.float32))
    theirs = _errors(_diffusers(folder, torch.bfloat16), _diffusers(folder, torch.float32))
    log.info(
        "%s VAE bf16 vs fp32, max / mean abs per pixel: ours %.2e / %.2e, diffusers %.2e / %.2e",
        model,
        *ours,
        *theirs,
    )
    record_property("ours_max_mean", ours)
    record_property("diffusers_max_mean", theirs)
    assert ours[0] > 0 and theirs[0] > 0  # both really ran in bf16
    assert ours[0] <= 1.5 * theirs[0] and ours[1] <= 1.5 * theirs[1], (ours, theirs)


def _vae_dtypes(pipe) -> set:
    return {leaf.dtype for leaf in jax.tree.leaves(pipe._states["vae"])}


def test_a_bf16_sdxl_pipeline_decodes_in_bf16_unless_the_pool_says_float32(tiny_sdxl_path):
    assert _vae_dtypes(load_pipeline(tiny_sdxl_path, dtype="bfloat16")) == {jnp.dtype(jnp.bfloat16)}
    assert _vae_dtypes(load_pipeline(tiny_sdxl_path, dtype="bfloat16", vae_dtype="float32")) == {
        jnp.dtype(jnp.float32)
    }
    assert _vae_dtypes(load_pipeline(tiny_sdxl_path, dtype="float16")) == {
        jnp.dtype(jnp.float32)
    }  # overflows
    assert _vae_dtypes(load_pipeline(tiny_sdxl_path)) == {jnp.dtype(jnp.float32)}
    with pytest.raises(PipelineError, match="vae_dtype"):
        load_pipeline(tiny_sdxl_path, vae_dtype="int8")

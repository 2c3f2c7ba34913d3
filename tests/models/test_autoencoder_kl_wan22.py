"""The Wan 2.2 VAE (TI2V-5B's: residual levels with weightless average / duplicate shortcuts, 2 x 2 patches
folded into channels, 16x spatial compression) against diffusers' AutoencoderKLWan on the same random weights,
a tiny config with the real layout; and the real config's parameter tree.

The measured errors are logged: `pytest tests/models/test_autoencoder_kl_wan22.py --log-cli-level=INFO`."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from meshserve.models.wan.autoencoder_kl_wan import (
    load_autoencoder_kl_wan,
    patchify,
    unpatchify,
)
from tests.fixtures.tiny_wan import WAN22_VAE, tiny_wan_vae
from tests.models.test_autoencoder_kl_wan import (
    assert_real_config_maps,
    channels_first,
    channels_last,
    jitted,
    rel_err,
)

log = logging.getLogger(__name__)

H, W = 3, 5  # latent size; the video is 16x: 48 x 80


@pytest.fixture(scope="module")
def wan22_vae(tmp_path_factory):
    """(folder, diffusers model) of a tiny random Wan 2.2 VAE (tests/fixtures/tiny_wan.py's WAN22_VAE: every
    level residual, 2 x 2 patches, 16x in space)."""
    ref = tiny_wan_vae(0, WAN22_VAE)
    folder = tmp_path_factory.mktemp("wan22_vae")
    ref.save_pretrained(str(folder))
    return folder, ref


@pytest.fixture(scope="module")
def ours(wan22_vae):
    return load_autoencoder_kl_wan(wan22_vae[0])


def test_patches_fold_as_diffusers_folds_them():
    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify as ref_patchify

    x = np.random.RandomState(0).randn(2, 3, 5, 8, 12).astype(np.float32)  # [B, C, T, H, W]
    folded = patchify(channels_last(x), 2)
    np.testing.assert_array_equal(channels_first(folded), ref_patchify(torch.from_numpy(x), 2).numpy())
    np.testing.assert_array_equal(np.asarray(unpatchify(folded, 2)), np.asarray(channels_last(x)))


@pytest.mark.parametrize("frames", [1, 2, 3])
def test_decode_matches_diffusers(wan22_vae, ours, frames):
    _, ref = wan22_vae
    latents = np.random.RandomState(frames).randn(2, 4, frames, H, W).astype(np.float32)
    with torch.no_grad():
        expected = ref.decode(torch.from_numpy(latents)).sample.numpy()
    video = jitted(ours, "decode")(channels_last(latents))
    assert video.shape == (2, 1 + 4 * (frames - 1), 16 * H, 16 * W, 3)
    err = rel_err(channels_first(video), expected)
    log.info("Wan 2.2 VAE decode fp32, %d latent frames: rel err %.2e", frames, err)
    assert err <= 1e-4
    assert float(np.abs(expected).max()) > 0.1  # not a degenerate output


@pytest.mark.parametrize("frames", [1, 5, 9])
def test_encode_matches_diffusers(wan22_vae, ours, frames):
    _, ref = wan22_vae
    video = (
        np.random.RandomState(10 + frames).uniform(-1, 1, (2, 3, frames, 16 * H, 16 * W)).astype(np.float32)
    )
    with torch.no_grad():
        dist = ref.encode(torch.from_numpy(video)).latent_dist
    posterior = jitted(ours, "encode")(channels_last(video))
    assert posterior.mean.shape == (2, 1 + (frames - 1) // 4, H, W, 4)
    err_mean = rel_err(channels_first(posterior.mean), dist.mean.numpy())
    err_logvar = rel_err(channels_first(posterior.logvar), dist.logvar.numpy())
    log.info(
        "Wan 2.2 VAE encode fp32, %d frames: mean rel err %.2e, logvar %.2e", frames, err_mean, err_logvar
    )
    assert err_mean <= 1e-4 and err_logvar <= 1e-4


def test_later_frames_depend_on_earlier_ones_only(ours):
    """Causality through the shortcuts too: changing latent frame 2 leaves video frames 0..4 unchanged."""
    latents = np.random.RandomState(3).randn(1, 3, H, W, 4).astype(np.float32)
    changed = latents.copy()
    changed[:, 2] += 1.0
    decode = jitted(ours, "decode")
    a, b = np.asarray(decode(jnp.asarray(latents))), np.asarray(decode(jnp.asarray(changed)))
    np.testing.assert_array_equal(a[:, :5], b[:, :5])
    assert np.abs(a[:, 5:] - b[:, 5:]).max() > 1e-3


# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json, the fields that shape the network (its 48 latents_mean/std
# values are statistics, not shapes: zeros and ones here).
TI2V_5B_VAE = {
    "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0, "is_residual": True,
    "patch_size": 2, "in_channels": 12, "out_channels": 12, "scale_factor_spatial": 16,
    "scale_factor_temporal": 4, "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48,
}  # fmt: skip


def test_wan22_vae_config_builds_diffusers_parameter_tree():
    """At the real size every key and shape maps (test_autoencoder_kl_wan.py's check), and the compression
    is 4x in time, 16x in space."""
    cfg = assert_real_config_maps(TI2V_5B_VAE, "Wan 2.2 VAE")
    assert (cfg.temporal_compression, cfg.spatial_compression) == (4, 16)

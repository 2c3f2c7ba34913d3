"""AutoencoderKLWan: ours (JAX, [B, T, H, W, C]) against diffusers (PyTorch, [B, C, T, H, W]) on the same
weights, a tiny random VAE written by diffusers' own save_pretrained with the real temporal layout
(temperal_downsample [False, True, True]: 4x in time, 8x in space).

The measured errors are logged: `pytest tests/models/test_autoencoder_kl_wan.py --log-cli-level=INFO`.
"""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from meshserve.models.checkpoints.loading import abstract_module, to_nnx_layout, torch_key
from meshserve.models.wan.autoencoder_kl_wan import (
    SHARDING_RULES,
    AutoencoderKLWan,
    AutoencoderKLWanConfig,
    load_autoencoder_kl_wan,
)

log = logging.getLogger(__name__)

TINY = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    latents_mean=[0.0] * 4,
    latents_std=[1.0] * 4,
)
H, W = 4, 6  # latent size; non-square so a transposed H/W would not go unnoticed


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def channels_last(x: np.ndarray) -> jax.Array:  # [B, C, T, H, W] -> [B, T, H, W, C]
    return jnp.asarray(x.transpose(0, 2, 3, 4, 1))


def channels_first(x) -> np.ndarray:
    return np.asarray(x, np.float32).transpose(0, 4, 1, 2, 3)


def jitted(model, method: str):
    """model.<method> as a pipeline calls it: split once, one jitted function of (state, input)."""
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda state, x: getattr(nnx.merge(graphdef, state), method)(x))
    return lambda x: fn(state, x)


@pytest.fixture(scope="module")
def wan_vae(tmp_path_factory):
    """(folder, diffusers model) of a tiny random AutoencoderKLWan."""
    from diffusers import AutoencoderKLWan as Reference

    torch.manual_seed(0)
    ref = Reference(**TINY).eval()
    # diffusers initialises the norm gammas to 1 and many biases to 0: randomise every parameter so a
    # mis-mapped one shows.
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("wan_vae")
    ref.save_pretrained(str(folder))
    return folder, ref


@pytest.fixture(scope="module")
def ours(wan_vae):
    return load_autoencoder_kl_wan(wan_vae[0])


@pytest.mark.parametrize("frames", [1, 2, 3, 5])
def test_decode_matches_diffusers(wan_vae, ours, frames):
    _, ref = wan_vae
    latents = np.random.RandomState(frames).randn(2, 4, frames, H, W).astype(np.float32)
    with torch.no_grad():
        expected = ref.decode(torch.from_numpy(latents)).sample.numpy()
    video = jitted(ours, "decode")(channels_last(latents))
    assert video.shape == (2, 1 + 4 * (frames - 1), 8 * H, 8 * W, 3)
    assert expected.shape[2] == video.shape[1]
    err = rel_err(channels_first(video), expected)
    log.info("Wan VAE decode fp32, %d latent frames: rel err %.2e", frames, err)
    assert err <= 1e-4
    assert float(jnp.abs(video).max()) <= 1.0  # clamped


@pytest.mark.parametrize("frames", [1, 5, 9])
def test_encode_matches_diffusers(wan_vae, ours, frames):
    _, ref = wan_vae
    video = np.random.RandomState(10 + frames).uniform(-1, 1, (2, 3, frames, 8 * H, 8 * W)).astype(np.float32)
    with torch.no_grad():
        dist = ref.encode(torch.from_numpy(video)).latent_dist
    posterior = jitted(ours, "encode")(channels_last(video))
    assert posterior.mean.shape == (2, 1 + (frames - 1) // 4, H, W, 4)
    err_mean = rel_err(channels_first(posterior.mean), dist.mean.numpy())
    err_logvar = rel_err(channels_first(posterior.logvar), dist.logvar.numpy())
    log.info("Wan VAE encode fp32, %d frames: mean rel err %.2e, logvar %.2e", frames, err_mean, err_logvar)
    assert err_mean <= 1e-4 and err_logvar <= 1e-4


def test_bf16_decode_is_as_close_as_diffusers_bf16(wan_vae):
    """bf16 weights and latents: within twice diffusers' own bf16 error of the fp32 reference (measured
    6.7e-2 against diffusers' 5.0e-2 on 3 frames); this catches a broken cast, not rounding."""
    import copy

    folder, ref = wan_vae
    ours = load_autoencoder_kl_wan(folder, dtype=jnp.bfloat16)
    assert {v.dtype for v in jax.tree.leaves(nnx.state(ours, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    latents = np.random.RandomState(0).randn(1, 4, 3, H, W).astype(np.float32)
    ref_bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    with torch.no_grad():
        expected = ref.decode(torch.from_numpy(latents)).sample.numpy()
        diffusers_bf16 = ref_bf16.decode(torch.from_numpy(latents).bfloat16()).sample.float().numpy()
    video = jitted(ours, "decode")(channels_last(latents).astype(jnp.bfloat16))
    assert video.dtype == jnp.bfloat16
    err, err_diffusers = rel_err(channels_first(video), expected), rel_err(diffusers_bf16, expected)
    log.info("Wan VAE decode bf16 vs diffusers fp32: rel err %.2e (diffusers bf16: %.2e)", err, err_diffusers)
    assert err <= 2 * err_diffusers


def test_weights_split_over_the_mesh_decode_the_same(wan_vae, ours):
    """FSDP: the VAE's weights stored split over data2 x context2 by SHARDING_RULES, gathered inside the
    program as the pipelines do, decode what the single-device model decodes."""
    from meshserve.models.parallel import MeshSizes, make_mesh
    from meshserve.models.parallel.placement import Placement, gathered

    sizes = MeshSizes(data=2, context=2)
    placement = Placement(make_mesh(sizes, jax.devices()[:4]), sizes, ("data", "context"))
    split = load_autoencoder_kl_wan(wan_vae[0], place=placement.placer(SHARDING_RULES))
    kernel = split.decoder.conv_in.kernel[...]  # [3, 3, 3, 4, 16]: 16 output channels over 4 devices
    assert {shard.data.shape[-1] for shard in kernel.addressable_shards} == {4}
    graphdef, state = nnx.split(split)
    decode = jax.jit(
        lambda state, z: nnx.merge(graphdef, gathered(placement, state, SHARDING_RULES)).decode(z)
    )
    latents = jnp.asarray(np.random.RandomState(7).randn(2, 2, H, W, 4).astype(np.float32))
    want = np.asarray(jitted(ours, "decode")(latents))
    np.testing.assert_allclose(np.asarray(decode(state, latents)), want, rtol=0, atol=1e-5)


def test_later_frames_depend_on_earlier_ones_only(ours):
    """Causality (and the cache really carries state): changing latent frame 2 leaves video frames 0..4
    (from latent frames 0 and 1) unchanged and changes the frames after."""
    latents = np.random.RandomState(3).randn(1, 3, H, W, 4).astype(np.float32)
    changed = latents.copy()
    changed[:, 2] += 1.0
    decode = jitted(ours, "decode")
    a, b = np.asarray(decode(jnp.asarray(latents))), np.asarray(decode(jnp.asarray(changed)))
    np.testing.assert_array_equal(a[:, :5], b[:, :5])
    assert np.abs(a[:, 5:] - b[:, 5:]).max() > 1e-3


def test_encode_rejects_partial_chunks(ours):
    with pytest.raises(ValueError, match="1 \\+ 4k"):
        ours.encode(jnp.zeros((1, 4, 8 * H, 8 * W, 3)))


def test_config_rejects_attention_scales_and_bad_statistics():
    with pytest.raises(ValueError, match="patch_size must be >= 1"):
        AutoencoderKLWanConfig.from_config({**TINY, "patch_size": 0})
    with pytest.raises(ValueError, match="attn_scales"):
        AutoencoderKLWanConfig.from_config({**TINY, "attn_scales": [1.0]})
    with pytest.raises(ValueError, match="latents_mean needs one value per latent channel"):
        AutoencoderKLWanConfig.from_config({**TINY, "z_dim": 4, "latents_mean": None})
    cfg = AutoencoderKLWanConfig.from_config({})
    assert (cfg.base_dim, cfg.z_dim, cfg.dim_mult, cfg.num_res_blocks) == (96, 16, (1, 2, 4, 4), 2)
    assert cfg.temperal_downsample == (False, True, True) and len(cfg.latents_mean) == 16


# Wan-AI/Wan2.1-T2V-1.3B-Diffusers vae/config.json (the fields that shape the network; latents_mean/std are
# diffusers' defaults, which that file repeats).
WAN21_VAE = {
    "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True], "dropout": 0.0,
}  # fmt: skip


def assert_real_config_maps(config: dict, name: str) -> AutoencoderKLWanConfig:
    """At a real VAE's size (shapes only; diffusers on the meta device): every key and shape maps, and the
    sharding rules cover every conv kernel."""
    from diffusers import AutoencoderKLWan as Reference

    cfg = AutoencoderKLWanConfig.from_config(config)
    model = abstract_module(AutoencoderKLWan, cfg)
    with torch.device("meta"):
        ref = Reference(**config)
    expected = {}
    for key, value in ref.state_dict().items():
        zeros = np.broadcast_to(np.int8(0), value.shape)  # zero-strided: no memory
        key = key.replace(".resample.1.", ".resample.")
        expected[key] = (zeros.reshape(-1) if key.endswith("gamma") else to_nnx_layout("kernel", zeros)).shape
    got = {torch_key(path): tuple(var.get_value().shape) for path, var in nnx.to_flat_state(nnx.state(model))}
    assert sorted(got) == sorted(expected)
    assert {k: v for k, v in got.items() if v != expected[k]} == {}
    params = sum(int(np.prod(s)) for s in got.values())
    assert params == sum(p.numel() for p in ref.parameters())
    log.info("%s: %d parameters", name, params)
    for key, shape in got.items():
        if key.endswith(".weight"):
            assert any(re.search(p, key) and len(axes) == len(shape) for p, axes in SHARDING_RULES), key
    return cfg


def test_wan21_vae_config_builds_diffusers_parameter_tree():
    assert_real_config_maps(WAN21_VAE, "Wan 2.1 VAE")

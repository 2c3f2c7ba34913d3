"""AutoencoderKL: ours (JAX, NHWC) against diffusers (PyTorch, NCHW) on the same weights.

The measured errors are logged: `pytest tests/models/test_autoencoder_kl.py --log-cli-level=INFO` shows them.
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

from meshserve.models.checkpoints.loading import read_component_weights, write_safetensors
from meshserve.models.components.autoencoder_kl import AutoencoderKLConfig, load_autoencoder_kl

log = logging.getLogger(__name__)


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def nhwc(x: np.ndarray) -> jax.Array:
    return jnp.asarray(x.transpose(0, 2, 3, 1))


def nchw(x) -> np.ndarray:
    return np.asarray(x, np.float32).transpose(0, 3, 1, 2)


def jitted(model, method: str):
    """model.<method> as the pipeline calls it: split once, one jitted function of (state, input)."""
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda state, x: getattr(nnx.merge(graphdef, state), method)(x))
    return lambda x: fn(state, x)


def reference(folder):
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(str(folder)).eval()


# Non-square on purpose: a transposed H/W would not go unnoticed.
IMAGES = np.random.RandomState(0).uniform(-1, 1, (2, 3, 32, 48)).astype(np.float32)
LATENTS = np.random.RandomState(1).randn(2, 4, 16, 24).astype(np.float32)


@pytest.fixture(scope="module")
def vae_folder(tiny_sdxl_path):
    return tiny_sdxl_path / "vae"


def test_encode_matches_diffusers(vae_folder):
    ours = load_autoencoder_kl(vae_folder)
    with torch.no_grad():
        dist = reference(vae_folder).encode(torch.from_numpy(IMAGES)).latent_dist
    posterior = jitted(ours, "encode")(nhwc(IMAGES))
    err_mean = rel_err(nchw(posterior.mean), dist.mean.numpy())
    err_logvar = rel_err(nchw(posterior.logvar), dist.logvar.numpy())
    log.info("VAE encode fp32: mean rel err %.2e, logvar rel err %.2e", err_mean, err_logvar)
    assert err_mean <= 1e-4 and err_logvar <= 1e-4

    # sample() is mean + std * N(0, 1): the same key gives the same draw, another key another one.
    key = jax.random.key(0)
    draw = posterior.sample(key)
    noise = (draw - posterior.mean) / posterior.std
    np.testing.assert_allclose(noise, jax.random.normal(key, posterior.mean.shape), atol=1e-4)
    assert not np.allclose(posterior.sample(jax.random.key(1)), draw)


def test_decode_matches_diffusers(vae_folder):
    ours = load_autoencoder_kl(vae_folder)
    with torch.no_grad():
        expected = reference(vae_folder).decode(torch.from_numpy(LATENTS)).sample.numpy()
    images = jitted(ours, "decode")(nhwc(LATENTS))
    assert images.shape == (2, 32, 48, 3)
    err = rel_err(nchw(images), expected)
    log.info("VAE decode fp32: rel err %.2e", err)
    assert err <= 1e-4


def test_bf16_decode_runs_close_to_fp32_reference(vae_folder):
    ours = load_autoencoder_kl(vae_folder, dtype=jnp.bfloat16)
    assert {v.dtype for v in jax.tree.leaves(nnx.state(ours, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    with torch.no_grad():
        expected = reference(vae_folder).decode(torch.from_numpy(LATENTS)).sample.numpy()
    images = jitted(ours, "decode")(nhwc(LATENTS).astype(jnp.bfloat16))
    err = rel_err(nchw(images), expected)
    log.info("VAE decode bf16 vs diffusers fp32: rel err %.2e", err)
    assert images.dtype == jnp.bfloat16
    assert err <= 5e-2  # bf16 has an 8-bit mantissa; this catches a broken cast, not rounding


def test_variant_without_quant_convs_or_mid_attention(tmp_path):
    """The optional parts: no quant convs, no mid-block attention, three levels, a shift factor."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    ref = AutoencoderKL(
        block_out_channels=[16, 32, 32],
        layers_per_block=1,
        norm_num_groups=8,
        latent_channels=4,
        down_block_types=["DownEncoderBlock2D"] * 3,
        up_block_types=["UpDecoderBlock2D"] * 3,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    ).eval()
    ref.save_pretrained(str(tmp_path))
    ours = load_autoencoder_kl(tmp_path)
    assert ours.quant_conv is None and ours.post_quant_conv is None
    assert len(ours.decoder.mid_block.attentions) == 0
    assert (ours.config.scaling_factor, ours.config.shift_factor) == (0.3611, 0.1159)

    images = IMAGES[:, :, :24, :40]  # 24x40 -> 6x10 latents through two asymmetric-padding downsamples
    latents = LATENTS[:, :, :6, :10]
    with torch.no_grad():
        mean = ref.encode(torch.from_numpy(images)).latent_dist.mean.numpy()
        decoded = ref.decode(torch.from_numpy(latents)).sample.numpy()
    err_enc = rel_err(nchw(ours.encode(nhwc(images)).mean), mean)
    err_dec = rel_err(nchw(ours.decode(nhwc(latents))), decoded)
    log.info("VAE variant fp32: encode mean rel err %.2e, decode rel err %.2e", err_enc, err_dec)
    assert err_enc <= 1e-4 and err_dec <= 1e-4


def test_legacy_attention_names_load(vae_folder, tmp_path):
    """Old checkpoints name the mid-block attention query/key/value/proj_attn, some as 1x1 convs."""
    state = read_component_weights(vae_folder)
    legacy = {}
    for key, value in state.items():
        for new, old in (
            (".to_q.", ".query."),
            (".to_k.", ".key."),
            (".to_v.", ".value."),
            (".to_out.0.", ".proj_attn."),
        ):
            key = key.replace(new, old)
        if key.endswith("query.weight"):
            value = value[:, :, None, None]
        legacy[key] = np.array(value)
    assert any(".proj_attn." in k for k in legacy)
    write_safetensors(tmp_path / "diffusion_pytorch_model.safetensors", legacy)
    (tmp_path / "config.json").write_text((vae_folder / "config.json").read_text())

    modern, old = load_autoencoder_kl(vae_folder), load_autoencoder_kl(tmp_path)
    for a, b in zip(jax.tree.leaves(nnx.state(modern)), jax.tree.leaves(nnx.state(old)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_config_reads_json_and_rejects_unknown_blocks(vae_folder):
    raw = json.loads((vae_folder / "config.json").read_text())
    cfg = AutoencoderKLConfig.from_config(raw)
    assert cfg.block_out_channels == tuple(raw["block_out_channels"])
    assert cfg.scaling_factor == raw["scaling_factor"] and cfg.shift_factor is None
    assert cfg.layers_per_block == raw["layers_per_block"]
    with pytest.raises(ValueError, match="AttnDownEncoderBlock2D"):
        AutoencoderKLConfig.from_config(
            {**raw, "down_block_types": ["AttnDownEncoderBlock2D", "DownEncoderBlock2D"]}
        )


# stabilityai/sdxl-vae config.json (the fields that shape the network).
SDXL_VAE = {
    "act_fn": "silu", "block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3, "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32, "out_channels": 3,
    "sample_size": 1024, "scaling_factor": 0.13025, "up_block_types": ["UpDecoderBlock2D"] * 4,
}  # fmt: skip


def test_sdxl_vae_config_builds_diffusers_parameter_tree():
    """At full SDXL-VAE size (shapes only; diffusers on the meta device): every checkpoint key and shape."""
    from diffusers import AutoencoderKL as TorchAutoencoderKL

    from meshserve.models.checkpoints.loading import abstract_module, to_nnx_layout, torch_key
    from meshserve.models.components.autoencoder_kl import AutoencoderKL

    cfg = AutoencoderKLConfig.from_config(SDXL_VAE)
    ours = abstract_module(AutoencoderKL, cfg)
    with torch.device("meta"):
        ref = TorchAutoencoderKL(**SDXL_VAE)
    # Rank >= 2 weights are Linear/Conv kernels (the loader's rule); zero-strided views: no memory.
    expected = {
        key: to_nnx_layout("kernel" if value.ndim > 1 else "", np.broadcast_to(np.int8(0), value.shape)).shape
        for key, value in ref.state_dict().items()
    }
    got = {torch_key(path): tuple(var.get_value().shape) for path, var in nnx.to_flat_state(nnx.state(ours))}
    assert sorted(got) == sorted(expected)
    assert {k: v for k, v in got.items() if v != expected[k]} == {}
    assert sum(int(np.prod(s)) for s in got.values()) == 83_653_863  # the SDXL VAE's parameter count

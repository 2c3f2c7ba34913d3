"""The whole Flux.1 pipeline against diffusers' FluxPipeline (torch fp32, CPU) on the same folder and the same
packed latents: dev (guidance embedding, dynamic shift), schnell (none, static shift), true CFG; plus batching,
seeds, bf16, recompilation, the embedded tiny Flux, and the full-size FLUX.1 / T5-XXL / VAE key maps.

The measured errors are logged: `pytest tests/models/test_flux_pipeline.py --log-cli-level=INFO` shows them.
"""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

from meshserve.models import GenerationCancelled, PipelineError, load_pipeline
from meshserve.models.engine.seeds import initial_noise, key_data, row_keys, step_keys
from meshserve.models.flux.pipeline import FluxPipeline, pack_latents, unpack_latents

log = logging.getLogger(__name__)

# 36 x 44 px -> 18 x 22 latents (VAE factor 2) -> 9 x 11 = 99 packed tokens: odd, so the image sequence
# divides neither 2 nor 4, and the image is not square.
H, W = 36, 44
TOKENS, CHANNELS = (H // 4) * (W // 4), 16
TEXT = 24  # a short T5 text keeps the tests fast; the default length (512 for dev) is run once
PROMPTS = ["a cat", "the dog and the cat"]


def packed_latents(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, TOKENS, CHANNELS)).astype(np.float32)


def max_abs(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max())


def rel_err(ours, ref) -> float:
    return max_abs(ours, ref) / float(np.abs(np.asarray(ref, np.float32)).max())


def _reference(path, dtype="float32"):
    import torch
    from diffusers import FluxPipeline as TorchFluxPipeline

    pipe = TorchFluxPipeline.from_pretrained(str(path), torch_dtype=getattr(torch, dtype))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_reference(pipe, prompt, latents, *, output_type="np", **kw):
    import torch

    kw = {"height": H, "width": W, "num_inference_steps": 3, "max_sequence_length": TEXT, **kw}
    out = pipe(prompt, latents=torch.from_numpy(latents), output_type=output_type, **kw).images
    return out.float().numpy() if output_type == "latent" else out


def run_ours(pipe, prompt, *, output_type="np", **kw):
    kw = {"height": H, "width": W, "num_inference_steps": 3, "max_sequence_length": TEXT, **kw}
    return pipe(prompt, output_type=output_type, **kw).images


@pytest.fixture(scope="module")
def dev(tiny_flux_dev_path):
    return load_pipeline(tiny_flux_dev_path, dtype="float32")


@pytest.fixture(scope="module")
def dev_reference(tiny_flux_dev_path):
    return _reference(tiny_flux_dev_path)


# --------------------------------------------------------------------------------------------------
# Parity with diffusers


def test_dev_matches_diffusers(dev, dev_reference):
    """Dev: the guidance embedding per row, the dynamic shift; np output at the default text length (512),
    and packed latent output."""
    latents = packed_latents(2)
    expected = run_reference(dev_reference, PROMPTS, latents, guidance_scale=3.5, max_sequence_length=512)
    got = run_ours(dev, PROMPTS, latents=latents, guidance_scale=3.5, max_sequence_length=None)
    assert got.shape == expected.shape == (2, H, W, 3)
    err = max_abs(got, expected)
    log.info("flux dev fp32, np: max abs pixel error %.2e (image std %.3f)", err, expected.std())
    assert err <= 1e-3
    assert expected.std() > 1e-2  # real images, not two blanks

    expected = run_reference(dev_reference, PROMPTS, latents, guidance_scale=5.0, output_type="latent")
    got = run_ours(dev, PROMPTS, latents=latents, guidance_scale=5.0, output_type="latent")
    assert got.shape == expected.shape == (2, TOKENS, CHANNELS)
    err = rel_err(got, expected)
    log.info("flux dev fp32, packed latents: max rel error %.2e", err)
    assert err <= 1e-3
    assert max_abs(expected, latents) > 0.1  # the loop moved the latents


def test_schnell_matches_diffusers_and_ignores_guidance(tiny_flux_schnell_path):
    schnell, reference = load_pipeline(tiny_flux_schnell_path), _reference(tiny_flux_schnell_path)
    assert not schnell.guidance_embeds
    latents = packed_latents(2, seed=1)
    # diffusers' default text length (512) is schnell's default too: no folder default asks for 256 here
    kw = dict(num_inference_steps=4, max_sequence_length=512)
    expected = run_reference(reference, PROMPTS, latents, guidance_scale=0.0, **kw)
    got = run_ours(schnell, PROMPTS, latents=latents, **{**kw, "max_sequence_length": None})
    err = max_abs(got, expected)
    log.info("flux schnell fp32, np: max abs pixel error %.2e", err)
    assert err <= 1e-3 and expected.std() > 1e-2
    # No guidance embedding: the scale changes nothing.
    again = run_ours(schnell, PROMPTS, latents=latents, guidance_scale=7.0, **kw)
    np.testing.assert_array_equal(again, got)


def test_true_cfg_matches_diffusers(dev, dev_reference):
    latents = packed_latents(2, seed=2)
    kw = dict(negative_prompt=["a dog", "the cat"], true_cfg_scale=2.0, guidance_scale=3.5)
    expected = run_reference(dev_reference, PROMPTS, latents, **kw)
    got = run_ours(dev, PROMPTS, latents=latents, **kw)
    err = max_abs(got, expected)
    log.info("flux dev true CFG fp32, np: max abs pixel error %.2e", err)
    assert err <= 1e-3
    expected_latents = run_reference(dev_reference, PROMPTS, latents, output_type="latent", **kw)
    got_latents = run_ours(dev, PROMPTS, latents=latents, output_type="latent", **kw)
    err = rel_err(got_latents, expected_latents)
    log.info("flux dev true CFG fp32, packed latents: max rel error %.2e", err)
    assert err <= 1e-3
    # The negative pass really acted: without it the result is far from this one.
    plain = run_ours(dev, PROMPTS, latents=latents, output_type="latent", guidance_scale=3.5)
    assert max_abs(plain, got_latents) > 100 * max(max_abs(got_latents, expected_latents), 1e-4)


def test_prompt_2_and_negative_prompt_2_match_diffusers(dev, dev_reference):
    """prompt_2 / negative_prompt_2 are T5's texts (CLIP's pooled vector reads prompt / negative_prompt); a None
    entry falls back to that prompt's first text, as diffusers' `prompt_2 or prompt` does for a whole call."""
    latents = packed_latents(2, seed=5)
    kw = dict(negative_prompt=["a dog", "the cat"], true_cfg_scale=2.0, guidance_scale=3.5)
    expected = run_reference(
        dev_reference,
        PROMPTS,
        latents,
        prompt_2=["a blue sky", PROMPTS[1]],
        negative_prompt_2=["a dog", "dark"],
        output_type="latent",
        **kw,
    )
    got = run_ours(
        dev,
        PROMPTS,
        latents=latents,
        prompt_2=["a blue sky", None],
        negative_prompt_2=[None, "dark"],
        output_type="latent",
        **kw,
    )
    err = rel_err(got, expected)
    log.info("flux dev prompt_2, packed latents: max rel error %.2e", err)
    assert err <= 1e-3
    # T5's own texts acted on both rows: without them the latents are far from these (row 1, whose negative
    # alone has a T5 text of its own, moved 6.7e-3 against a 1.7e-6 difference from diffusers).
    plain = run_ours(dev, PROMPTS, latents=latents, output_type="latent", **kw)
    worst = max_abs(got, expected)
    for row in range(2):
        moved = max_abs(plain[row], got[row])
        assert moved > max(1e-3, 100 * worst), (row, moved, worst)


def test_true_cfg_rows_in_a_mixed_batch_equal_their_single_runs(dev):
    """Row 0 runs true CFG; row 1 has no negative, row 2 a scale of 1: both must give their plain result."""
    latents = packed_latents(3, seed=3)
    prompts = ["a cat", "the dog", "a cat and a dog"]
    mixed = run_ours(
        dev,
        prompts,
        latents=latents,
        negative_prompt=["the dog", None, "a cat"],
        true_cfg_scale=[3.0, 3.0, 1.0],
        output_type="latent",
    )
    with_cfg = run_ours(
        dev,
        prompts[:1],
        latents=latents[:1],
        negative_prompt="the dog",
        true_cfg_scale=3.0,
        output_type="latent",
    )
    plain = run_ours(dev, prompts[1:], latents=latents[1:], output_type="latent")
    errs = [max_abs(mixed[:1], with_cfg), max_abs(mixed[1:], plain)]
    log.info("mixed true-CFG batch vs single runs: max abs %.2e (CFG row), %.2e (plain rows)", *errs)
    # Same arithmetic per row; only XLA's batch-size-dependent blocking may move the last bits.
    assert max(errs) <= 1e-5
    assert max_abs(mixed[:1], run_ours(dev, prompts[:1], latents=latents[:1], output_type="latent")) > 1e-2
    # Within one batch composition the selection is exact: a row whose scale is 1 ignores its negative text
    # bit for bit, and equals the same row with no negative at all (s = 1 arithmetic would not).
    other_negative = run_ours(
        dev,
        prompts,
        latents=latents,
        negative_prompt=["the dog", None, "something else"],
        true_cfg_scale=[3.0, 3.0, 1.0],
        output_type="latent",
    )
    no_negative = run_ours(
        dev,
        prompts,
        latents=latents,
        negative_prompt=["the dog", None, None],
        true_cfg_scale=[3.0, 3.0, 1.0],
        output_type="latent",
    )
    np.testing.assert_array_equal(other_negative[2], mixed[2])
    np.testing.assert_array_equal(no_negative[2], mixed[2])
    np.testing.assert_array_equal(no_negative[:2], mixed[:2])


# --------------------------------------------------------------------------------------------------
# Seeds and batching


def test_rows_equal_alone_and_seeds_reproduce(dev):
    """Prompts with their own seeds and guidance in one batch = each alone; the noise is drawn per row in the
    unpacked latent shape, then packed."""
    prompts, seeds, guidance = ["a cat", "the dog", "a dog and a cat"], [11, 7, 2**33 + 5], [3.5, 1.0, 6.0]
    batch = run_ours(dev, prompts, seed=seeds, guidance_scale=guidance, output_type="latent")
    for i in range(3):
        alone = run_ours(dev, prompts[i], seed=seeds[i], guidance_scale=guidance[i], output_type="latent")
        assert max_abs(batch[i : i + 1], alone) <= 1e-5, i
    again = run_ours(dev, prompts, seed=seeds, guidance_scale=guidance, output_type="latent")
    np.testing.assert_array_equal(again, batch)
    assert max_abs(batch[0], batch[1]) > 1e-2
    # The seed's noise is normal(key(seed)) in [h, w, C], packed: the same run from those explicit latents.
    noise = pack_latents(initial_noise(row_keys(key_data(seeds)), (H // 2, W // 2, CHANNELS // 4)))
    explicit = run_ours(
        dev, prompts, latents=np.asarray(noise), guidance_scale=guidance, output_type="latent"
    )
    assert max_abs(explicit, batch) <= 1e-5


def test_a_stochastic_sampling_folder_matches_diffusers_on_the_same_draws(
    tiny_flux_dev_path, tmp_path, monkeypatch
):
    """A folder whose scheduler sets stochastic_sampling: each step's fresh noise comes from the row's seed (its
    own stream), so a row equals itself alone; replayed into diffusers' step (its randn), the same pictures."""
    import jax
    import torch
    from diffusers.schedulers import scheduling_flow_match_euler_discrete as flow_match

    folder = tmp_path / "stochastic"
    shutil.copytree(tiny_flux_dev_path, folder)
    config_file = folder / "scheduler" / "scheduler_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "stochastic_sampling": True}))
    pipe, seeds = load_pipeline(folder, dtype="float32"), [3, 2**40 + 8]
    got = run_ours(pipe, PROMPTS, seed=seeds, guidance_scale=3.5)
    alone = run_ours(pipe, PROMPTS[1], seed=seeds[1], guidance_scale=3.5)
    assert max_abs(got[1:], alone) <= 1e-5
    assert (
        max_abs(got, run_ours(load_pipeline(tiny_flux_dev_path), PROMPTS, seed=seeds, guidance_scale=3.5))
        > 1e-2
    )

    keys = row_keys(key_data(seeds))
    draws = iter(
        np.asarray(jax.vmap(lambda k: jax.random.normal(k, (TOKENS, CHANNELS)))(step_keys(keys, i)))
        for i in range(3)
    )
    monkeypatch.setattr(flow_match, "randn_tensor", lambda shape, **kw: torch.from_numpy(next(draws)))
    latents = np.asarray(pack_latents(initial_noise(keys, (H // 2, W // 2, CHANNELS // 4))))
    expected = run_reference(_reference(folder), PROMPTS, latents, guidance_scale=3.5)
    assert max_abs(got, expected) <= 1e-3 and expected.std() > 1e-2
    assert next(draws, None) is None  # diffusers drew once per step


def test_pack_unpack_are_diffusers_layout():
    import torch
    from diffusers import FluxPipeline as TorchFluxPipeline

    x = np.random.default_rng(0).standard_normal((2, 4, 6, 10)).astype(np.float32)  # [B, C, h, w]
    ref = TorchFluxPipeline._pack_latents(torch.from_numpy(x), 2, 4, 6, 10).numpy()
    ours = np.asarray(pack_latents(np.transpose(x, (0, 2, 3, 1))))
    np.testing.assert_array_equal(ours, ref)
    back = TorchFluxPipeline._unpack_latents(torch.from_numpy(ref), 12, 20, 2).numpy()
    np.testing.assert_array_equal(np.transpose(np.asarray(unpack_latents(ours, 6, 10)), (0, 3, 1, 2)), back)


def test_images_per_prompt_pil_and_callback(dev):
    """num_images_per_prompt repeats each prompt (prompt-major, seed, seed + 1, ...), as a list of prompts with
    one seed per row does; PIL output; the step callback reports and cancels."""
    per_prompt = run_ours(dev, ["a cat"], num_images_per_prompt=2, seed=5, output_type="latent")
    listed = run_ours(dev, ["a cat", "a cat"], seed=[5, 6], output_type="latent")
    # Equal up to the text encoders' batch size (1 prompt repeated vs 2 encoded): last bits only.
    assert max_abs(per_prompt, listed) <= 1e-5
    steps = []
    images = run_ours(dev, ["a cat"], seed=5, output_type="pil", callback=lambda i, n: steps.append((i, n)))
    assert [im.size for im in images] == [(W, H)] and steps == [(1, 3), (2, 3), (3, 3)]
    with pytest.raises(GenerationCancelled, match="stopped after 1 of 3 steps"):
        run_ours(dev, ["a cat"], seed=5, callback=lambda i, n: False)


# --------------------------------------------------------------------------------------------------
# bf16, compilation


def test_bf16_runs_close_to_fp32_diffusers(tiny_flux_dev_path, dev_reference):
    """bf16 end to end (VAE in fp32): its error against fp32 diffusers is measured and logged, beside
    diffusers' own bf16 error; the bound is loose (no parity claim in bf16)."""
    latents = packed_latents(2, seed=4)
    expected = run_reference(dev_reference, PROMPTS, latents, guidance_scale=3.5)
    ours = load_pipeline(tiny_flux_dev_path, dtype="bfloat16")
    got = run_ours(ours, PROMPTS, latents=latents, guidance_scale=3.5)
    theirs = run_reference(_reference(tiny_flux_dev_path, "bfloat16"), PROMPTS, latents, guidance_scale=3.5)
    err, ref_err = max_abs(got, expected), max_abs(theirs, expected)
    log.info("flux dev bf16 vs fp32 diffusers: ours %.2e, diffusers bf16 %.2e (max abs pixel)", err, ref_err)
    assert np.isfinite(got).all() and err < 0.1


def test_custom_sigmas_match_diffusers(dev, dev_reference):
    """FluxPipeline's `sigmas`: shifted for the image size like its own linspace, the step count theirs."""
    latents = packed_latents(1, seed=5)
    sigmas = [1.0, 0.7, 0.45, 0.1]
    expected = run_reference(dev_reference, PROMPTS[:1], latents, guidance_scale=3.5, sigmas=sigmas)
    got = run_ours(
        dev, PROMPTS[:1], latents=latents, guidance_scale=3.5, sigmas=sigmas, num_inference_steps=None
    )
    assert max_abs(got, expected) <= 1e-3
    default = run_ours(dev, PROMPTS[:1], latents=latents, guidance_scale=3.5, num_inference_steps=4)
    assert max_abs(default, expected) > 1e-2  # the caller's sigmas were used
    with pytest.raises(PipelineError, match="sigmas must be"):
        run_ours(dev, PROMPTS[:1], sigmas=[1.5, 0.5], num_inference_steps=None)
    with pytest.raises(PipelineError, match="unsupported argument 'timesteps'"):
        run_ours(dev, PROMPTS[:1], timesteps=[900, 500], num_inference_steps=None)


def test_prompt_seed_guidance_true_cfg_and_steps_never_recompile(dev):
    kw = dict(height=H, width=W, max_sequence_length=TEXT, output_type="np")
    dev(
        ["a cat", "x"], negative_prompt=["dog", None], true_cfg_scale=2.0, seed=1, num_inference_steps=2, **kw
    )
    dev(["a cat", "x"], seed=1, num_inference_steps=2, **kw)
    before = dev.compilations
    out = dev(
        ["the dog", "a cat and a dog"],
        negative_prompt=["cat", "a"],
        true_cfg_scale=[4.0, 1.0],
        guidance_scale=[1.5, 6.0],
        seed=[5, 9],
        num_inference_steps=5,
        **kw,
    )
    out2 = dev(["the cat", "dog"], guidance_scale=2.0, seed=3, num_inference_steps=1, **kw)
    assert dev.compilations == before
    assert not out.compiled and not out2.compiled


def test_warm_up_compiles_both_true_cfg_programs(dev):
    """The serving side warms a bucket up, then serves it with and without true CFG without compiling."""
    dev.warm_up(buckets=[(W, H)], batch_sizes=[1])
    before = dev.compilations
    kw = dict(height=H, width=W, num_inference_steps=2, output_type="np")
    dev("a cat", negative_prompt="a dog", true_cfg_scale=2.5, seed=1, **kw)
    dev("a dog", seed=2, guidance_scale=5.0, **kw)
    assert dev.compilations == before


# --------------------------------------------------------------------------------------------------
# The contract


def test_defaults_limits_and_batch_key(dev, tiny_flux_schnell_path, tmp_path):
    assert isinstance(dev, FluxPipeline) and dev.family == "flux"  # load_pipeline found the family
    assert dev.defaults == {
        # diffusers' FluxPipeline: 128 latents x the VAE factor (2), not the tiny VAE's sample_size (64).
        "width": 256,
        "height": 256,
        "num_inference_steps": 28,
        "guidance_scale": 3.5,
        "true_cfg_scale": 1.0,
    }
    limits = dev.limits
    assert limits["size_multiple"] == 4 and limits["schedulers"] == ["flow_match_euler"]
    assert limits["max_sequence_length"] == 512
    request = {"width": 64, "height": 64, "num_inference_steps": 4, "scheduler": None}
    assert dev.batch_key(request)[-1] == 512
    assert dev.batch_key({**request, "max_sequence_length": 128}) != dev.batch_key(request)

    # Schnell-type, with a meshserve.json naming the size it is served at (the embedded tiny-flux's way).
    folder = tmp_path / "schnell"
    shutil.copytree(tiny_flux_schnell_path, folder)
    (folder / "meshserve.json").write_text(json.dumps({"defaults": {"width": 64, "height": 48}}))
    schnell = FluxPipeline(folder)
    assert schnell.defaults == {
        "width": 64,
        "height": 48,
        "num_inference_steps": 4,
        "guidance_scale": 0.0,
        "true_cfg_scale": 1.0,
    }
    assert schnell.limits["max_sequence_length"] == 512  # diffusers' FluxPipeline's, schnell included


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(height=34), "height must be a positive multiple of 4"),
        (dict(max_sequence_length=513), "max_sequence_length must be an integer between 1 and 512"),
        (dict(scheduler="euler"), "scheduler must be one of"),
        (dict(latents=np.zeros((1, 98, 16), np.float32)), r"latents: expected shape .* \(packed\)"),
        (dict(negative_prompt=["a", "b", "c"]), "negative_prompt: expected 2 entries"),
        (dict(true_cfg_scale=[1.0, 2.0, 3.0]), "true_cfg_scale: expected one value"),
        (dict(guidance_scale=float("nan")), "guidance_scale must be a finite number"),
    ],
)
def test_bad_arguments_are_clear(dev, kw, match):
    args = {"height": H, "width": W, "num_inference_steps": 2, **kw}
    with pytest.raises(PipelineError, match=match):
        dev(PROMPTS if "latents" not in kw else PROMPTS[:1], **args)


def test_embedded_tiny_flux_loads_and_equals_diffusers():
    from meshserve.models.flux.random_tiny import TRANSFORMER, random_flux_path

    path = random_flux_path()
    assert random_flux_path() == path  # built once, then reused
    ours = FluxPipeline(path)
    assert ours.guidance_embeds == TRANSFORMER["guidance_embeds"]
    assert (ours.defaults["width"], ours.defaults["height"]) == (256, 256)  # diffusers': 128 x the factor 2
    reference = _reference(path)
    latents = packed_latents(1, seed=5)
    expected = run_reference(reference, ["a cat"], latents, guidance_scale=3.5)
    got = run_ours(ours, ["a cat"], latents=latents, guidance_scale=3.5)
    err = max_abs(got, expected)
    log.info("embedded tiny-flux vs diffusers on its folder: max abs pixel error %.2e", err)
    assert err <= 1e-3 and expected.std() > 1e-2


# --------------------------------------------------------------------------------------------------
# Full-size configs (shapes only; no weights allocated)

FLUX_SCHNELL = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=False,
    axes_dims_rope=[16, 56, 56],
)
T5_XXL = dict(
    vocab_size=32128,
    d_model=4096,
    d_ff=10240,
    d_kv=64,
    num_heads=64,
    num_layers=24,
    feed_forward_proj="gated-gelu",
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
)
FLUX_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    latent_channels=16,
    sample_size=1024,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)


def _zero_strided(state_dict) -> dict[str, np.ndarray]:
    zero = np.zeros(1, np.float32)
    return {
        k: np.lib.stride_tricks.as_strided(zero, tuple(t.shape), (0,) * t.ndim) for k, t in state_dict.items()
    }


def test_full_size_flux_schnell_t5_xxl_and_vae_keys_and_shapes_map():
    """Every key and shape of FLUX.1-schnell's transformer (dev's is in test_transformer_flux.py), T5 v1.1 XXL
    and the FLUX.1 VAE (diffusers / transformers on the meta device) loads into ours, built abstractly;
    nothing missing, nothing left over (load_weights raises CheckpointMismatchError otherwise)."""
    import torch
    from diffusers import AutoencoderKL as TorchAutoencoderKL
    from diffusers import FluxTransformer2DModel as TorchFlux
    from transformers import T5Config as TorchT5Config
    from transformers import T5EncoderModel as TorchT5

    from meshserve.models.checkpoints.loading import abstract_module, load_weights
    from meshserve.models.components.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig
    from meshserve.models.components.t5 import T5Config, T5EncoderModel, _rename
    from meshserve.models.flux.transformer_flux import (
        FluxTransformer2DConfig,
        FluxTransformer2DModel,
        split_single_proj_out,
    )

    keep = lambda path, array: array  # noqa: E731 (no device copies of the zero-strided stand-ins)
    with torch.device("meta"):
        flux = TorchFlux(**FLUX_SCHNELL)
        t5 = TorchT5(TorchT5Config(**T5_XXL))
        vae = TorchAutoencoderKL(**FLUX_VAE)

    config = FluxTransformer2DConfig.from_config(dict(flux.config))
    assert not config.guidance_embeds
    model = abstract_module(FluxTransformer2DModel, config)
    load_weights(model, split_single_proj_out(_zero_strided(flux.state_dict()), config.inner_dim), place=keep)

    t5_state = _zero_strided(t5.state_dict())
    t5_state.pop("encoder.embed_tokens.weight", None)  # tied to `shared` (load_t5_encoder does the same)
    t5_config = T5Config.from_config({**t5.config.to_dict(), "model_type": "t5"})
    model = abstract_module(T5EncoderModel, t5_config)
    load_weights(model, t5_state, rename=_rename, place=keep)

    model = abstract_module(AutoencoderKL, AutoencoderKLConfig.from_config(FLUX_VAE))
    load_weights(model, _zero_strided(vae.state_dict()), place=keep)
    assert sum(int(np.prod(t.shape)) for t in vae.state_dict().values()) == 83_819_683  # FLUX.1's VAE


def test_prompt_embeds_match_diffusers(dev, dev_reference):
    """diffusers' prompt_embeds / pooled_prompt_embeds (from its own encode_prompt; the negatives' for true
    CFG) instead of texts: diffusers' pictures given the same; their text length is the call's when it names
    none; negatives as text beside given prompts."""
    import torch

    negatives = ["blurry", "ugly"]
    with torch.no_grad():
        pe, ppe, _ = dev_reference.encode_prompt(PROMPTS, None, device="cpu", max_sequence_length=TEXT)
        npe, nppe, _ = dev_reference.encode_prompt(negatives, None, device="cpu", max_sequence_length=TEXT)
    latents = packed_latents(2, seed=9)
    kw = dict(height=H, width=W, num_inference_steps=3, true_cfg_scale=2.0, output_type="np")
    embeds = dict(prompt_embeds=pe, pooled_prompt_embeds=ppe)
    negative = dict(negative_prompt_embeds=npe, negative_pooled_prompt_embeds=nppe)
    expected = dev_reference(**embeds, **negative, latents=torch.from_numpy(latents), **kw).images
    mine = {k: v.numpy() for k, v in {**embeds, **negative}.items()}
    got = dev(latents=latents, **mine, **kw).images  # no max_sequence_length: the embeddings' 24
    assert max_abs(got, expected) <= 1e-3 and expected.std() > 1e-2
    texts = dev(PROMPTS, negative_prompt=negatives, latents=latents, max_sequence_length=TEXT, **kw).images
    assert max_abs(got, texts) <= 1e-4
    half = {k: mine[k] for k in embeds}
    expected = dev_reference(
        **embeds, negative_prompt=negatives, latents=torch.from_numpy(latents), max_sequence_length=TEXT, **kw
    ).images
    got = dev(latents=latents, **half, negative_prompt=negatives, **kw).images
    assert max_abs(got, expected) <= 1e-3
    with pytest.raises(PipelineError, match="expected shape"):
        dev(**half, max_sequence_length=TEXT + 8, height=H, width=W, num_inference_steps=1)

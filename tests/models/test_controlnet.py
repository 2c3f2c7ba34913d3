"""ControlNetModel: ours (JAX, NHWC) against diffusers' on the same weights (a tiny SDXL ControlNet whose zero
convolutions were given random weights: tests/fixtures/tiny_controlnet.py), and the UNet taking its residuals."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from meshserve.models.sdxl.controlnet import load_controlnet
from meshserve.models.sdxl.unet_2d_condition import load_unet
from tests.models.test_unet_2d_condition import nchw, rel_err, sdxl_inputs

log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def controlnet_folder(tiny_sdxl_path, tmp_path_factory):
    from tests.fixtures.tiny_controlnet import build_tiny_controlnet

    folder = tmp_path_factory.mktemp("controlnet")
    build_tiny_controlnet(tiny_sdxl_path).save_pretrained(str(folder))
    return folder


def _control(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 1, (2, 3, 64, 64)).astype(np.float32)


def test_controlnet_residuals_and_the_unet_taking_them_match_diffusers(controlnet_folder, tiny_sdxl_path):
    from diffusers import ControlNetModel, UNet2DConditionModel

    ref = ControlNetModel.from_pretrained(str(controlnet_folder)).eval()
    ref_unet = UNet2DConditionModel.from_pretrained(str(tiny_sdxl_path / "unet")).eval()
    ours, unet = load_controlnet(controlnet_folder), load_unet(tiny_sdxl_path / "unet")
    sample, context, text_embeds, time_ids = sdxl_inputs()
    control = _control(1)
    added = dict(text_embeds=torch.from_numpy(text_embeds), time_ids=torch.from_numpy(time_ids))
    with torch.no_grad():
        down, mid = ref(
            torch.from_numpy(sample),
            torch.tensor([500.0, 20.0]),
            torch.from_numpy(context),
            torch.from_numpy(control),
            conditioning_scale=0.7,
            added_cond_kwargs=added,
            return_dict=False,
        )
        expected = ref_unet(
            torch.from_numpy(sample),
            torch.tensor([500.0, 20.0]),
            torch.from_numpy(context),
            added_cond_kwargs=added,
            down_block_additional_residuals=down,
            mid_block_additional_residual=mid,
        ).sample.numpy()
    x = jnp.asarray(sample.transpose(0, 2, 3, 1))
    args = (x, jnp.asarray([500.0, 20.0]), jnp.asarray(context))
    got_down, got_mid = ours(
        *args,
        jnp.asarray(control.transpose(0, 2, 3, 1)),
        0.7,
        jnp.asarray(text_embeds),
        jnp.asarray(time_ids),
    )
    assert len(got_down) == len(down) == 6  # conv_in; level 0: 2 resnets, the downsampler; level 1: 2 resnets
    errs = [rel_err(nchw(g), e.numpy()) for g, e in zip(got_down, down, strict=True)]
    errs.append(rel_err(nchw(got_mid), mid.numpy()))
    log.info("ControlNet residuals: max rel err %.2e", max(errs))
    assert max(errs) <= 1e-4
    out = unet(*args, jnp.asarray(text_embeds), jnp.asarray(time_ids), None, got_down, got_mid)
    err = rel_err(nchw(out), expected)
    plain = unet(*args, jnp.asarray(text_embeds), jnp.asarray(time_ids))
    moved = rel_err(nchw(plain), expected)
    log.info("UNet with the ControlNet's residuals: rel err %.2e (without them: %.2e)", err, moved)
    assert err <= 1e-4 and moved > 1e-2


@pytest.mark.parametrize("pool", [False, True], ids=["guess_mode", "global_pool_conditions"])
def test_guess_mode_per_row_matches_diffusers(controlnet_folder, tmp_path, pool):
    """Guess mode's ramp (row 0 on, row 1 off, in one call; diffusers: one call each), and a config with
    global_pool_conditions (every residual averaged over height and width, no ramp)."""
    from diffusers import ControlNetModel

    ref = ControlNetModel.from_pretrained(str(controlnet_folder)).eval()
    folder = controlnet_folder
    if pool:
        ref.register_to_config(global_pool_conditions=True)
        ref.save_pretrained(str(tmp_path))
        folder = tmp_path
    ours = load_controlnet(folder)
    sample, context, text_embeds, time_ids = sdxl_inputs()
    control, t = _control(2), torch.tensor([500.0, 20.0])
    added = dict(text_embeds=torch.from_numpy(text_embeds), time_ids=torch.from_numpy(time_ids))
    expected = []
    with torch.no_grad():
        for guess in (True, False):
            expected.append(
                ref(
                    torch.from_numpy(sample),
                    t,
                    torch.from_numpy(context),
                    torch.from_numpy(control),
                    conditioning_scale=0.7,
                    guess_mode=guess,
                    added_cond_kwargs=added,
                    return_dict=False,
                )
            )
    down, mid = ours(
        jnp.asarray(sample.transpose(0, 2, 3, 1)),
        jnp.asarray(t.numpy()),
        jnp.asarray(context),
        jnp.asarray(control.transpose(0, 2, 3, 1)),
        0.7,
        jnp.asarray(text_embeds),
        jnp.asarray(time_ids),
        guess_mode=jnp.asarray([True, False]),
    )
    errs = []
    for row, (ref_down, ref_mid) in enumerate(expected):
        for g, e in zip([*down, mid], [*ref_down, ref_mid], strict=True):
            assert g.shape[1:3] == ((1, 1) if pool else e.shape[2:])
            errs.append(rel_err(nchw(g)[row], e.numpy()[row]))
    log.info("ControlNet %s per row: max rel err %.2e", "pooled" if pool else "guess mode", max(errs))
    assert max(errs) <= 1e-4

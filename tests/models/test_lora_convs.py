"""Conv LoRA (LoCon: what LCM-LoRA and many kohya files adapt) against diffusers' `load_lora_weights` on the tiny
SDXL: a pool with `lora_convs` holds the UNet's 2-D convolutions too (3x3 resnet convs, 1x1 shortcuts, the
stride-2 downsamplers, the upsamplers, conv_in / conv_out). PEFT and kohya files, rows with different adapters,
no compilation when they change; a pool without `lora_convs` refuses such a file, naming the layer and why.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshserve.models import load_pipeline
from meshserve.models.lora.formats import AdapterFormatError
from tests.fixtures.tiny_lora import (
    random_conv_factors,
    random_factors,
    write_diffusers_lora,
    write_kohya_lora,
)
from tests.fixtures.tiny_sdxl import diffusers_sdxl
from tests.models.test_lora import PROMPT, _run_sdxl, _sdxl_latents, loras, max_abs, reference_with

CONVS = r"(resnets\.\d+\.(conv1|conv2|conv_shortcut)|(down|up)samplers\.0\.conv|conv_in|conv_out)$"
LINEARS = r"attn1\.to_q$"
TARGETS = f"({CONVS}|{LINEARS})"


@pytest.fixture(scope="module")
def convs(tiny_sdxl_path, tmp_path_factory):
    """(ours with lora_convs, diffusers' pipeline, files): "c" (PEFT, rank 4: convs and attn1.to_q), "d" (PEFT,
    rank 2, convs), "k" (kohya, rank 4, convs, alpha 2)."""
    ref = diffusers_sdxl(tiny_sdxl_path)
    folder = tmp_path_factory.mktemp("conv_loras")
    fc = {**random_conv_factors(ref.unet, CONVS, 4, 1), **random_factors(ref.unet, LINEARS, 4, 2)}
    files = {
        "c": write_diffusers_lora(folder / "c.safetensors", fc, prefix="unet"),
        "d": write_diffusers_lora(
            folder / "d.safetensors", random_conv_factors(ref.unet, CONVS, 2, 3), prefix="unet"
        ),
        "k": write_kohya_lora(
            folder / "k.safetensors", random_conv_factors(ref.unet, CONVS, 4, 4), alpha=2.0
        ),
    }
    for name, path in files.items():
        ref.load_lora_weights(str(path), adapter_name=name)
    ours = load_pipeline(
        tiny_sdxl_path,
        dtype="float32",
        max_loras=2,
        max_lora_rank=4,
        lora_budget_mb=8,
        lora_targets=TARGETS,
        lora_convs=True,
    )
    for name, path in files.items():
        info = ours.load_lora(name, path)
        assert any(t.endswith("conv1") for t in info["targets"]), info["targets"]
    return ours, ref, files


@pytest.mark.parametrize(
    "names,scales",
    [(("c",), (0.8,)), (("c", "d"), (0.5, -1.0)), (("k",), (1.0,))],
    ids=["peft", "two", "kohya"],
)
def test_conv_lora_matches_diffusers(convs, names, scales):
    import torch

    ours, ref, _ = convs
    latents = _sdxl_latents(seed=7)
    reference_with(ref, names, scales)
    expected = _run_sdxl(ref, PROMPT, torch.from_numpy(latents))
    got = _run_sdxl(ours, PROMPT, latents, loras=loras(names, scales))
    err = max_abs(got, expected)
    print(f"conv LoRA {names}: max abs pixel difference from diffusers {err:.2e}")
    assert err <= 1e-3, f"max abs pixel difference {err:.2e}"
    assert max_abs(got, _run_sdxl(ours, PROMPT, latents)) > 2e-2  # the convs' adapters really act


def test_conv_lora_rows_carry_their_own_adapters_and_compile_nothing(convs):
    ours, _, _ = convs
    latents = _sdxl_latents(3, seed=8)
    rows = [loras(["c"], [0.6]), loras(["d", "k"], [1.2, -0.4]), []]
    batch = _run_sdxl(ours, [PROMPT] * 3, latents, loras=rows)
    for i, row in enumerate(rows):
        alone = _run_sdxl(ours, PROMPT, latents[i : i + 1], loras=row or None)
        assert max_abs(batch[i], alone[0]) <= 1e-5, f"row {i}"
    assert max_abs(batch[0], batch[1]) > 2e-2
    # Other adapters, mixes and scales in the same shapes: the programs above serve them.
    before = ours.compilations
    _run_sdxl(ours, [PROMPT] * 3, latents, loras=[loras(["k", "c"], [0.3, 0.9]), [], loras(["d"], [2.0])])
    _run_sdxl(ours, PROMPT, latents[:1], loras=loras(["k"], [-1.5]))
    assert ours.compilations == before


def test_a_pool_without_lora_convs_refuses_a_conv_file(tiny_sdxl_path, convs, tmp_path):
    _, _, files = convs
    pool = load_pipeline(tiny_sdxl_path, dtype="float32", max_lora_rank=4, lora_targets=TARGETS)
    for name in ("c", "k"):
        with pytest.raises(AdapterFormatError, match=r"is a convolution: .* only with lora_convs"):
            pool.load_lora(name, files[name])
    assert pool.loras == []


def test_conv_factors_of_the_wrong_shape_name_the_layer(convs, tmp_path):
    from safetensors.numpy import save_file

    ours, _, _ = convs
    name = "down_blocks.0.resnets.0.conv1"
    good = np.zeros((2, 32, 3, 3), np.float32), np.zeros((32, 2, 1, 1), np.float32)
    bad = {
        "1x1 down on a 3x3 conv": (np.zeros((2, 32, 1, 1), np.float32), good[1]),
        "2-D factors on a 3x3 conv": (np.zeros((2, 32), np.float32), np.zeros((32, 2), np.float32)),
        "a 3x3 up": (good[0], np.zeros((32, 2, 3, 3), np.float32)),
        "rank 0": (np.zeros((0, 32, 3, 3), np.float32), np.zeros((32, 0, 1, 1), np.float32)),
        "1-D factors": (np.zeros((2,), np.float32), np.zeros((32,), np.float32)),
        "a NaN": (np.full((2, 32, 3, 3), np.nan, np.float32), good[1]),
    }
    for why, (down, up) in bad.items():
        path = tmp_path / "bad.safetensors"
        save_file({f"unet.{name}.lora_A.weight": down, f"unet.{name}.lora_B.weight": up}, str(path))
        with pytest.raises(AdapterFormatError, match=name.replace(".", r"\.")):
            ours.load_lora("bad", path)
        assert "bad" not in ours.loras, why


def test_lcm_lora_recipe_matches_diffusers(convs, monkeypatch):
    """LCM-LoRA's recipe, diffusers' docs: the adapter (convs and linears), LCMScheduler.from_config(the
    model's scheduler config), 4 steps, guidance 1. Same per-step noise on both sides (tests/models/test_lcm.py)."""
    import torch
    from diffusers import LCMScheduler

    from tests.models.test_lcm import SEEDS, patch_lcm_noise
    from tests.models.test_lora import H, W

    ours, ref, _ = convs
    original = ref.scheduler
    ref.scheduler = LCMScheduler.from_config(original.config)
    try:
        drawn, _ = patch_lcm_noise(monkeypatch, SEEDS)
        latents = _sdxl_latents(2, seed=9)
        reference_with(ref, ["c"], [1.0])
        kw = dict(num_inference_steps=4, guidance_scale=1.0, height=H, width=W, output_type="np")
        expected = ref([PROMPT] * 2, latents=torch.from_numpy(latents), **kw).images
        got = ours(
            [PROMPT] * 2, latents=latents, seed=SEEDS, scheduler="lcm", loras=loras(["c"], [1.0]), **kw
        ).images
    finally:
        ref.scheduler = original
    assert drawn == [0, 1, 2]
    err = max_abs(got, expected)
    print(f"LCM-LoRA recipe: max abs pixel difference from diffusers {err:.2e}")
    assert err <= 1e-3, f"max abs pixel difference {err:.2e}"

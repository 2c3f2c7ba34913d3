"""SGM-named kohya SDXL LoRA keys -> diffusers' names (models/lora/sgm_names.py) against diffusers' own
conversion (`_maybe_map_sgm_blocks_to_diffusers` then `_convert_non_diffusers_lora_to_diffusers`), for the
tiny test UNet and the real SDXL layout; the names are checked to be modules of diffusers' UNet built from
the same config (on the meta device: no weights), and, for the tiny UNet, to reach every LoRA-able layer of
ours (built with nnx.eval_shape). Key names only: nothing is compiled."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from meshserve.models.lora.formats import AdapterFormatError
from meshserve.models.lora.sgm_names import is_sgm, sgm_to_diffusers

# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json, the values that shape the module tree.
SDXL_UNET = dict(
    block_out_channels=[320, 640, 1280],
    layers_per_block=2,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    attention_head_dim=[5, 10, 20],
    transformer_layers_per_block=[1, 2, 10],
    use_linear_projection=True,
    cross_attention_dim=2048,
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
    sample_size=128,
)
_ATTN = [f"{a}_{m}" for a in ("attn1", "attn2") for m in ("to_q", "to_k", "to_v", "to_out_0")] + [
    "ff_net_0_proj",
    "ff_net_2",
]


def _sgm_modules(cfg: dict) -> list[str]:
    """The SGM UNet's LoRA-able modules (kohya's stems without lora_unet_), as sgm's UNetModel builds them:
    every resnet, attention (its first and last transformer block), sampler, and the modules outside."""
    down, up = cfg["down_block_types"], cfg["up_block_types"]
    ch, n, layers = cfg["block_out_channels"], len(cfg["down_block_types"]), cfg["layers_per_block"]
    depth = cfg["transformer_layers_per_block"]

    def resnet(p, skip):
        return [f"{p}_in_layers_2", f"{p}_emb_layers_1", f"{p}_out_layers_3"] + [
            f"{p}_skip_connection"
        ] * skip

    def attention(p, d):
        blocks = [f"{p}_transformer_blocks_{t}_{m}" for t in sorted({0, d - 1}) for m in _ATTN]
        return [f"{p}_proj_in", f"{p}_proj_out", *blocks]

    names = ["time_embed_0", "time_embed_2", "label_emb_0_0", "label_emb_0_2", "input_blocks_0_0", "out_2"]
    i, c = 1, ch[0]
    for b in range(n):
        for _ in range(layers):
            names += resnet(f"input_blocks_{i}_0", c != ch[b])
            c = ch[b]
            if "CrossAttn" in down[b]:
                names += attention(f"input_blocks_{i}_1", depth[b])
            i += 1
        if b < n - 1:
            names.append(f"input_blocks_{i}_0_op")
            i += 1
    names += resnet("middle_block_0", False) + attention("middle_block_1", depth[-1])
    names += resnet("middle_block_2", False)
    i = 0
    for b in range(n):
        for layer in range(layers + 1):
            names += resnet(f"output_blocks_{i}_0", True)  # a skip input: channels always change
            j = 1
            if "CrossAttn" in up[b]:
                names += attention(f"output_blocks_{i}_1", depth[n - 1 - b])
                j = 2
            if layer == layers and b < n - 1:
                names.append(f"output_blocks_{i}_{j}_conv")
            i += 1
    return names


def _kohya(modules) -> dict:
    out = {}
    for m in modules:
        out[f"lora_unet_{m}.lora_down.weight"] = np.zeros((1, 1), np.float32)
        out[f"lora_unet_{m}.lora_up.weight"] = np.zeros((1, 1), np.float32)
        out[f"lora_unet_{m}.alpha"] = np.float32(1)
    return out


def _diffusers_modules(tensors: dict, cfg: dict) -> set[str]:
    """diffusers' module names for a kohya file, as load_lora_weights converts it (lora_pipeline.py)."""
    import torch
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_lora_to_diffusers,
        _maybe_map_sgm_blocks_to_diffusers,
    )
    from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft

    sd = {k: torch.from_numpy(np.asarray(v)) for k, v in tensors.items()}
    sd = _maybe_map_sgm_blocks_to_diffusers(sd, SimpleNamespace(layers_per_block=cfg["layers_per_block"]))
    sd, _ = _convert_non_diffusers_lora_to_diffusers(sd)
    sd = convert_unet_state_dict_to_peft({k.removeprefix("unet."): v for k, v in sd.items()})
    return {k.removesuffix(".lora_A.weight") for k in sd if k.endswith(".lora_A.weight")}


def _unet_modules(cfg: dict) -> set[str]:
    import torch
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**cfg)
    return {name for name, _ in unet.named_modules()}


def _check_layout(cfg: dict):
    tensors = _kohya(_sgm_modules(cfg))
    assert is_sgm(tensors)
    ours = sgm_to_diffusers(
        tensors,
        down_block_types=cfg["down_block_types"],
        up_block_types=cfg["up_block_types"],
        layers_per_block=cfg["layers_per_block"],
    )
    theirs = _diffusers_modules(tensors, cfg)
    assert len(ours) == len(tensors) and len(theirs) * 3 == len(tensors)
    # formats.py matches a kohya stem against "lora_unet_" + the model's module name with "_" for ".".
    assert {k.split(".")[0] for k in ours} == {"lora_unet_" + m.replace(".", "_") for m in theirs}
    assert theirs <= _unet_modules(cfg), sorted(theirs - _unet_modules(cfg))[:5]
    assert not is_sgm(ours)
    # the tensors travel with their keys
    key = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight"
    renamed = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight"
    assert ours[renamed] is tensors[key]


def test_tiny_sdxl_layout_matches_diffusers(tiny_sdxl_path):
    from flax import nnx

    from meshserve.models.lora.pool import adaptable_layers
    from meshserve.models.sdxl.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel

    config = json.loads((tiny_sdxl_path / "unet" / "config.json").read_text())
    cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    _check_layout(cfg)
    # Every LoRA-able layer of our UNet (its Linears: the pool's targets) is reached from an SGM name; the
    # names left over are its convs (conv LoRA is refused by formats.py).
    ours = UNet2DConditionConfig.from_config(config)
    unet = nnx.eval_shape(lambda: UNet2DConditionModel(ours, rngs=nnx.Rngs(0)))  # shapes only
    _, targets = adaptable_layers(unet)
    renamed = sgm_to_diffusers(
        _kohya(_sgm_modules(cfg)),
        down_block_types=ours.down_block_types,
        up_block_types=ours.up_block_types,
        layers_per_block=ours.layers_per_block,
    )
    stems = {k.split(".")[0] for k in renamed}
    kohya_targets = {"lora_unet_" + name.replace(".", "_") for name in targets}
    assert kohya_targets <= stems, sorted(kohya_targets - stems)[:5]
    assert all(
        s.endswith(("conv1", "conv2", "conv_shortcut", "conv", "conv_in", "conv_out"))
        for s in stems - kohya_targets
    )


def test_sdxl_layout_matches_diffusers_and_refuses_bad_keys():
    _check_layout(SDXL_UNET)
    layout = dict(
        down_block_types=SDXL_UNET["down_block_types"],
        up_block_types=SDXL_UNET["up_block_types"],
        layers_per_block=2,
    )
    text = {"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": np.zeros((1, 1))}
    assert sgm_to_diffusers(dict(text), **layout) == text  # text encoders' keys untouched
    assert not is_sgm(text)
    bad = [
        "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q",  # DownBlock2D: no attention
        "lora_unet_input_blocks_9_0_in_layers_2",  # SDXL has input blocks 0-8
        "lora_unet_input_blocks_3_0_in_layers_2",  # block 3 is a downsampler
        "lora_unet_middle_block_3_in_layers_2",
        "lora_unet_output_blocks_8_1_conv",  # the last up block has no upsampler
        "lora_unet_output_blocks_4_0_in_layers_1",  # SiLU
        "lora_unet_label_emb_0_1",
    ]
    for stem in bad:
        with pytest.raises(AdapterFormatError, match=stem):
            sgm_to_diffusers({stem + ".lora_down.weight": np.zeros((1, 1))}, **layout)
    # the same module twice, in SGM and in diffusers' names
    twice = {
        "lora_unet_middle_block_1_proj_in.alpha": np.float32(1),
        "lora_unet_mid_block_attentions_0_proj_in.alpha": np.float32(1),
    }
    with pytest.raises(AdapterFormatError, match="middle_block_1_proj_in"):
        sgm_to_diffusers(twice, **layout)

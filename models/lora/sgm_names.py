"""kohya SDXL LoRA keys in the original SGM UNet's names -> the same keys in diffusers' names.

    tensors = sgm_to_diffusers(tensors, down_block_types=..., up_block_types=..., layers_per_block=2)
    # lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight
    #   -> lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight

kohya's sd-scripts trains SDXL on its own copy of the SGM (Stability's generative-models) UNet, so most SDXL
LoRAs published for A1111 / ComfyUI name its modules: `input_blocks.<i>.<j>`, `middle_block.<j>`,
`output_blocks.<i>.<j>`, `time_embed`, `label_emb`, `out`. The output is the kohya form of diffusers' module
names (`lora_unet_` + the module with "_" for "."), the layout formats.py already reads.

Specification: diffusers' `_maybe_map_sgm_blocks_to_diffusers` (block numbers) followed by
`_convert_unet_lora_key` (names inside a block and outside the blocks), loaders/lora_conversion_utils.py in
diffusers 0.42. Written from the SGM UNet's construction rather than from diffusers' arithmetic: a table of
what each SGM index holds is built from the layout, so a key the layout has no module for is refused here
(diffusers renames it to a module that does not exist and fails later, or loads nothing), and an up block
without attention whose upsampler SGM numbers 1 maps to `upsamplers` (diffusers' arithmetic says
`attentions`, a difference no SDXL layout reaches). Where both apply (every SDXL layout) the names are the
same; tests/models/test_lora_sgm_names.py checks it against diffusers for the tiny and the real SDXL UNet.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from meshserve.models.lora.formats import AdapterFormatError

_PREFIX = "lora_unet_"
_BLOCKS = ("input_blocks_", "middle_block_", "output_blocks_")
# Modules outside the down/mid/up blocks, SGM -> diffusers (as _convert_unet_lora_key renames them).
_OUTSIDE = {
    "time_embed_0": "time_embedding_linear_1",
    "time_embed_2": "time_embedding_linear_2",
    "label_emb_0_0": "add_embedding_linear_1",
    "label_emb_0_2": "add_embedding_linear_2",
    "out_0": "conv_norm_out",  # a GroupNorm: diffusers leaves it unmapped; named right, formats.py refuses it
    "out_2": "conv_out",
}
# An SGM ResBlock's layers -> diffusers' ResnetBlock2D (in_layers = [norm, SiLU, conv], out_layers = [norm,
# SiLU, dropout, conv], emb_layers = [SiLU, linear]).
_RESNET = {
    "in_layers_0": "norm1",
    "in_layers_2": "conv1",
    "emb_layers_1": "time_emb_proj",
    "out_layers_0": "norm2",
    "out_layers_3": "conv2",
    "skip_connection": "conv_shortcut",
}
# The sampler's conv, SGM -> diffusers (Downsample's conv is `op`, Upsample's `conv`).
_SAMPLER_CONV = {"downsamplers": "op", "upsamplers": "conv"}
_HEADS = tuple(_PREFIX + h for h in (*_BLOCKS, "time_embed_", "label_emb_", "out_"))
_KEY = re.compile(r"(input_blocks|output_blocks)_(\d+)_(\d+)(?:_(.+))?$|(middle_block)_(\d+)(?:_(.+))?$")


def is_sgm(keys: Iterable[str]) -> bool:
    """Whether any kohya UNet key names an SGM module (diffusers' test, plus the modules outside the blocks)."""
    return any(k.startswith(_HEADS) for k in keys)


def _per_block(layers_per_block: int | Sequence[int], n: int) -> list[int]:
    layers = [layers_per_block] * n if isinstance(layers_per_block, int) else list(layers_per_block)
    if len(layers) != n:
        raise ValueError(f"layers_per_block {layers_per_block!r}: one count per block ({n}) expected")
    return layers


def sgm_layout(
    down_block_types: Sequence[str], up_block_types: Sequence[str], layers_per_block: int | Sequence[int]
) -> dict[tuple[str, int], list[str]]:
    """{(SGM part, index): what its sub-modules 0, 1, 2 are in diffusers}, e.g. ("input_blocks", 4) ->
    ["down_blocks_1_resnets_0", "down_blocks_1_attentions_0"], in the order SGM's UNetModel builds them.

    The arguments are the diffusers UNet2DConditionModel config's (unet/config.json) `down_block_types`,
    `up_block_types` (a type with "CrossAttn" in its name has attentions) and `layers_per_block` (an int, or
    one count per down block; an up block has one layer more than its down block). The last down block has
    no downsampler, the last up block no upsampler; the mid block is UNetMidBlock2DCrossAttn, as in SDXL."""
    n = len(down_block_types)
    if len(up_block_types) != n:
        raise ValueError(f"{n} down blocks but {len(up_block_types)} up blocks")
    layers = _per_block(layers_per_block, n)
    table: dict[tuple[str, int], list[str]] = {("input_blocks", 0): ["conv_in"]}
    i = 1
    for b, kind in enumerate(down_block_types):
        for layer in range(layers[b]):
            subs = [f"down_blocks_{b}_resnets_{layer}"]
            if "CrossAttn" in kind:
                subs.append(f"down_blocks_{b}_attentions_{layer}")
            table["input_blocks", i], i = subs, i + 1
        if b < n - 1:
            table["input_blocks", i], i = [f"down_blocks_{b}_downsamplers_0"], i + 1
    # SGM's middle block is one sequence [ResBlock, SpatialTransformer, ResBlock]: its index is the sub-module.
    table["middle_block", 0] = ["mid_block_resnets_0", "mid_block_attentions_0", "mid_block_resnets_1"]
    i = 0
    for b, kind in enumerate(up_block_types):
        count = layers[n - 1 - b] + 1
        for layer in range(count):
            subs = [f"up_blocks_{b}_resnets_{layer}"]
            if "CrossAttn" in kind:
                subs.append(f"up_blocks_{b}_attentions_{layer}")
            if layer == count - 1 and b < n - 1:
                subs.append(f"up_blocks_{b}_upsamplers_0")
            table["output_blocks", i], i = subs, i + 1
    return table


def _rename(stem: str, table: dict) -> str | None:
    """An SGM module name (no `lora_unet_`) -> diffusers' module name with "_" for ".", None if it does not fit."""
    if stem in _OUTSIDE:
        return _OUTSIDE[stem]
    m = _KEY.match(stem)
    if m is None:
        return None
    if m[5]:  # middle_block_<j>_<rest>: one index
        part, index, sub, rest = "middle_block", 0, int(m[6]), m[7]
    else:
        part, index, sub, rest = m[1], int(m[2]), int(m[3]), m[4]
    subs = table.get((part, index), [])
    if sub >= len(subs):
        return None
    module = subs[sub]
    if module == "conv_in":
        return module if rest is None else None
    if "_resnets_" in module:
        inner = _RESNET.get(rest or "")
        return None if inner is None else f"{module}_{inner}"
    kind = module.rsplit("_", 2)[-2]
    if kind in _SAMPLER_CONV:
        return f"{module}_conv" if rest == _SAMPLER_CONV[kind] else None
    # A SpatialTransformer's modules have diffusers' Transformer2DModel names (proj_in, transformer_blocks_0_
    # attn1_to_q, ff_net_0_proj...): kept as they are; formats.py refuses one the model lacks.
    return f"{module}_{rest}" if rest else None


def sgm_to_diffusers(
    tensors: dict,
    *,
    down_block_types: Sequence[str],
    up_block_types: Sequence[str],
    layers_per_block: int | Sequence[int],
) -> dict:
    """{key: tensor} with every SGM-named `lora_unet_` key renamed to diffusers' kohya name (the part after
    the first "." kept: `.lora_down.weight`, `.lora_up.weight`, `.alpha`...), other keys (diffusers-named UNet
    keys, text encoders') untouched. The layout arguments: see `sgm_layout`. AdapterFormatError naming the
    first SGM key the layout has no module for, or one whose new name another key of the file already has
    (diffusers drops a mixed file's SGM keys silently; this refuses it)."""
    table = sgm_layout(down_block_types, up_block_types, layers_per_block)
    out, renamed = {}, {}
    for key, value in tensors.items():
        if not key.startswith(_HEADS):
            out[key] = value
            continue
        stem, dot, tail = key.partition(".")
        name = _rename(stem[len(_PREFIX) :], table)
        if name is None:
            raise AdapterFormatError(
                f"SGM-named LoRA key {key!r} names no module of this UNet ({len(down_block_types)} down blocks "
                f"{list(down_block_types)}, layers_per_block {layers_per_block})"
            )
        new = _PREFIX + name + dot + tail
        renamed[new] = key
        out[new] = value
    clash = next((k for k in renamed if k in tensors), None)
    if clash is not None:
        raise AdapterFormatError(f"LoRA keys {renamed[clash]!r} and {clash!r} name the same UNet module")
    return out

"""LoRA files' alphas and bad files, at the factor level (models/lora/formats.py `read_adapter`, as the pool's
`load` calls it), against PEFT's per-layer `scaling * B @ A` after diffusers' `load_lora_weights` (torch fp32,
CPU) on the tiny SDXL folder: `alpha_pattern` keys as PEFT's regexes (diffusers' own '^module' keys, a regex,
the first matching key), `use_rslora`, a text encoder's patterns; kohya Flux fused q/k/v and linear1 up
weights of the wrong row count; bad files and metadata refused with AdapterFormatError naming the key or field.
No pipeline runs: each test takes a second or two once the module's diffusers pipeline is loaded.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from meshserve.models.lora.formats import AdapterFormatError, read_adapter
from tests.fixtures.tiny_lora import (
    CLIP_TARGETS,
    flux_kohya_factors,
    peft_layers,
    random_factors,
    write_diffusers_lora,
    write_kohya_stems,
)

SDXL_ENCODERS = ("text_encoder", "text_encoder_2")
ATTN = r"attn[12]\.to_[qkv]$"
MODULE = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"


def torch_targets(components: dict) -> dict:
    """{module: {"in", "out"}} for every nn.Linear of the torch components ({prefix: module}; "" for the
    denoiser): the shapes the pool passes read_adapter (its own layers have diffusers' names and shapes)."""
    import torch

    out = {}
    for prefix, model in components.items():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                out[prefix + name] = {"in": module.in_features, "out": module.out_features}
    return out


@pytest.fixture(scope="module")
def sdxl_ref(tiny_sdxl_path):
    """(diffusers' SDXL pipeline, the targets of its UNet and both CLIPs in the pool's names)."""
    import torch
    from diffusers import StableDiffusionXLPipeline

    ref = StableDiffusionXLPipeline.from_pretrained(str(tiny_sdxl_path), torch_dtype=torch.float32)
    targets = torch_targets(
        {"": ref.unet, "text_encoder.": ref.text_encoder, "text_encoder_2.": ref.text_encoder_2}
    )
    return ref, targets


def ours(path, targets, family="sdxl", encoders=SDXL_ENCODERS) -> dict:
    """{module: delta [out, in]} as our pool would add it (alpha / rank folded into B)."""
    factors = read_adapter(path, family=family, targets=targets, text_encoders=encoders)
    return {name: (a @ b).T for name, (a, b) in factors.items()}


def peft_deltas(ref, adapter) -> tuple[dict, dict, dict]:
    """({module: scaling * B @ A}, {module: scaling}, {module: r}) for every PEFT LoRA layer of diffusers' pipeline holding
    `adapter` (a text encoder's modules prefixed with its component, as the pool names them)."""
    from peft.tuners.lora import LoraLayer

    deltas, scalings, ranks = {}, {}, {}
    for component, prefix in (
        ("unet", ""),
        ("text_encoder", "text_encoder."),
        ("text_encoder_2", "text_encoder_2."),
    ):
        for name, module in getattr(ref, component).named_modules():
            if isinstance(module, LoraLayer) and adapter in module.lora_A:
                a = module.lora_A[adapter].weight.detach().float().numpy()
                b = module.lora_B[adapter].weight.detach().float().numpy()
                scalings[prefix + name] = float(module.scaling[adapter])
                deltas[prefix + name] = (b @ a) * scalings[prefix + name]
                ranks[prefix + name] = int(module.r[adapter])
    return deltas, scalings, ranks


def _metadata_cases(ref, folder):
    """{case: (file, the file diffusers loads for the reference)}: each file written by diffusers'
    save_lora_weights with a LoraConfig as its lora_adapter_metadata; the reference is the file itself except
    for "text_encoders_other_name" (see below)."""
    from diffusers import StableDiffusionXLPipeline
    from peft.utils import get_peft_model_state_dict

    fa = random_factors(ref.unet, ATTN, rank=4, seed=1)
    fb = random_factors(ref.unet, r"attn1\.to_q$", rank=8, seed=2)
    te1 = random_factors(ref.text_encoder, CLIP_TARGETS, rank=4, seed=3)
    te2 = random_factors(ref.text_encoder_2, CLIP_TARGETS, rank=4, seed=4)

    def save(name, **kw):
        StableDiffusionXLPipeline.save_lora_weights(str(folder / name), safe_serialization=True, **kw)
        return folder / name

    def unet_only(name, config):
        config = {**config, "r": 4, "target_modules": sorted(fa)}
        return save(name, unet_lora_layers=peft_layers(fa), unet_lora_adapter_metadata=config)

    # A text encoder's patterns are matched inside its component, against PEFT's module names there: CLIP's
    # have transformers 4's "text_model." or not (transformers 5), by the installed version. "text_encoders"
    # writes its '^' key in the installed form (what diffusers here matches); "text_encoders_other_name" in the
    # other form, which the reader takes too (the same layer; diffusers under the other transformers matches it).
    te_prefix = (
        "text_model." if any(n.startswith("text_model.") for n, _ in ref.text_encoder.named_modules()) else ""
    )

    def with_text_encoders(name, prefix):
        key = "^" + re.escape(f"{prefix}encoder.layers.0.self_attn.q_proj")
        return save(
            name,
            unet_lora_layers=peft_layers(fa),
            text_encoder_lora_layers=peft_layers(te1),
            text_encoder_2_lora_layers=peft_layers(te2),
            unet_lora_adapter_metadata={
                "r": 4,
                "lora_alpha": 4,
                "alpha_pattern": {"attn2.to_k": 12},
                "target_modules": sorted(fa),
            },
            text_encoder_lora_adapter_metadata={
                "r": 4,
                "lora_alpha": 4,
                "alpha_pattern": {key: 16, r"layers\.1\.mlp\.fc1": 2},
                "target_modules": sorted(te1),
            },
            text_encoder_2_lora_adapter_metadata={
                "r": 4,
                "lora_alpha": 6,
                "use_rslora": True,
                "target_modules": sorted(te2),
            },
        )

    # diffusers' own round trip: a mixed-rank file (no alphas) loaded, saved back with its adapter's LoraConfig,
    # whose rank_pattern / alpha_pattern keys are '^<module>' (diffusers' loaders/peft.py, PEFT PR 2419)
    write_diffusers_lora(folder / "mixed.safetensors", {**fa, **fb}, prefix="unet")
    ref.load_lora_weights(str(folder / "mixed.safetensors"), adapter_name="mixed")
    config = ref.unet.peft_config["mixed"]
    assert config.alpha_pattern and all(k.startswith("^") for k in config.alpha_pattern)
    roundtrip = save(
        "roundtrip",
        unet_lora_layers=get_peft_model_state_dict(ref.unet, adapter_name="mixed"),
        unet_lora_adapter_metadata=config.to_dict(),
    )
    ref.delete_adapters("mixed")
    regex = r"down_blocks\.1\.attentions\.0.*to_q"
    cases = {
        "roundtrip_caret_keys": roundtrip,
        "regex_key": unet_only("regex", {"lora_alpha": 4, "alpha_pattern": {regex: 16}}),
        # both keys match down_blocks.1's attn1.to_q: PEFT takes the first in the file (json sort_keys order)
        "first_matching_key": unet_only(
            "first",
            {"lora_alpha": 4, "alpha_pattern": {r"attn1\.to_q": 2, r"down_blocks\.1.*attn1\.to_q": 16}},
        ),
        "rslora": unet_only("rslora", {"lora_alpha": 8, "use_rslora": True}),
        "rslora_alpha_pattern": unet_only(
            "rslora_pattern", {"lora_alpha": 8, "use_rslora": True, "alpha_pattern": {regex: 2}}
        ),
        "text_encoders": with_text_encoders("te", te_prefix),
    }
    cases = {case: (path, path) for case, path in cases.items()}
    other = "" if te_prefix else "text_model."
    cases["text_encoders_other_name"] = (with_text_encoders("te_other", other), cases["text_encoders"][0])
    return cases


@pytest.fixture(scope="module")
def metadata_files(sdxl_ref, tmp_path_factory):
    ref, _ = sdxl_ref
    return _metadata_cases(ref, tmp_path_factory.mktemp("lora_metadata"))


@pytest.mark.parametrize(
    "case",
    [
        "roundtrip_caret_keys",
        "regex_key",
        "first_matching_key",
        "rslora",
        "rslora_alpha_pattern",
        "text_encoders",
        "text_encoders_other_name",
    ],
)
def test_metadata_scaling_matches_peft(sdxl_ref, metadata_files, case):
    """Every layer's delta equals PEFT's scaling * B @ A after diffusers' load_lora_weights of the same file."""
    ref, targets = sdxl_ref
    path, reference = metadata_files[case]
    ref.load_lora_weights(str(reference), adapter_name=case)
    try:
        expected, scalings, ranks = peft_deltas(ref, case)
    finally:
        ref.delete_adapters(case)
    # the metadata matters: the round trip's rank-8 layers have scaling 1 only by their alpha_pattern (its
    # lora_alpha is 4), the other files have scalings != 1 from their patterns / use_rslora
    if case == "roundtrip_caret_keys":
        assert sorted(set(ranks.values())) == [4, 8] and set(scalings.values()) == {1.0}
    else:
        assert any(abs(s - 1.0) > 0.1 for s in scalings.values()), scalings
    got = ours(path, targets)
    assert sorted(got) == sorted(expected)
    errors = {name: float(np.abs(got[name] - expected[name]).max()) for name in expected}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, (
        f"{worst}: max abs delta difference {errors[worst]:.2e} (PEFT scaling {scalings[worst]})"
    )


# --------------------------------------------------------------------------------------------------
# kohya Flux: a fused layer's up weight must have exactly the split's rows (diffusers refuses others too)


@pytest.fixture(scope="module")
def flux_transformer(tiny_flux_dev_path):
    from diffusers import FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(str(tiny_flux_dev_path / "transformer"))
    return transformer, torch_targets({"": transformer})


@pytest.mark.parametrize(
    "stem", ["lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_0_linear1"]
)
@pytest.mark.parametrize("extra", [5, -3, 0])
def test_flux_kohya_fused_rows_must_fit(flux_transformer, tmp_path, stem, extra):
    transformer, targets = flux_transformer
    down, up = flux_kohya_factors(transformer, rank=4, seed=3)[stem]
    up = np.concatenate([up, up[:extra]]) if extra > 0 else up[: up.shape[0] + extra]
    path = write_kohya_stems(tmp_path / "k.safetensors", {stem: (down, up)}, alpha=4.0)
    if extra == 0:
        got = read_adapter(path, family="flux", targets=targets)
        assert len(got) == (3 if "qkv" in stem else 4)
        return
    with pytest.raises(
        AdapterFormatError, match=rf"{stem}\.lora_up\.weight.*{up.shape[0] - extra} output rows"
    ):
        read_adapter(path, family="flux", targets=targets)


# --------------------------------------------------------------------------------------------------
# Bad files: AdapterFormatError naming the key or field, never another exception (nor a silent default)


def _bad_cases():
    a, b = np.ones((4, 64), np.float32), np.ones((64, 4), np.float32)
    good = {f"unet.{MODULE}.lora_A.weight": a, f"unet.{MODULE}.lora_B.weight": b}
    kohya = "lora_unet_" + MODULE.replace(".", "_")

    def meta(config):
        return {"lora_adapter_metadata": config if isinstance(config, str) else json.dumps(config)}

    return {
        "alpha_vector": (
            {**good, f"unet.{MODULE}.alpha": np.array([2.0, 3.0], np.float32)},
            None,
            rf"{MODULE}.*alpha must be one finite number",
        ),
        "kohya_alpha_vector": (
            {
                f"{kohya}.lora_down.weight": a,
                f"{kohya}.lora_up.weight": b,
                f"{kohya}.alpha": np.array([2.0, 3.0], np.float32),
            },
            None,
            rf"{MODULE}.*alpha must be one finite number",
        ),
        "alpha_nan": (
            {**good, f"unet.{MODULE}.alpha": np.array(np.nan, np.float32)},
            None,
            rf"{MODULE}.*alpha must be one finite number",
        ),
        "rank_0": (
            {
                f"unet.{MODULE}.lora_A.weight": np.zeros((0, 64), np.float32),
                f"unet.{MODULE}.lora_B.weight": np.zeros((64, 0), np.float32),
            },
            None,
            rf"{MODULE}.*rank 0",
        ),
        "alpha_string": (good, meta({"unet.lora_alpha": "abc"}), r"unet\.lora_alpha must be a number.*'abc'"),
        "alpha_pattern_list": (
            good,
            meta({"unet.lora_alpha": 4, "unet.alpha_pattern": ["x"]}),
            r"unet\.alpha_pattern must be an object",
        ),
        "alpha_pattern_value": (
            good,
            meta({"unet": {"alpha_pattern": {"to_q": "big"}}}),
            r"unet\.alpha_pattern\['to_q'\] must be a number",
        ),
        "alpha_pattern_bad_regex": (
            good,
            meta({"unet.alpha_pattern": {"to_q(": 8}}),
            r"unet\.alpha_pattern key 'to_q\(' is not a regex",
        ),
        "rslora_string": (good, meta({"unet.use_rslora": "yes"}), r"unet\.use_rslora must be true or false"),
        "metadata_not_json": (good, meta("{not json"), "lora_adapter_metadata is not valid JSON"),
        "metadata_not_object": (good, meta([4]), "lora_adapter_metadata must be a JSON object"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_files_raise_adapter_format_error(sdxl_ref, tmp_path, case):
    from safetensors.numpy import save_file

    _, targets = sdxl_ref
    tensors, metadata, match = _bad_cases()[case]
    path = tmp_path / f"{case}.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(AdapterFormatError, match=match):
        read_adapter(path, family="sdxl", targets=targets, text_encoders=SDXL_ENCODERS)

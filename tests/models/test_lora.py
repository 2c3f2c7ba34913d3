"""LoRA per request against diffusers' `load_lora_weights` + `set_adapters` (torch fp32, CPU), on the tiny SDXL
and Flux folders and random adapters (tests/fixtures/tiny_lora.py): one adapter at a scale, two at different
scales, none; a batch whose rows carry different adapters; no compilation when adapters or scales change;
kohya files; the LRU; bad files.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshserve.models import PipelineError, load_pipeline
from meshserve.models.lora.formats import AdapterFormatError
from meshserve.models.lora.pool import UnknownAdapter
from tests.fixtures.tiny_lora import (
    FLUX_TARGETS,
    flux_kohya_factors,
    random_factors,
    write_diffusers_lora,
    write_kohya_lora,
    write_kohya_stems,
)
from tests.fixtures.tiny_sdxl import diffusers_sdxl

H, W = 32, 48
# The SDXL pools hold only these layers (lora_targets): the attention projections, as diffusers' SDXL DreamBooth
# LoRAs target, and the GEGLU projection (the LinearHalves path). Each layer in the table adds to the LoRA
# program's compile time (all of SDXL_TARGETS: ~55 s cold on the tiny UNet).
SDXL_TEST_TARGETS = r"(attn[12]\.(to_[qkv]|to_out\.0)|ff\.net\.0\.proj)$"
PROMPT = "a photo of a cat"


def max_abs(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


def loras(names, scales):
    return [{"name": n, "scale": s} for n, s in zip(names, scales, strict=True)]


def reference_with(pipe, names, scales):
    if names:
        pipe.enable_lora()
        pipe.set_adapters(list(names), adapter_weights=list(scales))
    else:
        pipe.disable_lora()


# --------------------------------------------------------------------------------------------------
# SDXL


@pytest.fixture(scope="module")
def sdxl(tiny_sdxl_path, tmp_path_factory):
    """(ours, diffusers' pipeline, adapter files): adapters a (rank 4), b (rank 8), and a's kohya file."""
    ref = diffusers_sdxl(tiny_sdxl_path)
    folder = tmp_path_factory.mktemp("sdxl_loras")
    fa = random_factors(ref.unet, SDXL_TEST_TARGETS, rank=4, seed=1)
    fb = random_factors(ref.unet, SDXL_TEST_TARGETS, rank=8, seed=2)
    fk = random_factors(ref.unet, SDXL_TEST_TARGETS, rank=4, seed=3)
    files = {
        "a": write_diffusers_lora(
            folder / "a" / "pytorch_lora_weights.safetensors", fa, prefix="unet"
        ).parent,
        "b": write_diffusers_lora(folder / "b.safetensors", fb, prefix="unet"),
        "k": write_kohya_lora(folder / "k.safetensors", fk, alpha=2.0),
    }
    for name, path in files.items():
        ref.load_lora_weights(str(path), adapter_name=name)
    ours = load_pipeline(
        tiny_sdxl_path,
        dtype="float32",
        max_loras=2,
        max_lora_rank=8,
        lora_budget_mb=4,
        lora_targets=SDXL_TEST_TARGETS,
    )
    for name, path in files.items():
        info = ours.load_lora(name, path)
        assert info["name"] == name and info["bytes"] > 0
    assert ours.lora.slots >= 3
    return ours, ref, files


def _sdxl_latents(batch=1, seed=0):
    return np.random.default_rng(seed).standard_normal((batch, 4, H // 2, W // 2)).astype(np.float32)


def _run_sdxl(pipe, prompts, latents, **kw):
    return pipe(
        prompts,
        height=H,
        width=W,
        num_inference_steps=3,
        guidance_scale=5.0,
        latents=latents,
        output_type="np",
        **kw,
    ).images


@pytest.mark.parametrize(
    "names,scales", [(("a",), (0.7,)), (("a", "b"), (0.5, -1.2)), ((), ())], ids=["one", "two", "none"]
)
def test_sdxl_matches_diffusers(sdxl, names, scales):
    import torch

    ours, ref, _ = sdxl
    latents = _sdxl_latents()
    reference_with(ref, names, scales)
    expected = _run_sdxl(ref, PROMPT, torch.from_numpy(latents))
    got = _run_sdxl(ours, PROMPT, latents, loras=loras(names, scales) if names else None)
    err = max_abs(got, expected)
    assert err <= 1e-3, f"max abs pixel difference {err:.2e}"
    if names:  # the adapters really move the image: a test that dropped them would fail
        plain = _run_sdxl(ours, PROMPT, latents)
        assert max_abs(got, plain) > 2e-2


def test_sdxl_switching_adapters_compiles_nothing(sdxl):
    ours, _, _ = sdxl
    latents = _sdxl_latents()
    _run_sdxl(ours, PROMPT, latents, loras=loras(["a"], [1.0]))  # the LoRA program, compiled once
    before = ours.compilations
    for names, scales in [
        (["b"], [0.3]),
        (["a", "b"], [1.5, 0.2]),
        (["b", "a"], [-1.0, 2.0]),
        (["k"], [1.0]),
    ]:
        _run_sdxl(ours, PROMPT, latents, loras=loras(names, scales))
    assert ours.compilations == before


def test_sdxl_rows_carry_their_own_adapters(sdxl):
    ours, _, _ = sdxl
    rows = [loras(["a"], [0.7]), loras(["b", "a"], [-1.2, 0.3]), []]
    latents = _sdxl_latents(3, seed=5)
    batch = _run_sdxl(ours, [PROMPT] * 3, latents, loras=rows)
    for i, row in enumerate(rows):
        alone = _run_sdxl(ours, PROMPT, latents[i : i + 1], loras=row or None)
        assert max_abs(batch[i], alone[0]) <= 1e-5, f"row {i}"
    assert max_abs(batch[0], batch[2]) > 2e-2  # the rows differ: each got its own adapters


def test_sdxl_kohya_matches_diffusers_conversion(sdxl):
    import torch

    ours, ref, _ = sdxl
    latents = _sdxl_latents(seed=2)
    reference_with(ref, ["k"], [0.8])
    expected = _run_sdxl(ref, PROMPT, torch.from_numpy(latents))
    got = _run_sdxl(ours, PROMPT, latents, loras=loras(["k"], [0.8]))
    assert max_abs(got, expected) <= 1e-3


def _sgm_named(tensors: dict, unet_config) -> dict:
    """kohya keys in diffusers' names -> the SGM names kohya's sd-scripts write for SDXL (the inverse of
    models/lora/sgm_names.py's table, for the attention modules SDXL_TEST_TARGETS adapts)."""
    from meshserve.models.lora.sgm_names import sgm_layout

    table = sgm_layout(unet_config.down_block_types, unet_config.up_block_types, unet_config.layers_per_block)
    sgm = {
        module: (f"middle_block_{sub}" if part == "middle_block" else f"{part}_{index}_{sub}")
        for (part, index), subs in table.items()
        for sub, module in enumerate(subs)
    }
    out = {}
    for key, value in tensors.items():
        stem, dot, tail = key.partition(".")
        module = next(m for m in sgm if stem.startswith(f"lora_unet_{m}_"))
        out[f"lora_unet_{sgm[module]}_{stem[len(f'lora_unet_{module}_') :]}{dot}{tail}"] = value
    return out


def test_sdxl_kohya_sgm_names_match_diffusers(sdxl, tmp_path):
    """The same kohya file with SGM block names (`lora_unet_input_blocks_4_1_...`, most published SDXL
    LoRAs): read as the diffusers-named file, and equal to diffusers' own loading of it (which maps the
    blocks with _maybe_map_sgm_blocks_to_diffusers). The programs are the kohya test's: nothing compiles."""
    import torch
    from safetensors.numpy import save_file

    from meshserve.models.checkpoints.loading import read_safetensors

    ours, ref, files = sdxl
    tensors = {k: np.asarray(v) for k, v in read_safetensors(files["k"]).items()}
    renamed = _sgm_named(tensors, ours.unet_config)
    assert any(k.startswith("lora_unet_input_blocks_") for k in renamed)
    assert any(k.startswith("lora_unet_output_blocks_") for k in renamed)
    path = tmp_path / "sgm.safetensors"
    save_file(renamed, str(path))
    ref.load_lora_weights(str(path), adapter_name="sgm")
    ours.load_lora("sgm", path)
    try:
        latents = _sdxl_latents(seed=2)
        reference_with(ref, ["sgm"], [0.8])
        expected = _run_sdxl(ref, PROMPT, torch.from_numpy(latents))
        got = _run_sdxl(ours, PROMPT, latents, loras=loras(["sgm"], [0.8]))
        assert max_abs(got, expected) <= 1e-3
        assert max_abs(got, _run_sdxl(ours, PROMPT, latents, loras=loras(["k"], [0.8]))) <= 1e-6
    finally:
        ours.unload_lora("sgm")
        ref.delete_adapters("sgm")


# --------------------------------------------------------------------------------------------------
# Registration: the LRU, names, bad files (no compilation needed)


@pytest.fixture(scope="module")
def small_pool(tiny_sdxl_path):
    """A pool whose budget holds only max_loras = 2 slots."""
    return load_pipeline(tiny_sdxl_path, dtype="float32", max_loras=2, max_lora_rank=8, lora_budget_mb=0)


def test_lru_evicts_least_recently_used(small_pool, sdxl):
    _, _, files = sdxl
    pipe = small_pool
    assert pipe.lora.slots == 2
    pipe.load_lora("a", files["a"])
    pipe.load_lora("b", files["b"])
    pipe.lora.rows(loras(["a"], [1.0]), 1, 1)  # a call marks "a" used: "b" is now the least recent
    pipe.load_lora("k", files["k"])
    assert pipe.loras == ["a", "k"]
    with pytest.raises(UnknownAdapter, match=r"'b'.*\['a', 'k'\]"):
        pipe(PROMPT, num_inference_steps=1, loras=loras(["b"], [1.0]))
    pipe.unload_lora("a")
    assert pipe.loras == ["k"]
    assert pipe.limits["loras"] == {"max_per_request": 2, "max_rank": 8, "scale_min": -4.0, "scale_max": 4.0}


def test_request_errors(small_pool, sdxl):
    _, _, files = sdxl
    pipe = small_pool
    pipe.load_lora("b", files["b"])
    for bad, match in [
        (loras(["b", "b", "b"], [1, 1, 1]), "at most 2"),
        (loras(["b"], [99.0]), r"scale of 'b' must be in"),
        ([[{"name": "b"}]] * 3, "3 lists for 1 prompts"),
        ("b", "must be a list"),
    ]:
        with pytest.raises(PipelineError, match=match):
            pipe(PROMPT, num_inference_steps=1, loras=bad)


def test_one_adapter_twice_in_a_row_is_refused(small_pool, tmp_path):
    """diffusers' set_adapters does not add two weights of one adapter, as the table would (0.5 + 0.7): a row
    naming an adapter twice is refused, as the service refuses it (422 not_unique), and nothing is marked used."""
    pipe = small_pool
    module = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
    factors = {module: (np.ones((4, 64), np.float32), np.ones((64, 4), np.float32))}
    pipe.load_lora("twice", write_diffusers_lora(tmp_path / "twice.safetensors", factors, prefix="unet"))
    try:
        for bad in (
            loras(["twice", "twice"], [0.5, 0.7]),
            [loras(["twice"], [1.0]), [{"name": "twice", "scale": 0.5}, "twice"]],  # per row: the second row
        ):
            with pytest.raises(PipelineError, match="'twice' is named twice in one row"):
                pipe.lora.rows(bad, 2 if isinstance(bad[0], list) else 1, 1)
        with pytest.raises(PipelineError, match="named twice"):
            pipe(PROMPT, num_inference_steps=1, loras=loras(["twice", "twice"], [0.5, 0.7]))
        index, scale = pipe.lora.rows([loras(["twice"], [0.5]), loras(["twice"], [0.7])], 2, 1)  # one per row
        assert np.allclose(scale[:, 0], [0.5, 0.7]) and index[0, 0] == index[1, 0]
    finally:
        pipe.unload_lora("twice")


def test_bad_files_name_the_first_bad_key(small_pool, tmp_path):
    from safetensors.numpy import save_file

    pipe = small_pool
    module = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
    good = {f"unet.{module}.lora_A.weight": np.zeros((4, 64), np.float32)}
    good[f"unet.{module}.lora_B.weight"] = np.zeros((64, 4), np.float32)
    cases = [
        (
            {**good, "unet.down_blocks.9.nope.lora_A.weight": np.zeros((4, 32), np.float32)},
            "down_blocks.9.nope",
        ),
        (
            {
                f"unet.{module}.lora_A.weight": np.zeros((4, 63), np.float32),
                f"unet.{module}.lora_B.weight": np.zeros((64, 4), np.float32),
            },
            rf"{module}.*do not fit",
        ),
        (
            {
                **good,
                "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": np.zeros(
                    (4, 7), np.float32
                ),
                "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight": np.zeros(
                    (32, 4), np.float32
                ),
            },
            r"'text_encoder\.text_model\.encoder\.layers\.0\.self_attn\.q_proj'.*do not fit",
        ),
        (
            {
                # SGM names are read (models/lora/sgm_names.py), but the tiny UNet has input blocks 0-5 only
                "lora_unet_input_blocks_7_1_transformer_blocks_0_attn1_to_q.lora_down.weight": np.zeros(
                    (4, 32), np.float32
                )
            },
            "lora_unet_input_blocks_7_1.* names no module of this UNet",
        ),
        ({f"unet.{module}.lora_A.weight": np.zeros((4, 64), np.float32)}, "lacks its up weight"),
        (
            {**good, f"unet.{module}.lora_magnitude_vector": np.zeros((32,), np.float32)},
            "lora_magnitude_vector",
        ),
    ]
    for i, (tensors, match) in enumerate(cases):
        path = tmp_path / f"bad{i}.safetensors"
        save_file(tensors, str(path))
        with pytest.raises(AdapterFormatError, match=match):
            pipe.load_lora(f"bad{i}", path)
    assert all(not n.startswith("bad") for n in pipe.loras)
    with pytest.raises(AdapterFormatError, match="rank 16"):
        save_file(
            {k: np.zeros((16, 64) if "lora_A" in k else (64, 16), np.float32) for k in good},
            str(tmp_path / "r.safetensors"),
        )
        pipe.load_lora("big", tmp_path / "r.safetensors")
    with pytest.raises(AdapterFormatError, match="neither a local file"):
        pipe.load_lora("missing", "/nonexistent/lora.safetensors")


# --------------------------------------------------------------------------------------------------
# Flux


FLUX_H, FLUX_W, TEXT = 32, 32, 16


@pytest.fixture(scope="module")
def flux(tiny_flux_dev_path, tmp_path_factory):
    import torch
    from diffusers import FluxPipeline

    ref = FluxPipeline.from_pretrained(str(tiny_flux_dev_path), torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    folder = tmp_path_factory.mktemp("flux_loras")
    fa = random_factors(ref.transformer, FLUX_TARGETS, rank=4, seed=1)
    fb = random_factors(ref.transformer, FLUX_TARGETS, rank=8, seed=2)
    kohya = flux_kohya_factors(ref.transformer, rank=4, seed=3, single_linear1=False)
    files = {
        "a": write_diffusers_lora(folder / "a.safetensors", fa, prefix="transformer"),
        "b": write_diffusers_lora(folder / "b.safetensors", fb, prefix="transformer"),
        "k": write_kohya_stems(folder / "k.safetensors", kohya, alpha=8.0),
    }
    for name, path in files.items():
        ref.load_lora_weights(str(path), adapter_name=name)
    ours = load_pipeline(tiny_flux_dev_path, dtype="float32", max_loras=2, max_lora_rank=8, lora_budget_mb=4)
    for name, path in files.items():
        ours.load_lora(name, path)
    return ours, ref, files


def _flux_latents(seed=0):
    tokens = (FLUX_H // 4) * (FLUX_W // 4)
    return np.random.default_rng(seed).standard_normal((1, tokens, 16)).astype(np.float32)


def _run_flux(pipe, latents, **kw):
    return pipe(
        PROMPT,
        height=FLUX_H,
        width=FLUX_W,
        num_inference_steps=3,
        guidance_scale=3.5,
        max_sequence_length=TEXT,
        latents=latents,
        output_type="np",
        **kw,
    ).images


@pytest.mark.parametrize(
    "names,scales",
    [(("a",), (0.7,)), (("a", "b"), (0.5, -1.2)), ((), ()), (("k",), (0.9,))],
    ids=["one", "two", "none", "kohya"],
)
def test_flux_matches_diffusers(flux, names, scales):
    import torch

    ours, ref, _ = flux
    latents = _flux_latents()
    reference_with(ref, names, scales)
    expected = _run_flux(ref, torch.from_numpy(latents))
    got = _run_flux(ours, latents, loras=loras(names, scales) if names else None)
    err = max_abs(got, expected)
    assert err <= 1e-3, f"max abs pixel difference {err:.2e}"
    if names:
        assert max_abs(got, _run_flux(ours, latents)) > 2e-2
        # Other scales (and, across the cases, other adapters) reuse the LoRA program this call compiled or
        # found: in any order of the cases, a case run alone included.
        compiled = ours.compilations
        _run_flux(ours, latents, loras=loras(names, [s / 2 for s in scales]))
        assert ours.compilations == compiled


def test_flux_joint_attention_kwargs_scale_is_diffusers_lora_scale(flux):
    import torch

    ours, ref, _ = flux
    latents = _flux_latents()
    reference_with(ref, ("a", "b"), (0.5, -1.2))
    expected = _run_flux(ref, torch.from_numpy(latents), joint_attention_kwargs={"scale": 0.5})
    got = _run_flux(
        ours, latents, loras=loras(("a", "b"), (0.5, -1.2)), joint_attention_kwargs={"scale": 0.5}
    )
    assert max_abs(got, expected) <= 1e-3
    assert max_abs(got, _run_flux(ours, latents, loras=loras(("a", "b"), (0.25, -0.6)))) <= 1e-6


def test_flux_kohya_linear1_splits_like_its_diffusers_conversion(flux, tmp_path):
    """A single block's fused linear1 (q, k, v, proj_mlp): diffusers' converter hard-codes FLUX.1's widths, so
    the tiny model checks it against the same adapter written as diffusers keys (shared down, split up)."""
    ours, ref, _ = flux
    t = ref.transformer
    kohya = {k: v for k, v in flux_kohya_factors(t, rank=4, seed=4).items() if k.endswith("linear1")}
    dim = t.config.num_attention_heads * t.config.attention_head_dim
    split = {}
    for stem, (down, up) in kohya.items():
        i = stem.split("_")[-2]
        widths = [dim, dim, dim, up.shape[0] - 3 * dim]
        names = ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"]
        for name, part in zip(names, np.split(up, np.cumsum(widths)[:-1]), strict=True):
            split[f"single_transformer_blocks.{i}.{name}"] = (down, part)
    ours.load_lora("k1", write_kohya_stems(tmp_path / "k1.safetensors", kohya, alpha=4.0))
    ours.load_lora("d1", write_diffusers_lora(tmp_path / "d1.safetensors", split, prefix="transformer"))
    latents = _flux_latents(seed=3)
    got = _run_flux(ours, latents, loras=loras(["k1"], [1.0]))
    expected = _run_flux(ours, latents, loras=loras(["d1"], [1.0]))
    assert max_abs(got, expected) <= 1e-5
    assert max_abs(got, _run_flux(ours, latents)) > 2e-2


# --------------------------------------------------------------------------------------------------
# Wan 2.1 (diffusers format): the transformer's attention and feed-forward Linears

WAN_TARGETS = r"blocks\.\d+\.(attn[12]\.(to_[qkv]|to_out\.0)|ffn\.net\.(0\.proj|2))$"
WAN_H, WAN_W, WAN_F = 48, 80, 9  # latents [4, 3, 6, 10] (tests/models/test_wan_pipeline.py's shapes)


def test_wan_matches_diffusers(tiny_wan_path, tmp_path):
    """One adapter at 0.7 on a Wan 2.1 text-to-video folder equals diffusers' WanPipeline.load_lora_weights +
    set_adapters (latents after 3 CFG steps), and moves them (against diffusers without the adapter)."""
    import torch
    from diffusers import WanPipeline as TorchWanPipeline

    ref = TorchWanPipeline.from_pretrained(str(tiny_wan_path), dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    path = write_diffusers_lora(
        tmp_path / "wan.safetensors",
        random_factors(ref.transformer, WAN_TARGETS, rank=4, seed=1),
        prefix="transformer",
    )
    ref.load_lora_weights(str(path), adapter_name="w")
    ours = load_pipeline(
        tiny_wan_path,
        dtype="float32",
        max_loras=1,
        max_lora_rank=4,
        lora_budget_mb=1,
        lora_targets=WAN_TARGETS,
    )
    info = ours.load_lora("w", path)
    assert len(info["targets"]) == len(ours.lora._layers()[1])  # every targeted layer read from the file
    latents = np.random.default_rng(0).standard_normal((1, 4, 3, 6, 10)).astype(np.float32)
    kw = dict(
        height=WAN_H,
        width=WAN_W,
        num_frames=WAN_F,
        num_inference_steps=3,
        guidance_scale=5.0,
        negative_prompt="blurry",
        output_type="latent",
    )

    def reference(names, scales):
        reference_with(ref, names, scales)
        with torch.no_grad():
            return ref(PROMPT, latents=torch.from_numpy(latents), **kw).frames.float().numpy()

    expected = reference(["w"], [0.7])
    got = ours(PROMPT, latents=latents, loras=loras(["w"], [0.7]), **kw).images
    err = max_abs(got, expected)
    print(f"Wan LoRA against diffusers: max abs latent difference {err:.2e}")
    assert err <= 1e-3, f"max abs latent difference {err:.2e}"
    assert max_abs(got, reference([], [])) > 2e-2

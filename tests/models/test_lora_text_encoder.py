"""Text-encoder LoRA (issue 21): files with CLIP factors against diffusers' `load_lora_weights` + `set_adapters`
(torch fp32, CPU) on the tiny SDXL and Flux folders; kohya lora_te1_/lora_te2_ files against diffusers'
conversion of the same file; rows with different text-encoder adapters against each row alone; no compilation
when they change (warm-up included); the prompt cache bypassed; the refused encoders.

Cheap by construction: the SDXL pool's denoiser table is test_lora.py's (same targets, rank, slot count), so
its LoRA denoise programs come from the compilation cache; the Flux pool is test_lora.py's own; 2 steps.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshserve.models import PipelineError, load_pipeline
from meshserve.models.lora.formats import AdapterFormatError, read_adapter
from tests.fixtures.tiny_lora import (
    CLIP_TARGETS,
    FLUX_TARGETS,
    flux_kohya_factors,
    peft_layers,
    random_factors,
    write_kohya_parts,
)
from tests.fixtures.tiny_sdxl import diffusers_sdxl
from tests.models.test_lora import SDXL_TEST_TARGETS, loras, max_abs, reference_with

H, W, STEPS = 32, 48, 2
PROMPT, NEGATIVE = "a photo of a cat", "blurry"
# test_lora.py's UNet layers and every attention / MLP Linear of both CLIPs.
TARGETS = rf"{SDXL_TEST_TARGETS}|{CLIP_TARGETS}"


def lora_config(factors: dict, rank: int, alpha: float) -> dict:
    """The LoraConfig diffusers writes as a component's `lora_adapter_metadata`."""
    return {"r": rank, "lora_alpha": alpha, "target_modules": sorted(factors)}


def same_denoiser_slots(pipe, budget_mb: float) -> None:
    """Give the pool the slot count test_lora.py's pool has (its budget over the UNet's layers alone), so the
    denoise programs' table shapes, and so the programs, are the same."""
    lora = pipe.lora
    writes, _ = lora._layers()
    itemsize = np.dtype(np.float32).itemsize
    unet = sum(
        itemsize * lora.max_rank * (t.n_in + int(np.prod(t.out)))
        for name, targets in writes.items()
        if not lora._is_text(name)
        for t in targets
    )
    slots = max(lora.max_per_request, int(budget_mb * 2**20) // unet)
    lora.budget_bytes = slots * lora.slot_bytes()
    assert lora.slots == slots


# --------------------------------------------------------------------------------------------------
# SDXL


@pytest.fixture(scope="module")
def sdxl(tiny_sdxl_path, tmp_path_factory):
    """(ours, diffusers' pipeline): adapters d (UNet + both CLIPs, saved by diffusers' save_lora_weights with
    its metadata: text_encoder at lora_alpha 8 = 2 x rank), t (both CLIPs only), k (kohya lora_unet_ +
    lora_te1_ + lora_te2_, alpha 2)."""
    ref = diffusers_sdxl(tiny_sdxl_path)
    folder = tmp_path_factory.mktemp("sdxl_te_loras")

    def factors(seed, rank=4):
        return (
            random_factors(ref.unet, SDXL_TEST_TARGETS, rank=rank, seed=seed),
            random_factors(ref.text_encoder, CLIP_TARGETS, rank=rank, seed=seed + 1),
            random_factors(ref.text_encoder_2, CLIP_TARGETS, rank=rank, seed=seed + 2),
        )

    unet, te1, te2 = factors(11)
    ref.save_lora_weights(
        folder / "d",
        unet_lora_layers=peft_layers(unet),
        text_encoder_lora_layers=peft_layers(te1, up_scale=0.5),  # x alpha / r = 2 when read
        text_encoder_2_lora_layers=peft_layers(te2),
        unet_lora_adapter_metadata=lora_config(unet, 4, 4),
        text_encoder_lora_adapter_metadata=lora_config(te1, 4, 8),
        text_encoder_2_lora_adapter_metadata=lora_config(te2, 4, 4),
    )
    _, te1, te2 = factors(21, rank=8)
    ref.save_lora_weights(
        folder / "t", text_encoder_lora_layers=peft_layers(te1), text_encoder_2_lora_layers=peft_layers(te2)
    )
    unet, te1, te2 = factors(31)
    files = {
        "d": folder / "d",
        "t": folder / "t",
        "k": write_kohya_parts(
            folder / "k.safetensors", {"lora_unet_": unet, "lora_te1_": te1, "lora_te2_": te2}, alpha=2.0
        ),
    }
    for name, path in files.items():
        ref.load_lora_weights(str(path), adapter_name=name)
    ours = load_pipeline(
        tiny_sdxl_path, dtype="float32", max_loras=2, max_lora_rank=8, lora_budget_mb=4, lora_targets=TARGETS
    )
    same_denoiser_slots(ours, 4)
    for name, path in files.items():
        info = ours.load_lora(name, path)
        assert info["text_encoders"] == ["text_encoder", "text_encoder_2"], name
    return ours, ref


def _latents(batch=1, seed=0):
    return np.random.default_rng(seed).standard_normal((batch, 4, H // 2, W // 2)).astype(np.float32)


def _run(pipe, prompts, latents, **kw):
    # diffusers wants the negatives in the prompt's type (a string for a string)
    negative = NEGATIVE if isinstance(prompts, str) else [NEGATIVE] * len(prompts)
    return pipe(
        prompts,
        negative_prompt=negative,
        height=H,
        width=W,
        num_inference_steps=STEPS,
        guidance_scale=5.0,
        latents=latents,
        output_type="np",
        **kw,
    ).images


@pytest.mark.parametrize(
    "names,scales",
    [(("d",), (0.7,)), (("t",), (1.0,)), (("d", "t"), (0.5, -1.0)), (("k",), (0.8,))],
    ids=["unet+te", "te-only", "two", "kohya"],
)
def test_sdxl_matches_diffusers(sdxl, names, scales):
    """Each equals diffusers with the same adapters on the UNet and both text encoders (the kohya file:
    diffusers' own conversion of it), prompt and negative encoded with them; each moves the image."""
    import torch

    ours, ref = sdxl
    latents = _latents()
    reference_with(ref, names, scales)
    expected = _run(ref, PROMPT, torch.from_numpy(latents))
    got = _run(ours, PROMPT, latents, loras=loras(names, scales))
    err = max_abs(got, expected)
    print(f"SDXL text-encoder LoRA {names} against diffusers: max abs pixel difference {err:.2e}")
    assert err <= 1e-3, f"max abs pixel difference {err:.2e}"
    assert max_abs(got, _run(ours, PROMPT, latents)) > 2e-2


def test_sdxl_cross_attention_kwargs_scale_is_diffusers_lora_scale(sdxl):
    """diffusers' `cross_attention_kwargs={"scale": s}` multiplies every adapter's weight, in the UNet and in
    both text encoders: equal to diffusers' call with it, and to ours with the scales multiplied."""
    import torch

    ours, ref = sdxl
    latents, names, scales = _latents(), ("d", "t"), (0.5, -1.0)
    reference_with(ref, names, scales)
    expected = _run(ref, PROMPT, torch.from_numpy(latents), cross_attention_kwargs={"scale": 0.6})
    got = _run(ours, PROMPT, latents, loras=loras(names, scales), cross_attention_kwargs={"scale": 0.6})
    err = max_abs(got, expected)
    assert err <= 1e-3, f"max abs pixel difference {err:.2e}"
    assert max_abs(got, _run(ours, PROMPT, latents, loras=loras(names, [0.3, -0.6]))) <= 1e-6
    assert max_abs(got, _run(ours, PROMPT, latents, loras=loras(names, scales))) > 2e-2
    for bad, match in (
        ({"scale": "x"}, "finite number"),
        ({"scale": 0.5, "ip_adapter_masks": None}, "only 'scale'"),
        (0.5, "must be a dict"),
        ({"scale": 10.0}, "lora scale 10.0"),  # 0.5 x 10 is past the pool's scale range
    ):
        with pytest.raises(PipelineError, match=match):
            _run(ours, PROMPT, latents, loras=loras(names, scales), cross_attention_kwargs=bad)
    with pytest.raises(TypeError, match="joint_attention_kwargs"):  # Flux's name, not SDXL's
        _run(ours, PROMPT, latents, joint_attention_kwargs={"scale": 0.5})


def test_sdxl_rows_carry_their_own_text_adapters_and_switching_compiles_nothing(sdxl):
    ours, _ = sdxl
    rows = [loras(["d"], [0.7]), loras(["t", "k"], [1.0, -0.4]), []]
    latents = _latents(3, seed=5)
    batch = _run(ours, [PROMPT] * 3, latents, loras=rows)
    for i, row in enumerate(rows):
        alone = _run(ours, PROMPT, latents[i : i + 1], loras=row or None)
        assert max_abs(batch[i], alone[0]) <= 1e-5, f"row {i}"
    before = ours.compilations
    for names, scales in [
        (["t"], [0.3]),
        (["d", "t"], [1.5, 0.2]),
        (["k"], [1.0]),
        (["t", "k"], [-1.0, 2.0]),
    ]:
        _run(ours, PROMPT, latents[:1], loras=loras(names, scales))
    assert ours.compilations == before
    # One prompt is encoded once: its images may not carry different text-encoder adapters.
    with pytest.raises(PipelineError, match="different text-encoder adapters"):
        ours(PROMPT, num_images_per_prompt=2, num_inference_steps=1, loras=[loras(["t"], [1.0]), []])


def test_sdxl_warm_up_compiles_the_lora_programs(sdxl):
    """warm_up with adapters registered compiles the LoRA variants of the denoise and text_encode programs
    (every slot at scale 0, marking no adapter used): an adapter on the UNet and both text encoders then
    compiles nothing, CFG off (a program no other test here runs) and on. This is also the denoise LoRA
    warm-up's test (tests/models/test_lora.py had its own, ~85 s of the suite for the same programs)."""
    ours, _ = sdxl
    order = ours.loras
    ours.warm_up([(W, H)], batch_sizes=(1,))
    assert ours.loras == order
    before = ours.compilations
    for guidance in (1.0, 5.0):
        ours(
            PROMPT,
            height=H,
            width=W,
            num_inference_steps=1,
            guidance_scale=guidance,
            output_type="np",
            loras=loras(["d"], [0.6]),
        )
    assert ours.compilations == before


def test_sdxl_prompt_cache_is_bypassed_by_text_adapters(sdxl):
    """With the prompt cache on, a call with text-encoder adapters reads and writes no entry (it equals the
    uncached call), and the plain rows cached before still hit afterwards with their plain encoding."""
    from meshserve.models.engine.prompt_cache import PromptCache

    ours, _ = sdxl
    latents = _latents(seed=7)
    adapters = loras(["t"], [1.0])
    expected = _run(ours, PROMPT, latents, loras=adapters)
    cache = ours.prompt_cache = PromptCache(64 << 20)
    try:
        plain = _run(ours, PROMPT, latents)  # caches the prompt's and the negative's rows
        counts = (cache.hits, cache.misses, cache.entries)
        got = _run(ours, PROMPT, latents, loras=adapters)
        assert (cache.hits, cache.misses, cache.entries) == counts
        assert max_abs(got, expected) <= 1e-6
        assert max_abs(got, plain) > 2e-2
        again = _run(ours, PROMPT, latents)
        assert cache.hits == counts[0] + 2
        assert max_abs(again, plain) <= 1e-6
    finally:
        ours.prompt_cache = None


# --------------------------------------------------------------------------------------------------
# Formats: what is read, what is refused (no pipeline)


def test_refused_encoders_and_bad_keys_name_the_key(tmp_path):
    from safetensors.numpy import save_file

    q = "text_encoder.text_model.encoder.layers.0.self_attn.q_proj"
    targets = {q: {"in": 32, "out": 32}}

    def read(tensors, family="sdxl", text_encoders=("text_encoder", "text_encoder_2")):
        path = tmp_path / "f.safetensors"
        save_file(tensors, str(path))
        return read_adapter(path, family=family, targets=targets, text_encoders=text_encoders)

    a, b = np.ones((4, 32), np.float32), np.ones((32, 4), np.float32)
    for key, family, encoders, match in [
        (
            "text_encoder_2.encoder.block.0.layer.0.SelfAttention.q",
            "flux",
            ("text_encoder",),
            r"text_encoder_2 \(T5\)",
        ),
        (
            "lora_te2_encoder_block_0_layer_0_SelfAttention_q",
            "flux",
            ("text_encoder",),
            r"text_encoder_2 \(T5\)",
        ),
        ("text_encoder.encoder.block.0.layer.0.SelfAttention.q", "wan", (), r"text_encoder \(umT5\)"),
        (
            "lora_te3_text_model_encoder_layers_0_self_attn_q_proj",
            "sdxl",
            ("text_encoder",),
            "text_encoder_3",
        ),
    ]:
        suffix = (
            (".lora_down.weight", ".lora_up.weight")
            if key.startswith("lora_")
            else (".lora_A.weight", ".lora_B.weight")
        )
        with pytest.raises(AdapterFormatError, match=rf"{match}.*{key}"):
            read({key + suffix[0]: a, key + suffix[1]: b}, family, encoders)
    with pytest.raises(AdapterFormatError, match=rf"{q}.*do not fit"):
        read({f"{q}.lora_A.weight": np.ones((4, 31), np.float32), f"{q}.lora_B.weight": b})
    with pytest.raises(AdapterFormatError, match="layers.7.self_attn.q_proj.*no adaptable layer"):
        read({f"{q.replace('.0.', '.7.')}.lora_A.weight": a, f"{q.replace('.0.', '.7.')}.lora_B.weight": b})
    # Read: PEFT keys without transformers 4's text_model., kohya lora_te_ / lora_te1_, older converted keys.
    plain = "text_encoder.encoder.layers.0.self_attn.q_proj"
    kohya = "text_model_encoder_layers_0_self_attn_q_proj"
    for tensors in [
        {f"{plain}.lora_A.weight": a, f"{plain}.lora_B.weight": b},
        {f"lora_te_{kohya}.lora_down.weight": a, f"lora_te_{kohya}.lora_up.weight": b},
        {f"lora_te1_{kohya}.lora_down.weight": a, f"lora_te1_{kohya}.lora_up.weight": b},
        {f"{q[:-7]}.to_q_lora.down.weight": a, f"{q[:-7]}.to_q_lora.up.weight": b},
    ]:
        factors = read(tensors)
        assert list(factors) == [q]
        np.testing.assert_array_equal(factors[q][1], b.T)  # alpha = rank


# --------------------------------------------------------------------------------------------------
# Flux: the CLIP (pooled projection) takes adapters; T5 is refused (above)

FLUX_H, FLUX_W, TEXT = 32, 32, 16


@pytest.fixture(scope="module")
def flux(tiny_flux_dev_path, tmp_path_factory):
    """(ours: test_lora.py's Flux pool, diffusers' pipeline): f (transformer + CLIP, diffusers' save path),
    fk (kohya BFL stems + lora_te1_ CLIP, alpha 8), ft (the CLIP only)."""
    import torch
    from diffusers import FluxPipeline

    ref = FluxPipeline.from_pretrained(str(tiny_flux_dev_path), torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    folder = tmp_path_factory.mktemp("flux_te_loras")
    ref.save_lora_weights(
        folder / "f",
        transformer_lora_layers=peft_layers(random_factors(ref.transformer, FLUX_TARGETS, rank=4, seed=41)),
        text_encoder_lora_layers=peft_layers(random_factors(ref.text_encoder, CLIP_TARGETS, rank=4, seed=42)),
    )
    ref.save_lora_weights(
        folder / "ft",
        text_encoder_lora_layers=peft_layers(random_factors(ref.text_encoder, CLIP_TARGETS, rank=8, seed=43)),
    )
    kohya = {
        "": flux_kohya_factors(ref.transformer, rank=4, seed=44, single_linear1=False),
        "lora_te1_": random_factors(ref.text_encoder, CLIP_TARGETS, rank=4, seed=45),
    }
    files = {
        "f": folder / "f",
        "fk": write_kohya_parts(folder / "fk.safetensors", kohya, alpha=8.0),
        "ft": folder / "ft",
    }
    for name, path in files.items():
        ref.load_lora_weights(str(path), adapter_name=name)
    ours = load_pipeline(tiny_flux_dev_path, dtype="float32", max_loras=2, max_lora_rank=8, lora_budget_mb=4)
    for name, path in files.items():
        assert ours.load_lora(name, path)["text_encoders"] == ["text_encoder"]
    return ours, ref


@pytest.mark.parametrize(
    "names,scales",
    [(("f",), (0.7,)), (("fk",), (0.9,)), (("ft",), (1.0,))],
    ids=["diffusers", "kohya", "clip-only"],
)
def test_flux_matches_diffusers(flux, names, scales):
    import torch

    ours, ref = flux
    latents = (
        np.random.default_rng(0).standard_normal((1, (FLUX_H // 4) * (FLUX_W // 4), 16)).astype(np.float32)
    )
    kw = dict(
        height=FLUX_H,
        width=FLUX_W,
        num_inference_steps=STEPS,
        guidance_scale=3.5,
        max_sequence_length=TEXT,
        output_type="np",
    )
    reference_with(ref, names, scales)
    expected = ref(PROMPT, latents=torch.from_numpy(latents), **kw).images
    got = ours(PROMPT, latents=latents, loras=loras(names, scales), **kw).images
    err = max_abs(got, expected)
    print(f"Flux text-encoder LoRA {names} against diffusers: max abs pixel difference {err:.2e}")
    assert err <= 1e-3, f"max abs pixel difference {err:.2e}"
    assert max_abs(got, ours(PROMPT, latents=latents, **kw).images) > 1e-2

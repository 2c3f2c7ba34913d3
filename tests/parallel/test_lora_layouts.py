"""LoRA on cfg2 x context2 x tensor2 (8 CPU devices) equals one device, and the adapter factors are split like
the weights they adapt (docs/lora.md, "Sharding"); on SDXL the adapters reach both text encoders too.

One batch of three rows with their own adapters (one at a scale, two at different scales, none), CFG on, so
the cfg axis splits the interleaved [uncond, cond] batch, context splits the tokens and tensor the heads and
MLP units: every adapted layer's delta is computed from a sharded input with sharded factors. Each pipeline
compiles one LoRA program (its compile is the cost: the tables are narrowed with `lora_targets`, as in
tests/models/test_lora.py).
"""

import numpy as np

from meshserve.models import load_pipeline
from meshserve.models.attention import AttentionSettings
from tests.fixtures.tiny_lora import CLIP_TARGETS, factors_for

MESH = {"cfg": 2, "context": 2, "tensor": 2}
PROMPTS = ["a photo of a cat", "a red car", "a bowl of fruit"]
ROWS = [
    [{"name": "a", "scale": 0.7}],
    [{"name": "b", "scale": -1.2}, {"name": "a", "scale": 0.5}],
    [],
]
LORA = dict(dtype="float32", max_loras=2, max_lora_rank=8, lora_budget_mb=4)


def max_abs(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def _pipes(path, targets, prefix, tmp_path, lora_convs=False, **mesh_kw):
    """(one device, the mesh), both with adapters a (rank 4) and b (rank 8) from the same files: PEFT keys as
    diffusers' save_lora_weights writes them, `prefix` for the denoiser's modules, a text encoder's own
    ("text_encoder.", "text_encoder_2.") for its modules when `targets` reaches them."""
    from safetensors.numpy import save_file

    lora = dict(LORA, lora_targets=targets, lora_convs=lora_convs)
    single = load_pipeline(path, **lora)
    sharded = load_pipeline(path, mesh=MESH, devices=list(range(8)), **lora, **mesh_kw)
    shapes = single.lora._layers()[1]
    for name, rank, seed in (("a", 4, 1), ("b", 8, 2)):
        tensors = {}
        for module, (down, up) in factors_for(shapes, rank, seed).items():
            key = module if module.startswith("text_encoder") else f"{prefix}.{module}"
            tensors |= {f"{key}.lora_A.weight": down, f"{key}.lora_B.weight": up}
        file = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(file))
        single.load_lora(name, file)
        sharded.load_lora(name, file)
    return single, sharded


def _shard_shapes(x) -> set:
    return {s.data.shape for s in x.addressable_shards}


# --------------------------------------------------------------------------------------------------
# SDXL: attention projections and the GEGLU projection (test_lora.py's SDXL_TEST_TARGETS), and both CLIP text
# encoders' attention and MLP (the text_encode program's LoRA variant on the mesh too)

SDXL_TARGETS = rf"(attn[12]\.(to_[qkv]|to_out\.0)|ff\.net\.0\.proj)$|{CLIP_TARGETS}"
H, W = 32, 48  # 8 x 12 = 96 tokens at the tiny UNet's attention level: context 2 splits them evenly


def _sdxl_call(seed: int) -> dict:
    """The SDXL call both layouts run: 3 rows with ROWS' adapters, CFG with a negative prompt, 2 steps."""
    latents = np.random.default_rng(seed).standard_normal((3, 4, H // 2, W // 2)).astype(np.float32)
    return dict(
        height=H,
        width=W,
        num_inference_steps=2,
        guidance_scale=5.0,
        negative_prompt="blurry",
        latents=latents,
        output_type="np",
        loras=ROWS,
    )


def test_sdxl_lora_mesh_matches_single_device(tiny_sdxl_path, tmp_path, record_property):
    single, sharded = _pipes(tiny_sdxl_path, SDXL_TARGETS, "unet", tmp_path)

    # The factors follow their weights over tensor (2): a q projection (column-split by heads) has B split on
    # its output axis, to_out (row-split) has A split on its input axis, GEGLU ([in, value | gate, out]) has
    # B split on its units; the slot and rank axes, and the other factor, whole.
    tables = sharded.lora.tables()
    block = "down_blocks.1.attentions.0.transformer_blocks.0."
    a, b = tables[block + "attn1.to_q"]
    assert _shard_shapes(a) == {a.shape} and _shard_shapes(b) == {(*b.shape[:2], b.shape[2] // 2)}
    a, b = tables[block + "attn2.to_out.0"]
    assert _shard_shapes(a) == {(a.shape[0], a.shape[1] // 2, a.shape[2])} and _shard_shapes(b) == {b.shape}
    a, b = tables[block + "ff.net.0.proj"]
    assert _shard_shapes(a) == {a.shape} and _shard_shapes(b) == {(*b.shape[:3], b.shape[3] // 2)}
    # The CLIPs' rules name no tensor axis (models/components/clip.py): their factors are whole on every device.
    text = sharded.lora.text_tables()
    assert {name.split(".", 1)[0] for name in text} == {"text_encoder", "text_encoder_2"}
    assert all(_shard_shapes(a) == {a.shape} and _shard_shapes(b) == {b.shape} for a, b in text.values())

    kw = _sdxl_call(seed=0)
    expected = single(PROMPTS, **kw).images
    got = sharded(PROMPTS, **kw).images
    err = max_abs(got, expected)
    record_property("sdxl_lora_max_abs_err", err)
    print(f"SDXL LoRA cfg2 x context2 x tensor2: max abs pixel error {err:.2e}")
    assert err <= 1e-4, f"max abs pixel error {err:.2e}"
    assert expected.std() > 1e-3


def test_sdxl_conv_lora_mesh_matches_single_device(tiny_sdxl_path, tmp_path, record_property):
    """LoCon on the mesh: a resnet's 3x3 conv and 1x1 shortcut, the stride-2 downsampler and the upsampler,
    from spatial maps that context splits; the conv factors are whole on every device (no tensor axis in the
    conv rules). Four convs, one of each kind: each more adds to the LoRA program's compile."""
    convs = (
        r"(down_blocks\.0\.(resnets\.0\.conv1|downsamplers\.0\.conv)|up_blocks\.0\.upsamplers\.0\.conv|"
        r"up_blocks\.1\.resnets\.0\.conv_shortcut)$"
    )
    single, sharded = _pipes(tiny_sdxl_path, convs, "unet", tmp_path, lora_convs=True)
    tables = sharded.lora.tables()
    assert "down_blocks.0.downsamplers.0.conv" in tables and "up_blocks.0.upsamplers.0.conv" in tables
    assert all(_shard_shapes(a) == {a.shape} and _shard_shapes(b) == {b.shape} for a, b in tables.values())
    kw = _sdxl_call(seed=1)
    expected = single(PROMPTS, **kw).images
    got = sharded(PROMPTS, **kw).images
    err = max_abs(got, expected)
    record_property("sdxl_conv_lora_max_abs_err", err)
    print(f"SDXL conv LoRA cfg2 x context2 x tensor2: max abs pixel error {err:.2e}")
    assert err <= 1e-4, f"max abs pixel error {err:.2e}"
    # The conv adapters act: the same program with every scale 0 (the plain model's output) is far off.
    from meshserve.models.lora.pool import ZERO_SCALES

    assert max_abs(expected, single(PROMPTS, **{**kw, "loras": ZERO_SCALES}).images) > 2e-2


# --------------------------------------------------------------------------------------------------
# Flux: both streams' attention, the feed-forward and single blocks' MLP in, and proj_out (two input halves)

FLUX_TARGETS = (
    r"(attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out)|ff\.net\.0\.proj|proj_mlp|"
    r"single_transformer_blocks\.\d+\.proj_out)$"
)
FLUX_H, FLUX_W, TEXT = 36, 28, 16  # 63 image + 16 text tokens: the context layout pads and masks them


def test_flux_lora_mesh_matches_single_device(tiny_flux_dev_path, tmp_path, record_property):
    single, sharded = _pipes(
        tiny_flux_dev_path,
        FLUX_TARGETS,
        "transformer",
        tmp_path,
        attention=AttentionSettings(context_strategy="ulysses"),
    )
    tables = sharded.lora.tables()
    # proj_out's halves: A split by its input like each half's weight (attention heads, MLP units), B whole.
    for half in ("from_attn", "from_mlp"):
        a, b = tables[f"single_transformer_blocks.0.proj_out.{half}"]
        assert _shard_shapes(a) == {(a.shape[0], a.shape[1] // 2, a.shape[2])} and _shard_shapes(b) == {
            b.shape
        }
    a, b = tables["transformer_blocks.0.attn.add_k_proj"]
    assert _shard_shapes(a) == {a.shape} and _shard_shapes(b) == {(*b.shape[:2], b.shape[2] // 2)}

    tokens = (FLUX_H // 4) * (FLUX_W // 4)
    latents = np.random.default_rng(0).standard_normal((3, tokens, 16)).astype(np.float32)
    kw = dict(
        height=FLUX_H,
        width=FLUX_W,
        num_inference_steps=2,
        guidance_scale=3.5,
        true_cfg_scale=2.0,
        negative_prompt="blurry",
        max_sequence_length=TEXT,
        latents=latents,
        output_type="np",
        loras=ROWS,
    )
    expected = single(PROMPTS, **kw).images
    got = sharded(PROMPTS, **kw).images
    err = max_abs(got, expected)
    record_property("flux_lora_max_abs_err", err)
    print(f"Flux LoRA cfg2 x context2 x tensor2 (Ulysses): max abs pixel error {err:.2e}")
    assert err <= 1e-4, f"max abs pixel error {err:.2e}"
    assert expected.std() > 1e-3

"""WanTransformer3DModel: ours (JAX) against diffusers' on a tiny random checkpoint written by diffusers'
save_pretrained (tests/fixtures/tiny_wan.py), on one device and on tensor/context-parallel layouts; the real
1.3B and 14B configs' keys and shapes (abstract, no weights).

The latent video is 3 frames of 6 x 10: a 3 x 3 x 5 patch grid, 45 tokens, which does not split over context=2
(the attention entry pads and masks it). The measured errors are logged:
`pytest tests/models/test_transformer_wan.py --log-cli-level=INFO` shows them.
"""

from __future__ import annotations

import json
import logging
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshserve.models.attention import AttentionSettings, attention
from meshserve.models.checkpoints.loading import (
    CheckpointMismatchError,
    abstract_module,
    load_weights,
    read_component_weights,
    torch_key,
    write_safetensors,
)
from meshserve.models.parallel.mesh import MeshSizes, make_mesh
from meshserve.models.parallel.placement import Placement
from meshserve.models.wan.transformer_wan import (
    KEEP_IN_FP32,
    SHARDING_RULES,
    WanTransformer3DConfig,
    WanTransformer3DModel,
    load_wan_transformer,
    wan_rope,
    wan_rope_dims,
)
from tests.fixtures.tiny_wan import TRANSFORMER, build_tiny_wan_transformer

log = logging.getLogger(__name__)

FRAMES, HEIGHT, WIDTH = 3, 6, 10  # latent video: 3 x 3 x 5 = 45 tokens after the (1, 2, 2) patches
S_TXT = 7

# The published Wan 2.1 text-to-video transformer configs (diffusers' convert_wan_to_diffusers.py).
WAN_1_3B = dict(
    patch_size=[1, 2, 2],
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
)
WAN_14B = {**WAN_1_3B, "num_attention_heads": 40, "num_layers": 40, "ffn_dim": 13824}


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="session")
def wan_folder(tmp_path_factory):
    """Saved sharded (an index.json), so the sharded reader is exercised too."""
    folder = build_tiny_wan_transformer(
        tmp_path_factory.mktemp("wan") / "transformer", max_shard_size="100KB"
    )
    assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    return folder


@pytest.fixture(scope="session")
def torch_model(wan_folder):
    from diffusers import WanTransformer3DModel as TorchWan

    return TorchWan.from_pretrained(str(wan_folder)).eval()


def make_inputs(batch: int = 2, seed: int = 0) -> dict:
    rs = np.random.RandomState(seed)
    return dict(
        hidden_states=rs.randn(batch, FRAMES, HEIGHT, WIDTH, TRANSFORMER["in_channels"]).astype(np.float32),
        encoder_hidden_states=rs.randn(batch, S_TXT, TRANSFORMER["text_dim"]).astype(np.float32),
        # UniPC's integer timesteps, as the pipeline passes them
        timestep=np.array([999, 421], np.int64)[:batch],
    )


def torch_forward(model, inputs: dict, dtype=torch.float32) -> np.ndarray:
    """diffusers' model on [B, C, F, H, W]; the output back in our [B, F, H, W, C] layout."""
    x = torch.from_numpy(inputs["hidden_states"]).permute(0, 4, 1, 2, 3).to(dtype)
    with torch.no_grad():
        out = model(
            hidden_states=x,
            timestep=torch.from_numpy(inputs["timestep"]),
            encoder_hidden_states=torch.from_numpy(inputs["encoder_hidden_states"]).to(dtype),
        ).sample
    return out.permute(0, 2, 3, 4, 1).float().numpy()


def jitted(model):
    """The model split once and jitted as a denoising loop would call it; counts its traces."""
    graphdef, state = nnx.split(model)
    traces = []

    @jax.jit
    def forward(state, x, timestep, context, rope):
        traces.append(1)
        return nnx.merge(graphdef, state)(x, timestep, context, rope)

    def args(inputs: dict, dtype=jnp.float32):
        return (
            state,
            jnp.asarray(inputs["hidden_states"], dtype),
            # int64 (UniPC's) as int32, JAX's default integer; fractional timesteps stay float32
            jnp.asarray(
                inputs["timestep"], jnp.int32 if inputs["timestep"].dtype == np.int64 else jnp.float32
            ),
            jnp.asarray(inputs["encoder_hidden_states"], dtype),
            model.rope(FRAMES, HEIGHT, WIDTH),
        )

    def call(inputs: dict, dtype=jnp.float32):
        return forward(*args(inputs, dtype))

    call.lowered_text = lambda inputs: forward.lower(*args(inputs)).as_text()
    call.traces = traces
    return call


# --------------------------------------------------------------------------------------------------
# Single device


def test_rope_matches_diffusers_wan_rotary_pos_embed():
    """Tables for the 480p 81-frame grid (21 x 30 x 52 = 32760 tokens) at head_dim 128 (parts 44/42/42):
    bit-equal to diffusers' float64 tables (measured max abs diff 0), and for the tiny model's grid."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    assert wan_rope_dims(128) == (44, 42, 42)
    for grid, head_dim, max_len in (((21, 30, 52), 128, 1024), ((3, 3, 5), 16, 32)):
        cos, sin = wan_rope(grid, head_dim, max_len)
        ref = WanRotaryPosEmbed(head_dim, (1, 2, 2), max_len)
        video = torch.empty(1, 1, grid[0], 2 * grid[1], 2 * grid[2])
        ref_cos, ref_sin = (t.reshape(-1, head_dim).numpy() for t in ref(video))
        assert cos.dtype == np.float32 and cos.shape == (int(np.prod(grid)), head_dim)
        err = max(np.abs(cos - ref_cos).max(), np.abs(sin - ref_sin).max())
        log.info("Wan RoPE tables %s head_dim %d: max abs diff %.2e", grid, head_dim, err)
        assert err <= 1e-6
    with pytest.raises(ValueError, match="rope_max_seq_len"):
        wan_rope((33, 1, 1), 16, 32)


def test_wan_transformer_matches_diffusers(wan_folder, torch_model):
    """fp32, batch 2, at two timestep sets (integers as UniPC's, then fractional ones), one compile each."""
    model = load_wan_transformer(wan_folder)
    forward = jitted(model)
    inputs = make_inputs()
    for timestep in (inputs["timestep"], np.array([0.5, 37.25], np.float32)):
        inputs = {**inputs, "timestep": timestep}
        expected = torch_forward(torch_model, inputs)
        out = forward(inputs)
        assert (
            out.shape == (2, FRAMES, HEIGHT, WIDTH, TRANSFORMER["out_channels"]) and out.dtype == jnp.float32
        )
        err = rel_err(out, expected)
        log.info("Wan fp32 t=%s: rel err %.2e", timestep, err)
        assert err <= 1e-4
    assert len(forward.traces) == 2  # int32 and float32 timesteps


def test_first_frame_timesteps_match_diffusers_per_token_timesteps(wan_folder, torch_model):
    """Wan 2.2 TI2V's image-to-video: diffusers' timestep [B, S] with the first latent frame's tokens at 0 and
    the rest at t, against ours with first_frame_timestep 0 (one compile); and on a cfg2 x context2 layout
    (Ulysses: the tokens split, the first frame's on one device), the one device's output."""
    model = load_wan_transformer(wan_folder)
    inputs = make_inputs()
    first_tokens = (HEIGHT // 2) * (WIDTH // 2)
    tokens = FRAMES * first_tokens
    per_token = np.repeat(inputs["timestep"][:, None], tokens, axis=1)
    per_token[:, :first_tokens] = 0
    x = torch.from_numpy(inputs["hidden_states"]).permute(0, 4, 1, 2, 3)
    with torch.no_grad():
        expected = (
            torch_model(
                hidden_states=x,
                timestep=torch.from_numpy(per_token),
                encoder_hidden_states=torch.from_numpy(inputs["encoder_hidden_states"]),
            )
            .sample.permute(0, 2, 3, 4, 1)
            .numpy()
        )

    def run(model):
        graphdef, state = nnx.split(model)
        forward = jax.jit(
            lambda state, x, t, ctx, rope: nnx.merge(graphdef, state)(
                x, t, ctx, rope, None, jnp.zeros_like(t)
            )
        )
        return forward(
            state,
            jnp.asarray(inputs["hidden_states"]),
            jnp.asarray(inputs["timestep"], jnp.int32),
            jnp.asarray(inputs["encoder_hidden_states"]),
            model.rope(FRAMES, HEIGHT, WIDTH),
        )

    out = run(model)
    err = rel_err(out, expected)
    log.info("Wan fp32 first-frame timesteps: rel err %.2e", err)
    assert err <= 1e-4
    assert rel_err(out, jitted(model)(inputs)) > 1e-3  # the first frame's timestep matters

    sizes = MeshSizes(cfg=2, context=2)
    mesh = make_mesh(sizes, jax.devices()[:4])
    settings = AttentionSettings(mesh=mesh, context_strategy="ulysses")
    split = load_wan_transformer(
        wan_folder, settings=settings, place=Placement(mesh, sizes, ()).placer(SHARDING_RULES)
    )
    assert rel_err(run(split), out) <= 1e-4


def test_a_temporal_patch_matches_diffusers(tmp_path):
    """patch_size (3, 2, 2), a tiny-wan trial's (docs/embedded-model.md): three latent frames a token
    (3 x 6 x 10 -> 1 x 3 x 5 tokens), fp32, against diffusers' Conv3d patch embedding and its unpatchify."""
    from diffusers import WanTransformer3DModel as TorchWan

    folder = build_tiny_wan_transformer(tmp_path / "transformer", seed=1, patch_size=[3, 2, 2])
    model = load_wan_transformer(folder)
    assert model.patch_grid(FRAMES, HEIGHT, WIDTH) == (1, 3, 5)
    inputs = make_inputs()
    expected = torch_forward(TorchWan.from_pretrained(str(folder)).eval(), inputs)
    err = rel_err(jitted(model)(inputs), expected)
    log.info("Wan patch (3, 2, 2) fp32: rel err %.2e", err)
    assert err <= 1e-4


def test_keep_in_fp32_modules_follow_diffusers_bf16_load(wan_folder):
    """Every parameter has the dtype diffusers' bf16 `from_pretrained` gives it (fp32 for
    _keep_in_fp32_modules: time_embedder, scale_shift_table, norm2; bf16 for the rest)."""
    from diffusers import WanTransformer3DModel as TorchWan

    reference = TorchWan.from_pretrained(str(wan_folder), torch_dtype=torch.bfloat16)
    want = {k: str(v.dtype).removeprefix("torch.") for k, v in reference.named_parameters()}
    model = load_wan_transformer(wan_folder, dtype=jnp.bfloat16)
    got = {
        torch_key(path): str(var.get_value().dtype)
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    assert got == want
    # diffusers' rule: a parameter is kept when one of its dotted path components is in the list
    fp32 = {k for k, v in got.items() if v == "float32"}
    assert fp32 == {k for k in got if set(k.split(".")) & set(KEEP_IN_FP32)}
    assert {"scale_shift_table", "blocks.1.scale_shift_table", "blocks.0.norm2.weight"} < fp32
    assert "condition_embedder.time_embedder.linear_2.weight" in fp32
    assert got["condition_embedder.time_proj.weight"] == got["blocks.0.attn1.norm_q.weight"] == "bfloat16"


def test_wan_transformer_bf16_is_as_accurate_as_diffusers_bf16(wan_folder, torch_model):
    """bf16 (fp32 keep list in both) against diffusers' fp32 output: ours may stray at most 1.15x as far as
    diffusers' own bf16 run does. Both errors and ours against diffusers' bf16 are logged. Measured: ours
    5.93e-3, diffusers' 5.93e-3, ours vs diffusers' bf16 6.89e-3 (the two bf16 programs round in different
    places, e.g. XLA keeps fused elementwise chains in fp32); both are dominated by the bf16 output rounding,
    so this bound is loose: the self-attention residual added in bf16 instead of fp32 gave 7.12e-3 (1.20x,
    caught), a bf16 time embedder 6.27e-3 (1.06x, not caught here: the dtype test above catches it)."""
    from diffusers import WanTransformer3DModel as TorchWan

    inputs = make_inputs()
    reference = torch_forward(torch_model, inputs)
    ours = jitted(load_wan_transformer(wan_folder, dtype=jnp.bfloat16))(inputs, jnp.bfloat16)
    assert ours.dtype == jnp.bfloat16
    theirs = torch_forward(
        TorchWan.from_pretrained(str(wan_folder), torch_dtype=torch.bfloat16).eval(), inputs, torch.bfloat16
    )
    ours_err, theirs_err = rel_err(ours, reference), rel_err(theirs, reference)
    log.info(
        "Wan bf16 vs fp32: ours %.2e, diffusers bf16 %.2e; ours vs diffusers bf16 %.2e",
        ours_err,
        theirs_err,
        rel_err(ours, theirs),
    )
    assert ours_err <= 1.15 * theirs_err
    assert rel_err(ours, theirs) <= 5e-2


def test_shape_errors_are_named(wan_folder):
    model = load_wan_transformer(wan_folder)
    inputs = make_inputs()
    args = (jnp.asarray(inputs["timestep"]), jnp.asarray(inputs["encoder_hidden_states"]))
    with pytest.raises(ValueError, match="does not divide into patches"):
        model.rope(FRAMES, HEIGHT + 1, WIDTH)
    wrong_rope = model.rope(FRAMES, HEIGHT, WIDTH + 2)
    with pytest.raises(ValueError, match="do not fit"):
        model(jnp.asarray(inputs["hidden_states"]), *args, wrong_rope)
    with pytest.raises(ValueError, match="channels"):
        model(jnp.asarray(inputs["hidden_states"][..., :3]), *args, model.rope(FRAMES, HEIGHT, WIDTH))


def test_loader_names_missing_and_unexpected_keys(wan_folder, tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    shutil.copy(wan_folder / "config.json", folder / "config.json")
    state = dict(read_component_weights(wan_folder))
    state["blocks.0.attn2.add_k_proj.weight"] = np.zeros((2, 2), np.float32)
    state["blocks.0.attn2.norm_added_q.weight"] = np.zeros((2,), np.float32)  # ignored, as diffusers does
    del state["blocks.1.scale_shift_table"]
    write_safetensors(folder / "diffusion_pytorch_model.safetensors", state)
    with pytest.raises(CheckpointMismatchError) as info:
        load_wan_transformer(folder)
    assert info.value.unexpected == ["blocks.0.attn2.add_k_proj.weight"]
    assert info.value.missing == ["blocks.1.scale_shift_table"]


def test_config_rejects_unknown_and_image_to_video_fields(wan_folder):
    raw = json.loads((wan_folder / "config.json").read_text())
    config = WanTransformer3DConfig.from_config(raw)
    assert config.patch_size == (1, 2, 2) and config.inner_dim == 64
    with pytest.raises(ValueError, match="unsupported fields"):
        WanTransformer3DConfig.from_config({**raw, "window_size": [-1, -1]})
    for field, value in (("added_kv_proj_dim", 5120), ("pos_embed_seq_len", 514)):
        with pytest.raises(ValueError, match="without image_dim"):
            WanTransformer3DConfig.from_config({**raw, field: value})
    # image_dim alone: image tokens in the text's context (diffusers' I2V test model; tests/models/test_wan_i2v.py)
    assert WanTransformer3DConfig.from_config({**raw, "image_dim": 1280}).image_in_context


# --------------------------------------------------------------------------------------------------
# Parallel layouts: every layout gives the single-device output


LAYOUTS = {
    "tensor2": (MeshSizes(tensor=2), "auto"),
    # 45 tokens over context=2: the attention entry pads to 46 and masks the pad key
    "context2_ring": (MeshSizes(context=2), "ring"),
    "context2_ulysses": (MeshSizes(context=2), "ulysses"),  # 4 heads: 2 per device
    # Ulysses inside pairs of devices, a ring across the two pairs; 45 tokens padded to 48
    "context4_hybrid": (MeshSizes(context=4), "hybrid"),
    # weights also stored split over the context axis (FSDP)
    "context2_tensor2_fsdp": (MeshSizes(context=2, tensor=2), "ring"),
}


@pytest.fixture(scope="module")
def single_device_output(wan_folder):
    return jitted(load_wan_transformer(wan_folder))(make_inputs())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_wan_transformer_layouts_equal_one_device(wan_folder, single_device_output, layout):
    sizes, strategy = LAYOUTS[layout]
    inputs = make_inputs()
    mesh = make_mesh(sizes, jax.devices()[: sizes.num_devices])
    settings = AttentionSettings(mesh=mesh, context_strategy=strategy)
    shard_over = ("context",) if layout.endswith("_fsdp") else ()
    place = Placement(mesh, sizes, shard_over).placer(SHARDING_RULES)
    model = load_wan_transformer(wan_folder, settings=settings, place=place)
    if sizes.tensor > 1:  # the rules really split the attention, its QK norm and the FFN
        block = model.blocks[0]
        for weight in (block.attn1.to_q.kernel, block.attn2.to_k.kernel, block.ffn.net[0].proj.kernel):
            assert weight[...].sharding.spec[1] == "tensor"
        assert block.attn1.norm_q.scale[...].sharding.spec == P("tensor")
        assert block.attn1.to_out[0].kernel[...].sharding.spec[0] == "tensor"
    if shard_over:
        assert model.proj_out.kernel[...].sharding.spec == P("context", None)
    forward = jitted(model)
    if sizes.context > 1:
        # The strategy asked for ran in every block's self-attention, and only there: the program has
        # num_layers times the collectives of one lone self-attention call, so the cross-attention to the
        # text added none (its K/V stay whole on every device).
        collective = {"ring": "collective_permute", "ulysses": "all_to_all", "hybrid": "all_to_all"}[strategy]
        q = jnp.zeros((2, FRAMES * HEIGHT * WIDTH // 4, TRANSFORMER["num_attention_heads"], 16))
        one = jax.jit(lambda q: attention(q, q, q, settings=settings)).lower(q).as_text().count(collective)
        assert one > 0
        assert forward.lowered_text(inputs).count(collective) == TRANSFORMER["num_layers"] * one
    out = forward(inputs)
    err = rel_err(out, single_device_output)
    log.info("Wan layout %s: rel err vs one device %.2e", layout, err)
    assert err <= 1e-4


def test_qk_norm_across_heads_all_reduces_its_squares_under_tensor_parallelism(wan_folder):
    """The RMSNorm over all heads on q split by heads over tensor=2: XLA computes it from per-device partial
    sums of squares and one all-reduce, keeping the features split (no all-gather of q), and equals the
    unsplit norm."""
    sizes = MeshSizes(tensor=2)
    mesh = make_mesh(sizes, jax.devices()[:2])
    model = load_wan_transformer(wan_folder, place=Placement(mesh, sizes).placer(SHARDING_RULES))
    norm = model.blocks[0].attn1.norm_q
    q = np.random.RandomState(1).randn(2, 45, 64).astype(np.float32)
    q_split = jax.device_put(q, NamedSharding(mesh, P(None, None, "tensor")))
    graphdef, state = nnx.split(norm)
    apply = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    hlo = apply.lower(state, q_split).compile().as_text()
    assert "all-reduce" in hlo and "all-gather" not in hlo
    out = apply(state, q_split)
    assert out.sharding.spec == P(None, None, "tensor")
    weight = np.asarray(read_component_weights(wan_folder)["blocks.0.attn1.norm_q.weight"], np.float32)
    expected = q / np.sqrt(np.mean(q * q, axis=-1, keepdims=True) + 1e-6) * weight
    assert rel_err(out, expected) <= 1e-6


# --------------------------------------------------------------------------------------------------
# The real models' shapes (no weights)


@pytest.mark.parametrize("name,config", [("1.3B", WAN_1_3B), ("14B", WAN_14B)])
def test_every_real_checkpoint_key_and_shape_maps(name, config):
    """diffusers' full-size model (built on the meta device: shapes only) against ours built abstractly: every
    checkpoint key and shape maps, none is left over. The arrays are zero-stride stand-ins, so nothing of the
    parameters is allocated."""
    from diffusers import WanTransformer3DModel as TorchWan

    with torch.device("meta"):
        reference = TorchWan(**config)
    zero = np.zeros(1, np.float32)
    state = {
        key: np.lib.stride_tricks.as_strided(zero, tuple(t.shape), (0,) * t.ndim)
        for key, t in reference.state_dict().items()
    }
    ours = WanTransformer3DConfig.from_config({"_class_name": "WanTransformer3DModel", **config})
    assert ours.inner_dim == {"1.3B": 1536, "14B": 5120}[name]
    model = abstract_module(WanTransformer3DModel, ours)
    load_weights(model, state, place=lambda path, array: array)
    total = sum(t.numel() for t in reference.parameters())
    log.info("Wan %s: %.3f B parameters, all mapped", name, total / 1e9)
    assert total == {"1.3B": 1_418_996_800, "14B": 14_288_491_584}[name]


def test_sharding_rules_split_every_large_wan_weight():
    """On the 1.3B shapes at tensor=4 (12 heads: 3 per device; ffn 8960: 2240): every rule's rank fits its
    parameter, and every weight of dim^2 elements or more is split over tensor except the embedders' and the
    output head's, which are FSDP-only."""
    config = WanTransformer3DConfig.from_config(WAN_1_3B)
    model = abstract_module(WanTransformer3DModel, config)
    sizes = MeshSizes(tensor=4)
    placement = Placement(make_mesh(sizes, jax.devices()[:4]), sizes)
    total = whole = 0
    big = config.inner_dim**2
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key, shape = torch_key(path), var.get_value().shape
        spec = placement.param_spec(SHARDING_RULES, key, shape)
        n = int(np.prod(shape))
        total += n
        if "tensor" not in spec:
            whole += n
            if n >= big:
                assert re.match(r"(patch_embedding|condition_embedder|proj_out)\.", key), key
    log.info("Wan 1.3B: %.2f %% of the parameters not split over tensor", 100 * whole / total)
    assert whole / total < 0.02

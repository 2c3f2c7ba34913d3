"""FluxTransformer2DModel: ours (JAX) against diffusers' on tiny random checkpoints written by diffusers'
save_pretrained, with and without the guidance embedding (Flux.1-dev / schnell).

The measured errors are logged: `pytest tests/models/test_transformer_flux.py --log-cli-level=INFO` shows them.
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
from jax.sharding import PartitionSpec as P

from meshserve.models.attention import AttentionSettings
from meshserve.models.checkpoints.loading import (
    CheckpointMismatchError,
    abstract_module,
    load_weights,
    read_component_weights,
    torch_key,
    write_safetensors,
)
from meshserve.models.flux.transformer_flux import (
    SHARDING_RULES,
    FluxTransformer2DConfig,
    FluxTransformer2DModel,
    flux_rope,
    image_ids,
    load_flux_transformer,
    scaled_timestep,
    split_single_proj_out,
)
from meshserve.models.parallel.mesh import MeshSizes, make_mesh
from meshserve.models.parallel.placement import Placement

log = logging.getLogger(__name__)

TINY = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=16,
    axes_dims_rope=(4, 6, 6),
)
# 7 text + 4 x 6 image tokens: a joint sequence of 31, which does not split over context=2.
S_TXT, GRID = 7, (4, 6)


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="session")
def flux_folders(tmp_path_factory):
    """{"dev": guidance_embeds=True, "schnell": False}; dev's weights are saved sharded (an index.json)."""
    from diffusers import FluxTransformer2DModel

    root = tmp_path_factory.mktemp("flux")
    folders = {}
    for name, guidance in (("dev", True), ("schnell", False)):
        torch.manual_seed(0)
        model = FluxTransformer2DModel(**TINY, guidance_embeds=guidance).eval()
        # RMSNorm weights start at 1: perturb them so the QK norms' weights are exercised.
        with torch.no_grad():
            for key, p in model.named_parameters():
                if "norm_q" in key or "norm_k" in key or "norm_added" in key:
                    p.add_(0.2 * torch.randn_like(p))
        folders[name] = root / name
        model.save_pretrained(folders[name], max_shard_size="40KB" if guidance else "5GB")
    assert (folders["dev"] / "diffusion_pytorch_model.safetensors.index.json").is_file()
    return folders


@pytest.fixture(scope="session")
def torch_models(flux_folders):
    from diffusers import FluxTransformer2DModel

    return {k: FluxTransformer2DModel.from_pretrained(str(v)).eval() for k, v in flux_folders.items()}


def make_inputs(guidance: bool, batch: int = 2, seed: int = 0) -> dict:
    rs = np.random.RandomState(seed)
    h, w = GRID
    return dict(
        hidden_states=rs.randn(batch, h * w, TINY["in_channels"]).astype(np.float32),
        encoder_hidden_states=rs.randn(batch, S_TXT, TINY["joint_attention_dim"]).astype(np.float32),
        pooled_projections=rs.randn(batch, TINY["pooled_projection_dim"]).astype(np.float32),
        # sigma = t / 1000 as the pipeline passes it; 0.98841 rounds to 0.98828 in bf16
        timestep=np.array([0.98841, 0.25], np.float32)[:batch],
        img_ids=image_ids(h, w),
        txt_ids=np.zeros((S_TXT, 3), np.float32),
        guidance=np.array([3.5, 5.0], np.float32)[:batch] if guidance else None,
    )


def torch_forward(model, inputs: dict, dtype=torch.float32) -> np.ndarray:
    def t(x):
        return None if x is None else torch.from_numpy(x)

    floats = ("hidden_states", "encoder_hidden_states", "pooled_projections")
    args = {k: (t(v).to(dtype) if k in floats else t(v)) for k, v in inputs.items()}
    with torch.no_grad():
        return model.to(dtype)(**args).sample.float().numpy()


def jitted(model):
    """The model split once and jitted as a denoising loop would call it; counts its traces."""
    graphdef, state = nnx.split(model)
    traces = []

    @jax.jit
    def forward(state, x, context, pooled, timestep, rope, guidance):
        traces.append(1)
        return nnx.merge(graphdef, state)(x, context, pooled, timestep, rope, guidance)

    def args(inputs: dict, dtype=jnp.float32):
        rope = model.rope(inputs["txt_ids"], inputs["img_ids"])
        guidance = inputs["guidance"]
        return (
            state,
            jnp.asarray(inputs["hidden_states"], dtype),
            jnp.asarray(inputs["encoder_hidden_states"], dtype),
            jnp.asarray(inputs["pooled_projections"], dtype),
            jnp.asarray(inputs["timestep"]),
            rope,
            None if guidance is None else jnp.asarray(guidance),
        )

    def call(inputs: dict, dtype=jnp.float32):
        return forward(*args(inputs, dtype))

    call.lowered_text = lambda inputs: forward.lower(*args(inputs)).as_text()
    call.traces = traces
    return call


def test_rope_matches_diffusers_flux_pos_embed():
    """Tables for text ids (0) and a 128 x 96 grid, as far as a 2048 x 1536 image reaches. Bit-equal to
    diffusers' float64 tables; frequencies and angles in numpy float32 differ by 6.8e-6 there
    (measured), so the 1e-6 bound catches a float32 computation."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    ids = np.concatenate([np.zeros((S_TXT, 3), np.float32), image_ids(128, 96)])
    ids[S_TXT:, 0] = 3.0  # a nonzero first axis, so its frequencies are checked too
    axes = (16, 56, 56)
    cos, sin = flux_rope(ids, axes)
    ref_cos, ref_sin = FluxPosEmbed(theta=10000, axes_dim=list(axes))(torch.from_numpy(ids))
    assert cos.dtype == np.float32 and cos.shape == (ids.shape[0], sum(axes))
    err = max(np.abs(cos - ref_cos.numpy()).max(), np.abs(sin - ref_sin.numpy()).max())
    log.info("RoPE tables: max abs diff %.2e", err)
    assert err <= 1e-6


@pytest.mark.parametrize("variant", ["dev", "schnell"])
def test_flux_transformer_matches_diffusers(flux_folders, torch_models, variant):
    """fp32, batch 2 at two timestep sets, one compile."""
    model = load_flux_transformer(flux_folders[variant])
    forward = jitted(model)
    inputs = make_inputs(guidance=variant == "dev")
    for timestep in (inputs["timestep"], np.array([0.5, 0.001], np.float32)):
        inputs = {**inputs, "timestep": timestep}
        expected = torch_forward(torch_models[variant], inputs)
        out = forward(inputs)
        assert out.shape == (2, GRID[0] * GRID[1], TINY["in_channels"]) and out.dtype == jnp.float32
        err = rel_err(out, expected)
        log.info("Flux %s fp32 t=%s: rel err %.2e", variant, timestep, err)
        assert err <= 1e-4
    assert len(forward.traces) == 1


def test_flux_transformer_bf16_is_as_accurate_as_diffusers_bf16(flux_folders, torch_models):
    """bf16 against diffusers' fp32 output: ours may stray at most 1.25x as far as diffusers' own bf16 run
    (same weights, same inputs) does. The fp32 reference gets timestep and guidance already rounded as a
    bf16 model rounds them (0.98841 -> 988.0, 5.0 -> 4992; test_bf16_time_embedding_rounds_... checks
    that part): against unrounded ones both bf16 runs are off by ~6e-2, that rounding alone, which would hide
    everything else. Measured values are in the log."""
    from diffusers import FluxTransformer2DModel

    inputs = make_inputs(guidance=True)
    rounded = {
        k: np.asarray(scaled_timestep(inputs[k], jnp.bfloat16)) / np.float32(1000)
        for k in ("timestep", "guidance")
    }
    reference = torch_forward(torch_models["dev"], {**inputs, **rounded})
    ours = jitted(load_flux_transformer(flux_folders["dev"], dtype=jnp.bfloat16))(inputs, jnp.bfloat16)
    assert ours.dtype == jnp.bfloat16
    theirs = torch_forward(
        FluxTransformer2DModel.from_pretrained(str(flux_folders["dev"])).eval(), inputs, torch.bfloat16
    )
    ours_err, theirs_err = rel_err(ours, reference), rel_err(theirs, reference)
    log.info("Flux dev bf16 vs fp32: ours %.2e, diffusers bf16 %.2e", ours_err, theirs_err)
    assert ours_err <= 1.25 * theirs_err


def test_bf16_time_embedding_rounds_timestep_and_guidance_as_diffusers(flux_folders):
    """diffusers rounds t/1000 and the guidance to bf16, scales by 1000 in bf16 (0.98841 -> 988.0, 3.5 ->
    3504), then embeds. Our bf16 time embedding against diffusers' bf16 one: measured 4.9e-3 (bf16 MLP
    rounding only). With the plain `t.astype(bf16) * 1000`, XLA's excess precision kept 988.28 and 3500
    under jit: the embedding was 3.1e-1 off, and the end-to-end bf16 test failed too (6.6e-2 against its
    1.1e-2 bound)."""
    from diffusers import FluxTransformer2DModel

    inputs = make_inputs(guidance=True)
    t, g = inputs["timestep"], inputs["guidance"]
    pooled = inputs["pooled_projections"]
    assert np.asarray(jax.jit(lambda x: scaled_timestep(x, jnp.bfloat16))(t))[0] == 988.0
    model = load_flux_transformer(flux_folders["dev"], dtype=jnp.bfloat16)
    embed = jax.jit(
        lambda t, g, p: model.time_text_embed(
            scaled_timestep(t, model.dtype), p, scaled_timestep(g, model.dtype)
        )
    )
    ours = embed(jnp.asarray(t), jnp.asarray(g), jnp.asarray(pooled, jnp.bfloat16))
    ref = FluxTransformer2DModel.from_pretrained(str(flux_folders["dev"]), torch_dtype=torch.bfloat16).eval()
    with torch.no_grad():
        bf16 = torch.bfloat16
        theirs = ref.time_text_embed(
            torch.from_numpy(t).to(bf16) * 1000,
            torch.from_numpy(g).to(bf16) * 1000,
            torch.from_numpy(pooled).to(bf16),
        )
    err = rel_err(ours, theirs.float().numpy())
    log.info("Flux bf16 time embedding vs diffusers bf16: rel err %.2e", err)
    assert err <= 2e-2


def test_guidance_must_match_the_config(flux_folders):
    model = load_flux_transformer(flux_folders["schnell"])
    inputs = make_inputs(guidance=True)
    rope = model.rope(inputs["txt_ids"], inputs["img_ids"])
    args = [jnp.asarray(inputs[k]) for k in ("hidden_states", "encoder_hidden_states", "pooled_projections")]
    with pytest.raises(ValueError, match="no guidance embedding"):
        model(*args, jnp.asarray(inputs["timestep"]), rope, jnp.asarray(inputs["guidance"]))


def test_loader_names_missing_and_unexpected_keys(flux_folders, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(flux_folders["schnell"], folder)
    state = dict(read_component_weights(folder))
    state["transformer_blocks.0.attn.to_q.lora.weight"] = np.zeros((2, 2), np.float32)
    del state["single_transformer_blocks.1.proj_out.weight"]
    write_safetensors(folder / "diffusion_pytorch_model.safetensors", state)
    with pytest.raises(CheckpointMismatchError) as info:
        load_flux_transformer(folder)
    assert info.value.unexpected == ["transformer_blocks.0.attn.to_q.lora.weight"]
    assert info.value.missing == [
        "single_transformer_blocks.1.proj_out.from_attn.weight",
        "single_transformer_blocks.1.proj_out.from_mlp.weight",
    ]


def test_config_rejects_unknown_fields(flux_folders):
    raw = json.loads((flux_folders["dev"] / "config.json").read_text())
    assert FluxTransformer2DConfig.from_config(raw).guidance_embeds is True
    with pytest.raises(ValueError, match="unsupported fields"):
        FluxTransformer2DConfig.from_config({**raw, "qk_norm": "layer_norm"})


# --------------------------------------------------------------------------------------------------
# Parallel layouts: every layout gives the single-device output


LAYOUTS = {
    # ring over a joint sequence of 31 tokens: the attention entry pads it to 32 and masks the pad key
    "context2_ring": (MeshSizes(context=2), "ring"),
    "context2_ulysses": (MeshSizes(context=2), "ulysses"),
    "tensor2": (MeshSizes(tensor=2), "auto"),
    "context2_tensor2": (MeshSizes(context=2, tensor=2), "ring"),
    # weights also stored split over the context axis (FSDP), without the pipeline's explicit gather
    "context2_tensor2_fsdp": (MeshSizes(context=2, tensor=2), "ring"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flux_transformer_layouts_equal_one_device(flux_folders, layout):
    sizes, strategy = LAYOUTS[layout]
    inputs = make_inputs(guidance=True)
    single = jitted(load_flux_transformer(flux_folders["dev"]))(inputs)

    mesh = make_mesh(sizes, jax.devices()[: sizes.num_devices])
    settings = AttentionSettings(mesh=mesh, context_strategy=strategy)
    shard_over = ("context",) if layout.endswith("_fsdp") else ()
    place = Placement(mesh, sizes, shard_over).placer(SHARDING_RULES)
    model = load_flux_transformer(flux_folders["dev"], settings=settings, place=place)
    if sizes.tensor > 1:  # the rules really split the attention, MLP and modulation weights
        block = model.single_transformer_blocks[0]
        for weight in (block.attn.to_q.kernel, block.proj_mlp.kernel, block.norm.linear.kernel):
            assert weight[...].sharding.spec[1] == "tensor"
        assert block.proj_out.from_attn.kernel[...].sharding.spec[0] == "tensor"
        assert block.proj_out.from_mlp.kernel[...].sharding.spec[0] == "tensor"
    if shard_over:
        assert model.context_embedder.kernel[...].sharding.spec == P(None, "context")
    forward = jitted(model)
    if sizes.context > 1:  # the context-parallel strategy asked for is the one that ran
        collective = {"ring": "collective_permute", "ulysses": "all_to_all"}[strategy]
        assert collective in forward.lowered_text(inputs)
    out = forward(inputs)
    err = rel_err(out, single)
    log.info("Flux layout %s: rel err vs one device %.2e", layout, err)
    assert err <= 1e-4


def test_sharding_rules_split_every_large_flux_dev_weight():
    """On Flux.1-dev's shapes (built abstractly: no weights) at tensor=4: every rule's rank fits its
    parameter, and every weight of dim^2 elements or more is split over tensor except the embedders' and
    the output head's, which are FSDP-only (measured: 0.54 % of the parameters stay whole per device)."""
    config = FluxTransformer2DConfig(guidance_embeds=True)
    model = abstract_module(FluxTransformer2DModel, config)
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
                assert re.match(r"(x_embedder|context_embedder|time_text_embed|norm_out|proj_out)\.", key), (
                    key
                )
    log.info("Flux.1-dev: %.2f B parameters, %.2f %% not split over tensor", total / 1e9, 100 * whole / total)
    assert total == 11_901_408_320
    assert whole / total < 0.01


def test_every_flux_dev_checkpoint_key_and_shape_maps():
    """diffusers' full-size Flux.1-dev transformer (built on the meta device: shapes only) against ours built
    abstractly: every checkpoint key and shape maps, none is left over. The arrays are zero-stride stand-ins,
    so nothing of the 11.9 B parameters is allocated."""
    from diffusers import FluxTransformer2DModel as TorchFlux

    with torch.device("meta"):
        reference = TorchFlux(guidance_embeds=True)
    zero = np.zeros(1, np.float32)
    state = {
        key: np.lib.stride_tricks.as_strided(zero, tuple(t.shape), (0,) * t.ndim)
        for key, t in reference.state_dict().items()
    }
    config = FluxTransformer2DConfig.from_config(dict(reference.config))
    model = abstract_module(FluxTransformer2DModel, config)
    load_weights(model, split_single_proj_out(state, config.inner_dim), place=lambda path, array: array)

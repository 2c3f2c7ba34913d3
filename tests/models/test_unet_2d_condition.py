"""UNet2DConditionModel: ours (JAX, NHWC) against diffusers (PyTorch, NCHW) on the same weights.

The measured errors are logged: `pytest tests/models/test_unet_2d_condition.py --log-cli-level=INFO` shows them.
"""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from meshserve.models.attention import AttentionSettings
from meshserve.models.sdxl.unet_2d_condition import UNet2DConditionConfig, load_unet

log = logging.getLogger(__name__)


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def jitted(model):
    """The UNet as the denoising loop calls it: split once, one jitted function; counts its traces."""
    graphdef, state = nnx.split(model)
    traces = []

    @jax.jit
    def forward(state, sample, timestep, context, text_embeds, time_ids):
        traces.append(1)
        return nnx.merge(graphdef, state)(
            sample, timestep, context, text_embeds=text_embeds, time_ids=time_ids
        )

    def call(sample, timestep, context, text_embeds=None, time_ids=None):
        return forward(
            state,
            jnp.asarray(sample.transpose(0, 2, 3, 1)),
            jnp.asarray(timestep, jnp.float32),
            jnp.asarray(context),
            text_embeds if text_embeds is None else jnp.asarray(text_embeds),
            time_ids if time_ids is None else jnp.asarray(time_ids),
        )

    call.traces = traces
    return call


def nchw(x) -> np.ndarray:
    return np.asarray(x, np.float32).transpose(0, 3, 1, 2)


def torch_forward(ref, sample, timestep, context, text_embeds=None, time_ids=None) -> np.ndarray:
    added = None
    if text_embeds is not None:
        added = dict(text_embeds=torch.from_numpy(text_embeds), time_ids=torch.from_numpy(time_ids))
    t = torch.from_numpy(np.asarray(timestep, np.float32)) if np.ndim(timestep) else timestep
    with torch.no_grad():
        return ref(
            torch.from_numpy(sample), t, torch.from_numpy(context), added_cond_kwargs=added
        ).sample.numpy()


def sdxl_inputs(batch: int = 2, seed: int = 0):
    """Random inputs shaped like the tiny SDXL UNet's: latents, 77 text tokens of 64, pooled 32, 6 time ids."""
    rs = np.random.RandomState(seed)
    sample = rs.randn(batch, 4, 32, 32).astype(np.float32)
    context = rs.randn(batch, 77, 64).astype(np.float32)
    text_embeds = rs.randn(batch, 32).astype(np.float32)
    # (original h, w, crop top, left, target h, w) as SDXL's pipeline builds them
    time_ids = np.array([[64, 64, 0, 0, 64, 64], [48, 80, 8, 4, 64, 64]][:batch], np.float32)
    return sample, context, text_embeds, time_ids


@pytest.fixture(scope="module")
def unet_folder(tiny_sdxl_path):
    return tiny_sdxl_path / "unet"


@pytest.fixture(scope="module")
def torch_unet(unet_folder):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(str(unet_folder)).eval()


def test_sdxl_unet_matches_diffusers(unet_folder, torch_unet):
    """Batch 2 with text_time conditioning at two timesteps (an int-valued and a fractional one), one compile."""
    unet = jitted(load_unet(unet_folder))
    sample, context, text_embeds, time_ids = sdxl_inputs()
    for t in (999.0, 10.5):
        expected = torch_forward(torch_unet, sample, t, context, text_embeds, time_ids)
        out = unet(sample, t, context, text_embeds, time_ids)
        assert out.shape == (2, 32, 32, 4) and out.dtype == jnp.float32
        err = rel_err(nchw(out), expected)
        log.info("SDXL UNet fp32 t=%s: rel err %.2e", t, err)
        assert err <= 1e-4
    assert len(unet.traces) == 1  # the timestep is traced: a new value never recompiles


def test_sdxl_unet_bf16_is_as_accurate_as_diffusers_bf16(unet_folder, torch_unet):
    """bf16 cannot meet fp32's 1e-4 (8-bit mantissa), so the yardstick is diffusers' own bf16 run on the same
    weights and inputs: ours may not stray from the fp32 result more than 1.5x as far as it does.

    Measured on this tiny UNet (the fp32 test above: 1.1e-6): on an Intel Xeon (AVX-512, no bf16 dot
    instructions) ours 1.41e-2, diffusers bf16 1.43e-2; on an AMD EPYC with avx512_bf16, where torch's
    oneDNN kernels take bf16 dot products with fp32 accumulation, ours 1.45e-2, diffusers bf16 1.01e-2 (and
    1.39e-2 / 1.24e-2 with both limited to AVX2): the ratio depends on the CPU's instructions, up to 1.43x
    seen, hence 1.5x. The timestep sinusoids computed in bf16 (diffusers keeps them fp32) gave 3.18e-2 (over
    2x either yardstick): rejected here, accepted by the former fixed bound of 5e-2. Finer choices (GroupNorm or LayerNorm statistics in bf16, weights
    truncated instead of rounded: 1.55e-2, 1.31e-2, 1.52e-2) drown in bf16's own rounding at these map sizes;
    the fp32 parity tests and the norms' fp32-statistics code, not this test, stand for them."""
    from diffusers import UNet2DConditionModel

    unet = jitted(load_unet(unet_folder, dtype=jnp.bfloat16))
    sample, context, text_embeds, time_ids = sdxl_inputs()
    expected = torch_forward(torch_unet, sample, 500.0, context, text_embeds, time_ids)
    out = unet(sample, 500.0, context, text_embeds, time_ids)
    assert out.dtype == jnp.float32  # fp32 latents in, fp32 noise prediction out
    err = rel_err(nchw(out), expected)

    torch_bf16 = UNet2DConditionModel.from_pretrained(str(unet_folder), torch_dtype=torch.bfloat16).eval()
    bf16 = [torch.from_numpy(a).bfloat16() for a in (sample, context, text_embeds, time_ids)]
    with torch.no_grad():
        ref_bf16 = torch_bf16(
            bf16[0], 500.0, bf16[1], added_cond_kwargs=dict(text_embeds=bf16[2], time_ids=bf16[3])
        ).sample.float()
    ref_err = rel_err(ref_bf16.numpy(), expected)
    log.info("SDXL UNet bf16 vs diffusers fp32: rel err %.2e (diffusers bf16: %.2e)", err, ref_err)
    assert err <= 1.5 * ref_err


def test_conv_projection_unet_matches_diffusers(tmp_path):
    """An SD1.5-shaped variant built here: 1x1-conv proj_in/proj_out, no addition embeddings, int head
    counts, cross-attention first on the way down, an odd latent size (upsampling to the skip's size),
    per-sample timesteps, scale_shift resnets, a mid-block scale factor, tiled attention."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    ref = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        mid_block_type="UNetMidBlock2DCrossAttn",
        attention_head_dim=4,
        cross_attention_dim=24,
        use_linear_projection=False,
        norm_num_groups=16,
        transformer_layers_per_block=2,
        resnet_time_scale_shift="scale_shift",
        mid_block_scale_factor=1.414,
        flip_sin_to_cos=False,
        freq_shift=1,
    ).eval()
    ref.save_pretrained(str(tmp_path))
    settings = AttentionSettings(block_q=64, block_kv=64)  # 17x22 = 374 tokens: several tiles
    ours = load_unet(tmp_path, settings=settings)
    assert ours.add_embedding is None
    assert not ours.config.use_linear_projection

    rs = np.random.RandomState(3)
    sample = rs.randn(2, 4, 17, 22).astype(np.float32)
    context = rs.randn(2, 9, 24).astype(np.float32)
    timesteps = np.array([801.0, 3.0], np.float32)
    expected = torch_forward(ref, sample, timesteps, context)
    out = jitted(ours)(sample, timesteps, context)
    err = rel_err(nchw(out), expected)
    log.info("conv-projection UNet fp32 (17x22 latents): rel err %.2e", err)
    assert err <= 1e-4


def test_only_cross_attention_and_per_layer_depths_match_diffusers(tmp_path):
    """only_cross_attention=True (attn1 attends to the text) reaches the down and up blocks but not the mid
    block (diffusers' UNetMidBlock2DCrossAttn takes no such argument), and per-layer depth lists longer than
    a block's layers are read up to its layer count, as diffusers' blocks read them."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    ref = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=8,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        only_cross_attention=True,
        attention_head_dim=4,
        cross_attention_dim=24,
        norm_num_groups=16,
        transformer_layers_per_block=[[2, 1], [1, 3]],
        reverse_transformer_layers_per_block=[[1, 2, 4], [2, 1, 1]],
    ).eval()
    ref.save_pretrained(str(tmp_path))
    ours = load_unet(tmp_path)
    assert (
        len(ours.mid_block.attentions) == 1
        and not ours.mid_block.attentions[0].transformer_blocks[0].only_cross_attention
    )

    rs = np.random.RandomState(4)
    sample = rs.randn(2, 4, 8, 8).astype(np.float32)
    context = rs.randn(2, 5, 24).astype(np.float32)
    expected = torch_forward(ref, sample, 500.0, context)
    err = rel_err(nchw(jitted(ours)(sample, 500.0, context)), expected)
    log.info("only-cross-attention UNet fp32: rel err %.2e", err)
    assert err <= 1e-4


def test_feed_forward_is_exact_geglu():
    """GEGLU uses the erf GELU: the tanh approximation moves the tiny UNet by only ~3e-5 (under the 1e-4
    bar), so the feed-forward is checked alone, on inputs large enough for the two to differ."""
    from diffusers.models.attention import FeedForward as TorchFeedForward

    from meshserve.models.checkpoints.loading import load_weights
    from meshserve.models.sdxl.unet_2d_condition import FeedForward

    torch.manual_seed(0)
    ref = TorchFeedForward(16, activation_fn="geglu").eval()
    ours = FeedForward(16, dtype=jnp.float32, rngs=nnx.Rngs(0))
    load_weights(ours, {k: v.numpy() for k, v in ref.state_dict().items()})
    x = 4 * np.random.RandomState(0).randn(3, 5, 16).astype(np.float32)
    with torch.no_grad():
        expected = ref(torch.from_numpy(x)).numpy()
    err = rel_err(ours(jnp.asarray(x)), expected)
    log.info("FeedForward (GEGLU) fp32: rel err %.2e", err)
    assert err <= 1e-5


def test_text_time_unet_needs_its_conditioning(unet_folder):
    unet = load_unet(unet_folder)
    sample, context, _, _ = sdxl_inputs(batch=1)
    with pytest.raises(ValueError, match="text_embeds and time_ids"):
        unet(jnp.asarray(sample.transpose(0, 2, 3, 1)), 1.0, jnp.asarray(context))


def test_config_reads_json_and_rejects_what_it_does_not_implement(unet_folder):
    raw = json.loads((unet_folder / "config.json").read_text())
    cfg = UNet2DConditionConfig.from_config(raw)
    assert cfg.transformer_layers_per_block == tuple(raw["transformer_layers_per_block"])
    assert cfg.per_block("cross_attention_dim") == [raw["cross_attention_dim"]] * len(raw["down_block_types"])
    assert cfg.addition_embed_type == "text_time"
    # diffusers' naming quirk: attention_head_dim holds the head counts (heads 2 and 4 here)
    unet = load_unet(unet_folder)
    attn = unet.down_blocks[1].attentions[0].transformer_blocks[0].attn1
    assert attn.heads == raw["attention_head_dim"][1]
    with pytest.raises(ValueError, match="class_embed_type"):
        UNet2DConditionConfig.from_config({**raw, "class_embed_type": "timestep"})
    with pytest.raises(ValueError, match="SimpleCrossAttn"):
        UNet2DConditionConfig.from_config({**raw, "mid_block_type": "UNetMidBlock2DSimpleCrossAttn"})


# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json (the fields that shape the network).
SDXL_BASE = {
    "_class_name": "UNet2DConditionModel", "act_fn": "silu", "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280],
    "cross_attention_dim": 2048, "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4, "layers_per_block": 2,
    "mid_block_type": "UNetMidBlock2DCrossAttn", "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4,
    "projection_class_embeddings_input_dim": 2816, "sample_size": 128, "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], "use_linear_projection": True,
}  # fmt: skip


def test_sdxl_base_config_builds_diffusers_parameter_tree():
    """At full SDXL size (shapes only; diffusers on the meta device): every checkpoint key and shape."""
    from diffusers import UNet2DConditionModel

    from meshserve.models.checkpoints.loading import abstract_module, to_nnx_layout, torch_key
    from meshserve.models.sdxl.unet_2d_condition import UNet2DConditionModel as Ours

    cfg = UNet2DConditionConfig.from_config(SDXL_BASE)
    ours = abstract_module(Ours, cfg, dtype=jnp.bfloat16)
    with torch.device("meta"):
        ref = UNet2DConditionModel(**{k: v for k, v in SDXL_BASE.items() if not k.startswith("_")})
    torch_shapes = {key: tuple(value.shape) for key, value in ref.state_dict().items()}
    flat = nnx.to_flat_state(nnx.state(ours))
    got = {torch_key(path): tuple(var.get_value().shape) for path, var in flat}
    assert sorted(got) == sorted(torch_shapes)
    # Each checkpoint tensor in our layout, as the loader converts it by our leaf's name (zero-strided views:
    # no memory).
    expected = {
        torch_key(path): to_nnx_layout(
            str(path[-1]), np.broadcast_to(np.int8(0), torch_shapes[torch_key(path)])
        ).shape
        for path, _ in flat
    }
    assert {k: v for k, v in got.items() if v != expected[k]} == {}
    assert sum(int(np.prod(s)) for s in got.values()) == 2_567_463_684  # SDXL base's parameter count

"""Repeated blocks under one lax.scan (models/components/block_stack.py) against the same blocks unrolled.

The pipelines stack by default, so every parity test elsewhere (diffusers, layouts, LoRA, caching) runs the
scanned form; these tests hold it to the unrolled form on the same weights, with what reaches into single
blocks: LoRA tables that hold only some blocks' layers, the step caches' first block, T5's head block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshserve.models import load_pipeline
from meshserve.models.components.block_stack import BlockStack, block_at, run_blocks, stack_blocks
from meshserve.models.components.t5 import T5Config, T5EncoderModel
from meshserve.models.flux.transformer_flux import FluxTransformer2DConfig, FluxTransformer2DModel, image_ids
from meshserve.models.lora.pool import adaptable_layers
from meshserve.models.parallel.placement import pipeline_placement
from tests.fixtures.tiny_lora import pipelines_with_adapter

H = W = 32
# The pool's LoRA table holds these layers only: the first double block's (run apart from the scan, as the
# step caches need it) and the second single block's, so the stacked tables are zeros for the other blocks
# (models/lora/apply.py: stacked_adapters).
SOME_BLOCKS = r"^(transformer_blocks\.0|single_transformer_blocks\.1)\.(attn\.to_[qv]|proj_mlp|ff\.net\.2)$"


def max_abs(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


def _flux_model(layers=3, single=4, seed=0):
    config = FluxTransformer2DConfig(
        in_channels=8, num_layers=layers, num_single_layers=single, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=12, pooled_projection_dim=10, guidance_embeds=True, axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    return FluxTransformer2DModel(config, rngs=nnx.Rngs(seed))


def _flux_inputs(model, tokens=16, text=5):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, tokens, 8)), jnp.float32)
    context = jnp.asarray(rng.standard_normal((2, text, 12)), jnp.float32)
    pooled = jnp.asarray(rng.standard_normal((2, 10)), jnp.float32)
    rope = model.rope(np.zeros((text, 3)), image_ids(8, 8)[:tokens])
    return x, context, pooled, jnp.asarray([0.3, 0.7]), rope, jnp.asarray([3.5, 3.5])


def _dots(model, inputs) -> int:
    graph, state = nnx.split(model)
    text = jax.jit(lambda s, *a: nnx.merge(graph, s)(*a)).lower(state, *inputs).as_text()
    return text.count("stablehlo.dot_general")


def test_flux_stacked_equals_unrolled_and_compiles_one_block():
    unrolled = _flux_model()
    inputs = _flux_inputs(unrolled)
    expected = unrolled(*inputs)
    dots_unrolled = _dots(unrolled, inputs)
    stacked = stack_blocks(nnx.clone(unrolled), consume=False)
    assert isinstance(stacked.transformer_blocks, BlockStack) and len(stacked.transformer_blocks) == 3
    assert stacked.single_transformer_blocks.stacked.attn.to_q.kernel.shape[0] == 4
    assert max_abs(stacked(*inputs), expected) <= 1e-5
    # The first double block runs apart (the step caches read it), the others' body once: 3 blocks' dots in
    # the program instead of 7.
    dots_stacked = _dots(stacked, inputs)
    per_double = (dots_unrolled - _dots(_flux_model(layers=1, single=4), inputs)) // 2
    per_single = (dots_unrolled - _dots(_flux_model(layers=3, single=1), inputs)) // 3
    assert dots_stacked == dots_unrolled - per_double - 3 * per_single, (dots_stacked, dots_unrolled)


def test_t5_keeps_its_first_block_apart_and_umt5_stacks_all():
    base = dict(vocab_size=40, d_model=16, d_kv=4, d_ff=24, num_layers=3, num_heads=4,
                relative_attention_num_buckets=8, relative_attention_max_distance=16, layer_norm_epsilon=1e-6,
                feed_forward_proj="gated-gelu")  # fmt: skip
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 7)))
    mask = jnp.asarray([[1] * 7, [1] * 4 + [0] * 3])
    for model_type, head in (("t5", 1), ("umt5", 0)):
        unrolled = T5EncoderModel(T5Config(**base, model_type=model_type), rngs=nnx.Rngs(0))
        expected = unrolled(ids, mask).last_hidden_state
        stacked = stack_blocks(nnx.clone(unrolled), consume=False)
        blocks = stacked.encoder.block
        assert isinstance(blocks, BlockStack) and (len(blocks.head), blocks.size) == (head, 3 - head)
        assert max_abs(stacked(ids, mask).last_hidden_state, expected) <= 1e-5, model_type


def test_run_blocks_and_block_at_on_both_forms():
    unrolled = _flux_model(layers=1, single=3)
    stacked = stack_blocks(nnx.clone(unrolled), consume=False)
    x = jnp.ones((1, 6, unrolled.config.inner_dim))
    temb = jnp.ones((1, unrolled.config.inner_dim))
    rope = tuple(jnp.zeros((6, 8)) for _ in range(2))

    def step(block, x):
        return block(x, temb, rope)

    for start in (0, 1, 2, 3):  # eager blocks against the scan's fusions: fp32 rounding apart
        got = run_blocks(stacked.single_transformer_blocks, step, x, start=start)
        assert max_abs(got, run_blocks(unrolled.single_transformer_blocks, step, x, start=start)) <= 1e-5
    for i in range(3):
        a = block_at(stacked.single_transformer_blocks, i).proj_mlp.kernel
        assert np.array_equal(a, unrolled.single_transformer_blocks[i].proj_mlp.kernel)


def test_adaptable_layers_keep_the_checkpoint_names():
    unrolled = _flux_model()
    stacked = stack_blocks(nnx.clone(unrolled), consume=False)
    assert adaptable_layers(stacked) == adaptable_layers(unrolled)


def test_placement_puts_the_stacked_axis_unsplit():
    from jax.sharding import PartitionSpec as P

    from meshserve.models.flux.transformer_flux import SHARDING_RULES

    placement = pipeline_placement({"tensor": 2}, [0, 1])["placement"]
    key = "transformer_blocks.stacked.attn.to_q.weight"
    assert placement.param_spec(SHARDING_RULES, key, (5, 16, 32)) == P(None, None, "tensor")
    assert placement.param_spec(SHARDING_RULES, key.replace("stacked", "3"), (16, 32)) == P(None, "tensor")


def test_blocks_that_differ_after_the_head_are_refused():
    model = _flux_model(layers=2, single=1)
    double, single = model.transformer_blocks, model.single_transformer_blocks
    model.transformer_blocks = nnx.List([double[0], single[0], double[1]])
    with pytest.raises(ValueError, match="different structures"):
        stack_blocks(model, consume=False)


# --------------------------------------------------------------------------------------------------
# Pipelines: the scanned (default) and unrolled forms of one checkpoint


@pytest.fixture(scope="module")
def flux_pair(tiny_flux_dev_path, tmp_path_factory):
    import torch
    from diffusers import FluxTransformer2DModel as TorchFlux

    reference = TorchFlux.from_pretrained(str(tiny_flux_dev_path / "transformer"), torch_dtype=torch.float32)
    pool = dict(max_loras=1, max_lora_rank=4, lora_budget_mb=1, lora_targets=SOME_BLOCKS)
    adapter = tmp_path_factory.mktemp("lora") / "a.safetensors"
    variants = ({"scan_blocks": True}, {"scan_blocks": False})
    return pipelines_with_adapter(
        tiny_flux_dev_path,
        reference,
        SOME_BLOCKS,
        adapter,
        prefix="transformer",
        seed=5,
        variants=variants,
        **pool,
    )


def test_flux_pipeline_scanned_equals_unrolled(flux_pair):
    scanned, unrolled = flux_pair
    paths = [".".join(map(str, path)) for path, _ in nnx.to_flat_state(scanned._states["transformer"])]
    assert any(".stacked." in path for path in paths) and not any(".stacked." in path for path in
               (".".join(map(str, p)) for p, _ in nnx.to_flat_state(unrolled._states["transformer"])))  # fmt: skip
    kw = dict(height=H, width=W, num_inference_steps=3, seed=4, output_type="np")
    for extra in (
        {},
        {"loras": [{"name": "a", "scale": 0.8}]},
        {"cache": {"method": "first_block", "threshold": 1.0}},
    ):
        a, b = (pipe("a red circle", **kw, **extra) for pipe in (scanned, unrolled))
        assert max_abs(a.images, b.images) <= 1e-5, extra
    with_lora = scanned("a red circle", **kw, loras=[{"name": "a", "scale": 0.8}]).images
    assert max_abs(with_lora, scanned("a red circle", **kw).images) > 1e-3  # the adapter reached the blocks


def test_wan_pipeline_scanned_equals_unrolled(tiny_wan_path):
    kw = dict(height=H, width=W, num_frames=5, num_inference_steps=3, seed=2, output_type="np")
    scanned, unrolled = (load_pipeline(tiny_wan_path, scan_blocks=scan) for scan in (True, False))
    for extra in ({}, {"cache": {"method": "teacache", "threshold": 1.0}}):
        a, b = (pipe("a red circle moving left", **kw, **extra) for pipe in (scanned, unrolled))
        assert max_abs(a.images, b.images) <= 1e-5, extra


def _all_gathered_shapes(gather_stacks_whole: bool, monkeypatch) -> set[tuple[int, ...]]:
    """The result shapes of the all-gathers in a tiny Flux forward with FSDP over 4 devices, its blocks
    stacked: as the engine gathers (one block at a time, inside the scan), or with the stacks gathered whole."""
    import re

    from meshserve.models.flux.transformer_flux import SHARDING_RULES
    from meshserve.models.parallel import placement as placement_module

    if gather_stacks_whole:
        monkeypatch.setattr(placement_module, "_gathers", lambda path, var: isinstance(var, nnx.Variable))
    placement = pipeline_placement({"context": 4}, [0, 1, 2, 3], weights={"shard_over": ["context"]})[
        "placement"
    ]
    model = stack_blocks(_flux_model(layers=3, single=4), consume=False)
    graph, state = nnx.split(model)
    place = placement.placer(SHARDING_RULES)  # as load_weights places a pipeline's weights
    state = nnx.State.from_flat_path(
        [(path, var.replace(place(path, var.get_value()))) for path, var in state.flat_state()]
    )

    def forward(state, *inputs):
        weights = placement.gather_weights(state, SHARDING_RULES)
        module = nnx.merge(graph, weights)
        return (module if gather_stacks_whole else placement.gather_blocks(module, SHARDING_RULES))(*inputs)

    hlo = jax.jit(forward).lower(state, *_flux_inputs(model)).compile().as_text()
    return {
        tuple(int(d) for d in m.split(",")) for m in re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} all-gather", hlo)
    }


def test_fsdp_gathers_one_block_at_a_time(monkeypatch):
    """With FSDP, a stack's weights are gathered block by block where each runs, never the whole stack at once
    (which would hold every block's weights on every device): no all-gather has a stack's leading axis."""
    stacked_axes = {3, 4}  # 3 double blocks (the first read apart), 4 single
    whole = _all_gathered_shapes(True, monkeypatch)
    assert any(len(s) == 3 and s[0] in stacked_axes for s in whole), whole  # the check can fail
    monkeypatch.undo()
    per_block = _all_gathered_shapes(False, monkeypatch)
    assert per_block and not any(len(s) == 3 and s[0] in stacked_axes for s in per_block), per_block


def test_a_pools_scan_blocks_reaches_load_pipeline():
    from meshserve.workers.config import ModelSpec, PoolConfig
    from meshserve.workers.pool import runner_options

    unrolled = PoolConfig(name="p", models=["m"], scan_blocks=False)
    assert runner_options(unrolled, ModelSpec())["scan_blocks"] is False
    assert "scan_blocks" not in runner_options(PoolConfig(name="p", models=["m"]), ModelSpec())  # the default

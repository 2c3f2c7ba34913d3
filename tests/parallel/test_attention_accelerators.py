"""The accelerator paths of attention, checked as far as 8 CPU devices allow (issue 19 §3).

- cuDNN: the arguments models/attention/cudnn.py builds go through jax's own cuDNN path, i.e. its trace-time
  checks (`check_layout`, `check_is_flash_attention`) and its CUDA lowering, by exporting for "cuda" with
  `jax.export` on this CPU host (cuDNN's version query is faked: it is the only step that needs a GPU). The
  mask mapping used before, `[B, 1, 1, Sk]`, fails here with the error an H100 gave. What runs is checked
  against the reference through the same call with implementation="xla".
- splash: runs inside shard_map on each device's block (Mosaic kernels can't be partitioned by XLA), in
  Pallas interpret mode on an 8-device mesh, against the reference.
- The context strategy chosen per platform (a GPU keeps cuDNN), and ring/hybrid running cuDNN with its
  log-sum-exp.
"""

from __future__ import annotations

import re

import jax
import jax._src.cudnn.fused_attention_stablehlo as cudnn_lib
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import meshserve.models.attention.dispatch as dispatch
import meshserve.models.attention.kernels as kernels
from meshserve.models.attention import AttentionSettings, attention
from meshserve.models.attention.context import select_strategy
from meshserve.models.attention.cudnn import cudnn_attention
from meshserve.models.attention.reference import reference_attention
from meshserve.models.attention.splash import splash_attention
from meshserve.models.parallel.mesh import MeshSizes, make_mesh

_reference = jax.jit(reference_attention, static_argnames=("causal", "scale", "return_lse"))


def _rand(seed, *shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _prefix_mask(lengths, sk):
    """Keys padded at the end, as tokenizers and context padding make them: row i sees its first lengths[i]."""
    return jnp.arange(sk)[None, :] < jnp.asarray(lengths)[:, None]


def _max_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape and np.all(np.isfinite(a)), (a.shape, b.shape)
    return float(np.max(np.abs(a - b)))


# --- cuDNN: jax's own checks and CUDA lowering, on the CPU ---------------------------------------------------

_CUDNN_CALLS = sorted(set(cudnn_lib._custom_name_maps.values()))


@pytest.fixture
def cudnn_present(monkeypatch):
    """Pretend cuDNN 9.8 is installed: jax's cuDNN path asks for the version first and raises without a GPU;
    everything after it (argument checks, abstract evaluation, the CUDA lowering rule) runs on any host."""
    monkeypatch.setattr(cudnn_lib, "check_cudnn_version", lambda: 90800)


def _lower_for_cuda(fn, *args):
    """The StableHLO jax would hand XLA:GPU for fn(*args): jax's cuDNN checks run while tracing."""
    exported = export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(name) for name in _CUDNN_CALLS],
    )(*args)
    return exported.mlir_module()


def _cudnn_calls(module: str) -> list[tuple[str, str]]:
    """(mask type, operand types) of every cuDNN custom call in a lowered module."""
    calls = []
    for line in module.splitlines():
        if re.search(r"custom_call @__cudnn\$fmha", line):
            mask = re.search(r"mask_type\\22: \\22(\w+)", line).group(1)
            operands = re.search(r"\} : \((.*?)\) ->", line).group(1)
            calls.append((mask, operands))
    return calls


B, SQ, SK, H, D = 2, 128, 77, 4, 64  # 77: CLIP's text tokens, the length of the H100 report


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "kv_mask"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out+lse"])
def test_cudnn_arguments_pass_jax_cudnn_checks_and_lower_for_cuda(cudnn_present, masked, causal, return_lse):
    sq = SK if causal else SQ  # causal runs on cuDNN only with Sq == Sk (kernels.select_kernel)
    q = jax.ShapeDtypeStruct((B, sq, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, SK, H, D), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((B, SK), jnp.bool_)

    def call(q, k, v, m):
        return cudnn_attention(
            q, k, v, causal=causal, kv_mask=m if masked else None, scale=0.3, return_lse=return_lse
        )

    shapes = jax.eval_shape(call, q, kv, kv, mask)
    expected = ((B, sq, H, D), (B, sq, H)) if return_lse else ((B, sq, H, D),)
    assert tuple(s.shape for s in jax.tree.leaves(shapes)) == expected
    calls = _cudnn_calls(_lower_for_cuda(call, q, kv, kv, mask))
    mask_type = {(False, False): "NO_MASK", (False, True): "CAUSAL", (True, False): "PADDING"}
    mask_type[(True, True)] = "PADDING_CAUSAL"
    assert [c[0] for c in calls] == [mask_type[(masked, causal)]]


def test_a_broadcast_mask_is_what_cudnn_refused(cudnn_present):
    """The harness above catches the H100 failure: the mapping used before (a boolean mask broadcast as
    [B, 1, 1, Sk]) raises jax's own error, under causal masking too."""
    q = jax.ShapeDtypeStruct((B, SK, H, D), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((B, SK), jnp.bool_)
    for causal in (False, True):

        def before(q, k, v, m, causal=causal):
            return jax.nn.dot_product_attention(
                q, k, v, mask=m[:, None, None, :], is_causal=causal, implementation="cudnn"
            )

        with pytest.raises(ValueError, match="Bias must have same seq length as QKV, got 1 and 77"):
            jax.eval_shape(before, q, q, q, mask)


# (mesh, strategy, heads, expected cuDNN operand shapes q / k): Flux at 1008x1008 on context=2 has a token count
# that does not divide (4481), so context parallelism pads and creates a kv_mask; 129 tokens here.
LOWERED = [
    # auto on a GPU, 1 head per tensor shard over context 2: allgather, local queries x all (padded) keys.
    ("auto", MeshSizes(data=2, context=2, tensor=2), 2, "1x65x1x64", "1x130x1x64", ["PADDING"]),
    ("ulysses", MeshSizes(cfg=2, context=4), 4, "1x132x1x64", "1x132x1x64", ["PADDING"]),
    # ring keeps cuDNN for its chunks (the local one and the received ones: one call each in the program)
    ("ring", MeshSizes(cfg=2, context=4), 4, "1x33x4x64", "1x33x4x64", ["PADDING", "PADDING"]),
    # no context axis: cuDNN inside shard_map on the device's batch and heads
    ("auto", MeshSizes(data=2, cfg=2, tensor=2), 4, "1x129x2x64", "1x129x2x64", ["NO_MASK"]),
]


@pytest.mark.parametrize("strategy,sizes,heads,q_shape,k_shape,masks", LOWERED, ids=lambda p: str(p))
def test_cudnn_in_sharded_programs_lowers_for_cuda(
    cudnn_present, monkeypatch, strategy, sizes, heads, q_shape, k_shape, masks
):
    """The whole entry point on a faked GPU, lowered for "cuda": every cuDNN call gets per-device blocks and
    the padding kv_mask as lengths."""
    monkeypatch.setattr(dispatch, "platform_of", lambda settings: "cuda")
    settings = AttentionSettings(mesh=make_mesh(sizes), context_strategy=strategy, allgather_max_kv=100)
    spec = jax.ShapeDtypeStruct((2, 129, heads, D), jnp.bfloat16)
    calls = _cudnn_calls(
        _lower_for_cuda(lambda q, k, v: attention(q, k, v, settings=settings), spec, spec, spec)
    )
    assert [c[0] for c in calls] == masks
    for _, operands in calls:
        q_type, k_type = operands.split(", ")[:2]
        assert q_type == f"tensor<{q_shape}xbf16>" and k_type == f"tensor<{k_shape}xbf16>", operands


# --- cuDNN's mapping, run through the xla implementation -----------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_lse_mapping_through_the_xla_implementation(causal):
    """return_lse: what ring merges by. A row whose keys are all masked gives 0 and -inf, like the reference."""
    sq = sk = 96
    q, k, v = _rand(1, B, sq, H, 16), _rand(2, B, sk, H, 16), _rand(3, B, sk, H, 16)
    kv_mask = _prefix_mask([sk - 20, 0], sk)
    out, lse = jax.jit(
        lambda q, k, v, m: cudnn_attention(
            q, k, v, causal=causal, kv_mask=m, scale=0.3, return_lse=True, implementation="xla"
        )
    )(q, k, v, kv_mask)
    ref_out, ref_lse = _reference(q, k, v, causal=causal, kv_mask=kv_mask, scale=0.3, return_lse=True)
    assert _max_err(out, ref_out) <= 1e-5
    assert lse.dtype == jnp.float32 and bool(jnp.all(jnp.isneginf(lse[1])))
    assert _max_err(lse[0], ref_lse[0]) <= 1e-5


@pytest.fixture
def gpu_with_cudnn_on_cpu(monkeypatch):
    """A faked GPU whose cuDNN kernel is the same mapping through implementation="xla"; records its calls."""
    calls = []

    def cudnn_on_cpu(q, k, v, **kwargs):
        calls.append(dict(kwargs, q_shape=q.shape, k_shape=k.shape))
        return cudnn_attention(q, k, v, implementation="xla", **kwargs)

    monkeypatch.setattr(dispatch, "platform_of", lambda settings: "cuda")
    monkeypatch.setattr(kernels, "cudnn_attention", cudnn_on_cpu)
    return calls


def _bf16_case(s, heads, b=2):
    q, k, v = (_rand(seed, b, s, heads, 16, dtype=jnp.bfloat16) for seed in (4, 5, 6))
    return q, k, v, _prefix_mask([90, s][:b], s)


def _against_reference(out, q, k, v, **kwargs):
    ref = _reference(*(x.astype(jnp.float32) for x in (q, k, v)), **kwargs)
    return _max_err(out.astype(jnp.float32), ref)


RING_ON_GPU = [("ring", 4, None), ("hybrid", 8, 2)]


@pytest.mark.parametrize("strategy,degree,ulysses_degree", RING_ON_GPU, ids=["ring-4", "hybrid-8-u2"])
def test_ring_and_hybrid_keep_cudnn_with_its_log_sum_exp(
    gpu_with_cudnn_on_cpu, strategy, degree, ulysses_degree
):
    """Non-causal ring/hybrid on a GPU run cuDNN per chunk (return_lse) and merge by the log-sum-exp, instead of
    falling back to xla_blockwise. 130 tokens over 4/8 devices: padded, so the chunks carry a kv_mask; row 0
    sees 90 keys, so its last ring block (99.. of 132, 102.. of 136) has no key at all. bf16 in and out
    (cuDNN's dtypes): tolerance 2e-2."""
    calls = gpu_with_cudnn_on_cpu
    sizes = MeshSizes(cfg=2, context=4) if degree == 4 else MeshSizes(context=8)
    settings = AttentionSettings(
        mesh=make_mesh(sizes), context_strategy=strategy, ulysses_degree=ulysses_degree, allgather_max_kv=64
    )
    q, k, v, kv_mask = _bf16_case(130, 4)
    run = jax.jit(lambda q, k, v, m: attention(q, k, v, kv_mask=m, settings=settings))
    out = run(q, k, v, kv_mask)
    assert calls and all(c["return_lse"] for c in calls)
    assert _against_reference(out, q, k, v, kv_mask=kv_mask) <= 2e-2
    # Causal: chunk positions matter, which cuDNN can't take: xla_blockwise runs, cuDNN is not called.
    calls.clear()
    causal = jax.jit(lambda q, k, v, m: attention(q, k, v, causal=True, kv_mask=m, settings=settings))
    assert _against_reference(causal(q, k, v, kv_mask), q, k, v, causal=True, kv_mask=kv_mask) <= 2e-2
    assert not calls


# --- the strategy "auto" picks, by platform ---------------------------------------------------------------------


def test_auto_strategy_by_platform():
    def pick(platform, local_heads=2, context=4, kernel="cudnn", causal=False, sk=4096):
        return select_strategy(
            "auto",
            context=context,
            local_heads=local_heads,
            sk=sk,
            short_kv=1024,
            platform=platform,
            kernel=kernel,
            causal=causal,
        )

    assert pick("cuda", sk=77) == "allgather"  # short K/V: everywhere
    assert pick("cuda", local_heads=8) == "ulysses"  # heads divide: everywhere, cuDNN kept
    assert pick("cuda") == "allgather"  # heads don't divide: cuDNN on local queries x all keys
    assert pick("cuda", kernel="xla_blockwise") == "ring"  # fp32 or head dim > 128: no cuDNN to keep
    assert pick("cuda", causal=True) == "ring"  # causal chunks need positions: no cuDNN either way
    for platform, kernel in (("cpu", "xla_blockwise"), ("rocm", "xla_blockwise"), ("tpu", "splash")):
        assert pick(platform, kernel=kernel) == "ring"
        assert pick(platform, kernel=kernel, local_heads=8) == "ulysses"
    assert (
        select_strategy("ring", context=4, local_heads=2, sk=4096, short_kv=1024, platform="cuda") == "ring"
    )


def test_auto_on_a_gpu_gathers_kv_for_one_cudnn_call(gpu_with_cudnn_on_cpu):
    """4 heads over context 8 (heads don't divide): on a GPU "auto" all-gathers K/V and cuDNN runs once per
    device on its 17 local queries against all 136 (padded) keys; on the CPU the same call is a ring."""
    calls = gpu_with_cudnn_on_cpu
    settings = AttentionSettings(mesh=make_mesh(MeshSizes(context=8)), allgather_max_kv=64)
    q, k, v, kv_mask = _bf16_case(130, 4)
    out = jax.jit(lambda q, k, v, m: attention(q, k, v, kv_mask=m, settings=settings))(q, k, v, kv_mask)
    assert [(c["q_shape"], c["k_shape"], c.get("return_lse", False)) for c in calls] == [
        ((2, 17, 4, 16), (2, 136, 4, 16), False)
    ]
    assert _against_reference(out, q, k, v, kv_mask=kv_mask) <= 2e-2


# --- splash inside shard_map, in Pallas interpret mode -----------------------------------------------------------


def test_splash_runs_on_each_devices_block_inside_shard_map(monkeypatch):
    """No context axis, batch over data, heads over tensor: splash (interpret mode) must be called inside
    shard_map on the local block; on the global arrays a TPU compile fails ("Mosaic kernels cannot be
    automatically partitioned"). The recording kernel raises when it is not given a per-device block."""
    mesh = make_mesh(MeshSizes(data=2, cfg=2, tensor=2))
    seen = []

    def local_splash(q, k, v, **kwargs):
        manual = set(jax.sharding.get_abstract_mesh().manual_axes)
        if manual != set(mesh.axis_names):
            raise AssertionError(f"splash called outside shard_map on {q.shape} (manual axes {manual})")
        seen.append((q.shape, k.shape))
        return splash_attention(q, k, v, interpret=True, **kwargs)

    monkeypatch.setattr(dispatch, "platform_of", lambda settings: "tpu")
    monkeypatch.setattr(kernels, "splash_attention", local_splash)
    settings = AttentionSettings(mesh=mesh, block_q=128, block_kv=128)
    q, k, v = _rand(7, 4, 200, 4, 16), _rand(8, 4, 77, 4, 16), _rand(9, 4, 77, 4, 16)
    kv_mask = _prefix_mask([70, 77, 0, 30], 77)
    out = jax.jit(lambda q, k, v, m: attention(q, k, v, kv_mask=m, settings=settings))(q, k, v, kv_mask)
    # batch 4 over data x cfg = 4, heads 4 over tensor = 2
    assert seen == [((1, 200, 2, 16), (1, 77, 2, 16))]
    assert _max_err(out, _reference(q, k, v, kv_mask=kv_mask)) <= 1e-5

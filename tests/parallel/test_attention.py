"""The attention entry point on 8 CPU devices: every kernel that runs here x every context strategy x context
degree x lengths that divide and don't x masks x self/cross attention, against the reference (fp32, <= 1e-5).

Kernels that cannot run here are checked as far as the CPU allows: cudnn's argument mapping through the same
jax call with implementation="xla", splash through Pallas interpret mode, and both kernels' selection with a
faked platform; tests/parallel/test_attention_accelerators.py has the rest (cuDNN's own checks and CUDA lowering,
splash inside shard_map, the strategy chosen on a GPU).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshserve.models.attention.dispatch as dispatch
import meshserve.models.attention.kernels as kernels
from meshserve.models.attention import AttentionSettings, attention
from meshserve.models.attention.blockwise import MIN_BLOCK, fit_blocks, xla_blockwise
from meshserve.models.attention.chunked import MAX_CHUNKS, chunk_rows, xla_chunked
from meshserve.models.attention.context import select_strategy
from meshserve.models.attention.cudnn import cudnn_attention
from meshserve.models.attention.hybrid import hybrid_degrees
from meshserve.models.attention.reference import reference_attention
from meshserve.models.attention.ring import ring_pieces
from meshserve.models.attention.splash import splash_attention
from meshserve.models.attention.ulysses import head_groups
from meshserve.models.cpu import fused_attention
from meshserve.models.parallel.mesh import LayoutError, MeshSizes, make_mesh

TOL = 1e-5
B, H, D = 2, 4, 16


def _rand(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _mask(seed, b, s, p_keep=0.7):
    return jnp.asarray(np.random.default_rng(seed).random((b, s)) < p_keep)


def _qkv(seed, sq, sk, b=B, h=H):
    return _rand(seed, b, sq, h, D), _rand(seed + 1, b, sk, h, D), _rand(seed + 2, b, sk, h, D)


# Jitted so each reference shape compiles once (and lands in the persistent cache) instead of op by op.
_reference = jax.jit(reference_attention, static_argnames=("causal", "scale", "return_lse"))


def _max_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape and np.all(np.isfinite(a)), (a.shape, b.shape)
    return float(np.max(np.abs(a - b)))


# --- the reference itself, against float64 numpy ------------------------------------------------------------


def _numpy_attention(q, k, v, causal, kv_mask):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    sq, sk = q.shape[1], k.shape[1]
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    ok = np.ones((1, 1, sq, sk), bool)
    if causal:
        ok = ok & (np.arange(sq)[:, None] + sk - sq >= np.arange(sk)[None, :])
    if kv_mask is not None:
        ok = ok & np.asarray(kv_mask)[:, None, None, :]
    s = np.where(ok, s, -np.inf)
    row_max = np.max(s, -1, keepdims=True)
    w = np.exp(s - np.where(np.isfinite(row_max), row_max, 0.0))  # rows with no visible key: all 0
    w = w / np.maximum(w.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bhqk,bkhd->bqhd", w, v)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_numpy_including_fully_masked_rows(causal):
    q, k, v = _qkv(0, 40, 56)
    mask = _mask(3, B, 56).at[1].set(False)  # batch row 1 may see nothing: output 0, not NaN
    out = reference_attention(q, k, v, causal=causal, kv_mask=mask)
    assert _max_err(out, _numpy_attention(q, k, v, causal, mask)) <= TOL
    assert np.all(np.asarray(out[1]) == 0)


# --- xla_blockwise on one device ----------------------------------------------------------------------------

MASKS = ["none", "causal", "kv_mask", "causal+kv_mask"]


@pytest.mark.parametrize("sq,sk", [(128, 128), (130, 130), (100, 77), (45, 150)])
@pytest.mark.parametrize("masks", MASKS)
def test_blockwise_matches_reference(sq, sk, masks):
    q, k, v = _qkv(sq + sk, sq, sk)
    causal = "causal" in masks
    kv_mask = _mask(7, B, sk) if "kv_mask" in masks else None
    fn = jax.jit(
        lambda q, k, v, m: xla_blockwise(
            q, k, v, causal=causal, kv_mask=m, block_q=32, block_kv=24, return_lse=True
        )
    )
    out, lse = fn(q, k, v, kv_mask)
    ref, ref_lse = _reference(q, k, v, causal=causal, kv_mask=kv_mask, return_lse=True)
    assert _max_err(out, ref) <= TOL
    assert np.array_equal(np.isfinite(lse), np.isfinite(ref_lse))  # the same rows saw no key
    assert (
        _max_err(jnp.where(jnp.isfinite(ref_lse), lse, 0), jnp.where(jnp.isfinite(ref_lse), ref_lse, 0))
        <= TOL
    )


def _largest_buffer(hlo_text: str) -> tuple[int, str]:
    """Elements of the largest array shape anywhere in an HLO module (parameters, temporaries, outputs)."""
    best = (0, "")
    for dims in re.findall(r"[a-z]+[0-9]*\[([0-9,]+)\]", hlo_text):
        size = int(np.prod([int(d) for d in dims.split(",")]))
        best = max(best, (size, dims))
    return best


def test_blockwise_program_never_holds_the_score_matrix():
    s, block = 4096, 512
    spec = jax.ShapeDtypeStruct((1, s, 1, 64), jnp.float32)

    def compiled_hlo(fn):
        return jax.jit(fn).lower(spec, spec, spec).compile().as_text()

    # The detector finds the [1, 1, S, S] scores in the reference's program, so its silence below means
    # something.
    ref_size, ref_dims = _largest_buffer(
        compiled_hlo(lambda q, k, v: reference_attention(q, k, v, causal=True))
    )
    assert ref_size >= s * s, ref_dims
    size, dims = _largest_buffer(
        compiled_hlo(lambda q, k, v: xla_blockwise(q, k, v, causal=True, block_q=block, block_kv=block))
    )
    assert size < s * s // 8, f"largest buffer [{dims}] is within 8x of the {s}x{s} score matrix"
    assert size <= max(block * block, s * 64), dims  # one score tile, or one q/k/v/out array


# --- xla_chunked (the CPU's kernel for short sequences) on one device ----------------------------------------


@pytest.mark.parametrize("b", [1, B])
@pytest.mark.parametrize("sq,sk", [(128, 128), (300, 300), (100, 77), (45, 150), (5, 9)])
@pytest.mark.parametrize("masks", MASKS)
def test_chunked_matches_reference(b, sq, sk, masks):
    """Chunks of 128 queries and a remainder (300), cross-attention, fewer rows than a chunk, one batch row
    (called directly) and several (lax.map), and a batch row that may see no key (output 0)."""
    q, k, v = _qkv(sq + 3 * sk, sq, sk, b=b)
    causal = "causal" in masks
    kv_mask = _mask(5, b, sk) if "kv_mask" in masks else None
    if kv_mask is not None:
        kv_mask = kv_mask.at[b - 1].set(False)
    out = jax.jit(lambda q, k, v, m: xla_chunked(q, k, v, causal=causal, kv_mask=m))(q, k, v, kv_mask)
    assert _max_err(out, _reference(q, k, v, causal=causal, kv_mask=kv_mask)) <= TOL
    if kv_mask is not None:
        assert np.all(np.asarray(out[b - 1]) == 0)


def test_chunked_takes_only_calls_whose_score_tile_is_small():
    assert chunk_rows(4, 1152, 1152) == 128  # Flux at 512x512: 9 chunks of 128
    assert chunk_rows(2, 256, 77) == 128
    assert chunk_rows(2, 5, 9) == 5
    assert chunk_rows(1, 128 * MAX_CHUNKS, 4096) == 128
    assert chunk_rows(1, 128 * MAX_CHUNKS + 1, 4096) is None  # more chunks than MAX_CHUNKS
    assert chunk_rows(10, 4096, 4096) is None  # SDXL's 1024x1024 level 2: 48 rows a chunk, 86 chunks
    assert chunk_rows(40, 1024, 32760) is None  # Wan 14B's video: not one row fits
    with pytest.raises(ValueError, match="do not fit"):
        xla_chunked(*_qkv(0, 8192, 8192, b=1, h=1))
    # What the kernel refuses runs as xla_blockwise: a log-sum-exp (ring), causal positions, a large tile.
    q, k, v = _qkv(11, 64, 64)
    settings = AttentionSettings(kernel="xla_chunked")
    out, lse = kernels.run_kernel(
        "xla_chunked", q, k, v, causal=False, kv_mask=None, scale=None, settings=settings, return_lse=True
    )
    ref, ref_lse = _reference(q, k, v, causal=False, kv_mask=None, return_lse=True)
    assert _max_err(out, ref) <= TOL and _max_err(lse, ref_lse) <= TOL
    out = kernels.run_kernel(
        "xla_chunked", q, k, v, causal=True, kv_mask=None, scale=None, settings=settings, q_offset=32
    )
    assert _max_err(out, _reference(q, k, v, causal=True, kv_mask=None, q_offset=32)) <= TOL


def test_mesh_free_batches_take_a_local_kernel_only_where_nothing_can_be_sharded(monkeypatch):
    """With mesh-free settings a batch of several rows may be sharded over this process's 8 devices (a pool's
    text encoders and VAE), where xla_chunked's loop over the rows, or cpu_fused's custom call, would gather
    it: those calls run xla_blockwise. One row, or a mesh (inside shard_map), keeps the local kernel."""
    assert jax.device_count() > 1
    chosen = []
    run = dispatch.run_local_kernel

    def record(name, *args, **kwargs):
        chosen.append(name)
        return run(name, *args, **kwargs)

    monkeypatch.setattr(dispatch, "run_local_kernel", record)
    for b in (1, B):
        q, k, v = _qkv(13, 64, 64, b=b)
        out = attention(q, k, v)
        assert _max_err(out, _reference(q, k, v, causal=False, kv_mask=None)) <= TOL
    q, k, v = _qkv(13, 64, 64)
    attention(q, k, v, settings=AttentionSettings(mesh=make_mesh(MeshSizes(data=2), jax.devices()[:2])))
    local = "cpu_fused" if fused_attention.available() else "xla_chunked"
    assert chosen == [local, "xla_blockwise", local]


# --- context parallelism on the 8 CPU devices ---------------------------------------------------------------

# degree -> a mesh that also puts the batch on data/cfg and heads on tensor where devices are left over.
MESHES = {
    2: MeshSizes(data=2, context=2, tensor=2),
    4: MeshSizes(cfg=2, context=4),
    8: MeshSizes(context=8),
}
# (name, sq, sk, causal, kv_mask): lengths that divide every degree (128) and that don't (130, 100, 150, 77),
# self-attention, cross-attention with K/V sharded (> allgather_max_kv tokens) and replicated (77 text
# tokens). Causal and kv_mask appear alone and together.
CASES = [
    ("self-divides", 128, 128, False, False),
    ("self-pad-kv_mask", 130, 130, False, True),
    ("cross-sharded-pad-causal", 100, 150, True, False),
    ("self-pad-causal+kv_mask", 130, 130, True, True),
    ("cross-sharded-pad-kv_mask", 150, 130, False, True),
    ("cross-text-kv_mask", 130, 77, False, True),
]
LAYOUT_CASES = CASES[:3]  # every layout; the other three in test_context_parallel_more_cases
ALLGATHER_MAX_KV = 100  # below 128/130/150 so those K/V get sharded; 77 text tokens stay replicated


def _run_cases(settings, kernel_cases=LAYOUT_CASES, h=H):
    """All cases in one jitted program (one compile per layout), each against the reference."""
    inputs = []
    for i, (_, sq, sk, _, masked) in enumerate(kernel_cases):
        # Key 0 of batch row 0 off: with causal masking, query 0 of that row then sees no key at all.
        mask = _mask(10 * i + 5, B, sk).at[0, 0].set(False) if masked else None
        inputs.append((*_qkv(10 * i, sq, sk, h=h), mask))

    @jax.jit
    def run(inputs):
        return [
            attention(q, k, v, causal=case[3], kv_mask=m, settings=settings)
            for case, (q, k, v, m) in zip(kernel_cases, inputs, strict=True)
        ]

    for case, out, (q, k, v, m) in zip(kernel_cases, run(inputs), inputs, strict=True):
        err = _max_err(out, _reference(q, k, v, causal=case[3], kv_mask=m))
        assert err <= TOL, f"{case[0]}: max abs error {err:.2e}"


# Every strategy at degree 2 and its largest degree; ring at 4 runs in test_context_parallel_reference_kernel and
# test_ring_pieces_under_causal_masking, and allgather at 4 takes allgather 2's and 8's code path (each layout
# is one more program set, ~5 s of the suite).
LAYOUTS = [
    ("ring", 2),
    ("ring", 8),
    ("ulysses", 2),
    ("ulysses", 4),
    ("allgather", 2),
    ("allgather", 8),
    ("hybrid", 4),
    ("hybrid", 8),
]  # ulysses 8: 4 heads can't split 8 ways, a LayoutError tested below


@pytest.mark.parametrize("strategy,degree", LAYOUTS, ids=[f"{s}-{d}" for s, d in LAYOUTS])
def test_context_parallel_blockwise(strategy, degree):
    mesh = make_mesh(MESHES[degree])
    settings = AttentionSettings(
        kernel="xla_blockwise",
        context_strategy=strategy,
        mesh=mesh,
        block_q=32,
        block_kv=32,
        allgather_max_kv=ALLGATHER_MAX_KV,
    )
    _run_cases(settings)


@pytest.mark.parametrize("strategy,degree", [("ring", 4), ("ulysses", 2), ("allgather", 8), ("hybrid", 8)])
def test_context_parallel_reference_kernel(strategy, degree):
    mesh = make_mesh(MESHES[degree])
    settings = AttentionSettings(
        kernel="reference", context_strategy=strategy, mesh=mesh, allgather_max_kv=ALLGATHER_MAX_KV
    )
    _run_cases(settings, CASES[1:4])


MORE = [("ring", 2, None), ("ulysses", 4, None), ("hybrid", 8, 2), ("auto", 8, None)]


@pytest.mark.parametrize("strategy,degree,ulysses_degree", MORE, ids=[f"{s}-{d}" for s, d, _ in MORE])
def test_context_parallel_more_cases(strategy, degree, ulysses_degree):
    """kv_mask over sharded cross-attention K/V, replicated text K/V, an explicit hybrid split (2 x ring 4)
    and "auto" (4 heads over 8 devices: ring)."""
    settings = AttentionSettings(
        kernel="xla_blockwise",
        context_strategy=strategy,
        mesh=make_mesh(MESHES[degree]),
        ulysses_degree=ulysses_degree,
        block_q=32,
        block_kv=32,
        allgather_max_kv=ALLGATHER_MAX_KV,
    )
    _run_cases(settings, CASES[3:])


# (strategy, degree, ulysses_degree, tokens): with 16-wide K/V blocks every ring K/V block travels in several
# pieces (asserted), under causal masking, kv_mask and padding: 8 pieces (ring 2), 3 (ring 4, 250 -> 252
# tokens), 2 (ring 8, 250 -> 256), 7 (hybrid 2 x ring 2: the ring block is a whole group's 126 tokens), 4.
PIECES = [("ring", 2, None, 256), ("ring", 4, None, 250), ("ring", 8, None, 250), ("hybrid", 4, 2, 250)]
PIECES += [("hybrid", 8, 2, 256)]


@pytest.mark.parametrize(
    "strategy,degree,ulysses_degree,s", PIECES, ids=[f"{p[0]}-{p[1]}-{p[3]}" for p in PIECES]
)
def test_ring_pieces_under_causal_masking(strategy, degree, ulysses_degree, s):
    block = 16
    ring_block = -(-s // degree) * (ulysses_degree or 1)  # the K/V each ring step moves, per device
    assert ring_pieces(ring_block, block) > 1
    settings = AttentionSettings(
        kernel="xla_blockwise",
        context_strategy=strategy,
        mesh=make_mesh(MESHES[degree]),
        ulysses_degree=ulysses_degree,
        block_q=block,
        block_kv=block,
        allgather_max_kv=ALLGATHER_MAX_KV,
    )
    cases = [("self-causal+kv_mask", s, s, True, True), ("cross-sharded-causal", s - 30, s, True, False)]
    _run_cases(settings, cases)


def test_fit_blocks_shrinks_tiles_with_the_chunk():
    assert fit_blocks(65536, 65536, 64, 512, 512) == (512, 512)  # budget 64k * 64 / 8 = 512 * 1024
    assert fit_blocks(8192, 8192, 64, 512, 512) == (256, 256)  # the K/V block first, then the query block
    assert fit_blocks(512, 512, 64, 512, 512) == (MIN_BLOCK, MIN_BLOCK)  # the floor
    assert fit_blocks(128, 128, 16, 32, 24) == (32, 24)  # blocks set below the floor stay as set
    assert fit_blocks(100, 60, 64, 512, 512) == (100, 60)  # capped by the lengths, under the budget


def test_ring_with_fitted_tiles_and_pieces():
    """Default 512 blocks at 1024 tokens over 2 devices: the 512-token chunk fits 128 x 128 tiles and moves in
    4 pieces, all under causal masking and a kv_mask."""
    s, degree = 1024, 2
    assert fit_blocks(s // degree, s // degree, D, 512, 512) == (128, 128)
    assert ring_pieces(s // degree, 128) == 4
    settings = AttentionSettings(
        kernel="xla_blockwise", context_strategy="ring", mesh=make_mesh(MESHES[degree])
    )
    _run_cases(settings, [("self-causal+kv_mask", s, s, True, True)])


@pytest.mark.parametrize("degree", [4, 8])
def test_ring_memory_per_device_divides_by_the_degree(degree):
    """issue 4's target, read from the compiled programs: per-device bytes (arguments + output + temporaries)
    at context N <= 1.25 / N of one device's. 8k tokens, 8 heads of 64: before the tiles were fitted to the
    chunk this was 2.71 at N=8 (19 MiB of 512 x 512 score tiles per device whatever N)."""
    s, heads, head_dim = 8192, 8, 64
    spec = jax.ShapeDtypeStruct((1, s, heads, head_dim), jnp.float32)

    def per_device_mib(settings, shardings=None):
        fn = jax.jit(lambda q, k, v: attention(q, k, v, settings=settings), in_shardings=shardings)
        m = fn.lower(spec, spec, spec).compile().memory_analysis()
        return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes) / 2**20

    one = per_device_mib(AttentionSettings(kernel="xla_blockwise"))
    mesh = make_mesh(MeshSizes(context=degree), jax.devices()[:degree])
    ring = AttentionSettings(kernel="xla_blockwise", context_strategy="ring", mesh=mesh)
    sharded = (NamedSharding(mesh, P(None, "context", None, None)),) * 3
    ratio = per_device_mib(ring, sharded) * degree / one
    assert ratio <= 1.25, f"context {degree}: {ratio:.2f} x the 1/N share of {one:.1f} MiB"


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_ulysses_with_several_head_groups(degree):
    """16 heads: the per-group exchange loop runs 4 times at context 2 (8 heads per tensor shard) and 4, twice
    at 8."""
    mesh = make_mesh(MESHES[degree])
    heads = 16
    local_heads = heads // dict(mesh.shape)["tensor"]
    assert head_groups(local_heads, degree) > 1
    settings = AttentionSettings(
        kernel="xla_blockwise",
        context_strategy="ulysses",
        mesh=mesh,
        block_q=32,
        block_kv=32,
        allgather_max_kv=ALLGATHER_MAX_KV,
    )
    _run_cases(settings, CASES[1:4], h=heads)


def test_batch_that_does_not_divide_data_is_replicated_not_wrong():
    mesh = make_mesh(MeshSizes(data=2, context=4))
    settings = AttentionSettings(kernel="xla_blockwise", context_strategy="ring", mesh=mesh, block_q=32)
    q, k, v = _qkv(1, 70, 70, b=1)
    out = jax.jit(lambda q, k, v: attention(q, k, v, causal=True, settings=settings))(q, k, v)
    assert _max_err(out, _reference(q, k, v, causal=True)) <= TOL


def test_strategy_selection_and_layout_errors():
    # On the CPU; the GPU's choice: tests/parallel/test_attention_accelerators.py.
    cpu = dict(context=4, short_kv=1024, platform="cpu")
    assert select_strategy("auto", local_heads=8, sk=77, **cpu) == "allgather"
    assert select_strategy("auto", local_heads=8, sk=4096, **cpu) == "ulysses"
    assert select_strategy("auto", local_heads=2, sk=4096, **cpu) == "ring"
    assert select_strategy("ring", local_heads=8, sk=77, **cpu) == "ring"
    assert hybrid_degrees(8, 4, None) == (4, 2)
    assert hybrid_degrees(4, 4, None) == (2, 2)
    assert hybrid_degrees(2, 4, None) == (1, 2)  # no proper divisor but 1: pure ring
    with pytest.raises(LayoutError, match="does not divide"):
        hybrid_degrees(8, 4, 3)
    with pytest.raises(LayoutError, match="divisible"):
        hybrid_degrees(8, 2, 4)

    settings = AttentionSettings(
        context_strategy="ulysses", mesh=make_mesh(MeshSizes(context=8)), allgather_max_kv=0
    )
    q, k, v = _qkv(0, 64, 64)
    with pytest.raises(LayoutError, match="Ulysses over 8 devices"):
        jax.jit(lambda q, k, v: attention(q, k, v, settings=settings))(q, k, v)
    with pytest.raises(ValueError, match="unknown context strategy"):
        AttentionSettings(context_strategy="zigzag")
    with pytest.raises(ValueError, match="ulysses_degree applies to context_strategy 'hybrid' only"):
        AttentionSettings(context_strategy="ring", ulysses_degree=2)


# --- kernels that can't run here: selection with a faked platform, argument mapping on the CPU --------------


def test_kernel_selection_by_platform():
    def pick(
        kernel="auto", platform="cpu", head_dim=64, dtype=jnp.bfloat16, causal=False, sq=64, sk=64, heads=4
    ):
        return kernels.select_kernel(
            kernel,
            platform=platform,
            head_dim=head_dim,
            dtype=dtype,
            causal=causal,
            sq=sq,
            sk=sk,
            heads=heads,
        )

    assert pick() == "xla_chunked"
    assert pick(sq=8192, sk=8192) == "xla_blockwise"  # more chunks than xla_chunked takes
    assert pick(heads=40, sq=1024, sk=32760) == "xla_blockwise"  # a score tile over its budget
    assert pick("xla_blockwise") == "xla_blockwise"
    assert pick("xla_chunked", platform="cuda") == "xla_chunked"
    assert pick(platform="cuda") == "cudnn"
    assert pick(platform="cuda", dtype=jnp.float32) == "xla_blockwise"  # cuDNN flash: fp16/bf16 only
    assert pick(platform="cuda", head_dim=512) == "xla_blockwise"  # e.g. SDXL's VAE attention
    assert pick(platform="cuda", head_dim=60) == "xla_blockwise"
    assert pick(platform="cuda", causal=True) == "cudnn"
    assert pick(platform="cuda", causal=True, sq=64, sk=77) == "xla_blockwise"  # top-left vs bottom-right
    assert pick(platform="rocm") == "xla_blockwise"
    assert pick(platform="tpu") == "splash"
    assert pick(platform="tpu", dtype=jnp.float32) == "splash"
    assert pick("cudnn", platform="cpu") == "xla_blockwise"
    assert pick("splash", platform="cuda") == "xla_blockwise"
    assert pick("cudnn", platform="cuda", head_dim=512) == "xla_blockwise"
    assert pick("reference", platform="tpu") == "reference"
    assert kernels.platform_of(AttentionSettings()) == "cpu"
    assert kernels.platform_of(AttentionSettings(mesh=make_mesh(MeshSizes(context=8)))) == "cpu"


def test_entry_point_routes_to_cudnn_on_a_faked_gpu(monkeypatch):
    calls = []

    def cudnn_on_cpu(q, k, v, **kwargs):
        calls.append(kwargs)
        return cudnn_attention(q, k, v, implementation="xla", **kwargs)

    monkeypatch.setattr(dispatch, "platform_of", lambda settings: "cuda")
    monkeypatch.setattr(kernels, "cudnn_attention", cudnn_on_cpu)
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(0, 64, 64))
    out = jax.jit(lambda q, k, v: attention(q, k, v, causal=True))(q, k, v)
    assert len(calls) == 1 and calls[0]["causal"] is True
    ref = _reference(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True)
    assert _max_err(out.astype(jnp.float32), ref) <= 2e-2  # bf16 inputs and output
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    jax.jit(lambda q, k, v: attention(q, k, v, causal=True))(q, k, v)  # fp32: cuDNN declines
    assert len(calls) == 1


@pytest.mark.parametrize("causal,sk", [(False, 77), (True, 96)])
def test_cudnn_argument_mapping_through_the_xla_implementation(causal, sk):
    sq = 96
    q, k, v = _qkv(4, sq, sk)
    # A padding-style mask (a valid prefix per row), what text-encoder masks look like; row 1 fully masked.
    kv_mask = jnp.arange(sk)[None, :] < jnp.array([[sk - 20], [0]])
    out = jax.jit(
        lambda q, k, v, m: cudnn_attention(q, k, v, causal=causal, kv_mask=m, scale=0.3, implementation="xla")
    )(q, k, v, kv_mask)
    assert _max_err(out, _reference(q, k, v, causal=causal, kv_mask=kv_mask, scale=0.3)) <= TOL


@pytest.mark.parametrize("causal,sq,sk", [(False, 200, 77), (True, 128, 128)])
def test_splash_argument_mapping_in_pallas_interpret_mode(causal, sq, sk):
    q, k, v = _qkv(5, sq, sk, b=1, h=2)
    kv_mask = (jnp.arange(sk) < sk - 9)[None, :]
    out = jax.jit(
        lambda q, k, v, m: splash_attention(
            q, k, v, causal=causal, kv_mask=m, block_q=128, block_kv=128, interpret=True
        )
    )(q, k, v, kv_mask)
    assert _max_err(out, _reference(q, k, v, causal=causal, kv_mask=kv_mask)) <= TOL

"""cpu_fused (models/cpu/fused_attention.cc through models.cpu.fused_attention): against the reference at shapes
that exercise every edge of its tiles, bit-identical rows whatever the batch, gradients, its selection, inside
shard_map on a mesh, and what happens without a compiler."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshserve.models.attention.dispatch as dispatch
from meshserve.models.attention import AttentionSettings, attention
from meshserve.models.attention.chunked import xla_chunked
from meshserve.models.attention.kernels import select_kernel
from meshserve.models.attention.reference import reference_attention
from meshserve.models.cpu import fused_attention
from meshserve.models.cpu.fused_attention import cpu_fused_attention
from meshserve.models.parallel.mesh import MeshSizes, make_mesh

pytestmark = pytest.mark.skipif(not fused_attention.available(), reason="no C++ compiler here")

_fused = jax.jit(cpu_fused_attention, static_argnames=("scale",))
_reference = jax.jit(reference_attention, static_argnames=("scale",))


def _qkv(seed, b, sq, sk, h, d, spread=1.0):
    rng = np.random.default_rng(seed)
    shapes = ((b, sq, h, d), (b, sk, h, d), (b, sk, h, d))
    return tuple(jnp.asarray(rng.standard_normal(s) * spread, jnp.float32) for s in shapes)


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape and np.all(np.isfinite(out))
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize(
    "b,sq,sk,h,d",
    [
        (2, 1152, 1152, 4, 64),  # Flux's 512x512 self-attention: whole tiles
        (2, 256, 77, 2, 64),  # SDXL's cross-attention: a short last key block
        (1, 7, 3, 3, 5),  # fewer queries than a register tile, keys than a vector, a head dim under one
        (3, 50, 130, 2, 40),  # query and key counts that divide nothing, head dim 2.5 vectors
        (1, 200, 1, 1, 24),  # one key: every weight 1
        (1, 96, 64, 1, 512),  # SDXL's VAE attention: one head of 512
        (2, 192, 16, 4, 24),  # tiny-wan's cross-attention
    ],
)
def test_fused_matches_reference(b, sq, sk, h, d):
    q, k, v = _qkv(sq + sk + d, b, sq, sk, h, d)
    # The reference's own float32 rounding is of this order: against float64 on Flux's shape, max abs 3.0e-7
    # for the reference and 4.4e-7 for this kernel.
    assert _rel_err(_fused(q, k, v), _reference(q, k, v)) <= 1e-5
    assert _rel_err(_fused(q, k, v, scale=0.3), _reference(q, k, v, scale=0.3)) <= 1e-5


def test_fused_keeps_large_logits_stable():
    """Logits of several hundred: the running max keeps every exponent <= 0 (a naive softmax overflows)."""
    q, k, v = _qkv(1, 2, 130, 200, 2, 32, spread=6.0)
    ref = _reference(q, k, v)
    assert float(jnp.max(jnp.abs(jnp.einsum("bqhd,bkhd->bhqk", q, k)))) / 32**0.5 > 100
    assert _rel_err(_fused(q, k, v), ref) <= 1e-5


def test_a_row_does_not_depend_on_its_batch():
    """Seeds stay bit-identical at every batch position (tests/models/test_seeds.py): a row computed alone and
    in a batch of three, in any position, gives the same bits."""
    q, k, v = _qkv(3, 3, 300, 300, 2, 64)
    batched = np.asarray(_fused(q, k, v))
    for row in range(3):
        alone = np.asarray(_fused(q[row : row + 1], k[row : row + 1], v[row : row + 1]))
        assert np.array_equal(alone[0], batched[row])


def test_differentiated_it_is_the_xla_kernel_forward_and_backward():
    """Training computes what it did before the kernel: under jax.vjp the forward is xla_chunked's, to the
    bit, and the gradients are the reference's."""
    q, k, v = _qkv(4, 2, 40, 33, 2, 16)
    primal = jax.jit(lambda q, k, v: jax.vjp(cpu_fused_attention, q, k, v)[0])(q, k, v)
    assert np.array_equal(np.asarray(primal), np.asarray(jax.jit(xla_chunked)(q, k, v)))

    def grads(fn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v))), argnums=(0, 1, 2)))

    for fused, ref in zip(
        grads(cpu_fused_attention)(q, k, v), grads(reference_attention)(q, k, v), strict=True
    ):
        assert _rel_err(fused, ref) <= 1e-5


def test_selection_takes_float32_calls_without_masks_or_causality():
    def pick(kernel="auto", dtype=jnp.float32, causal=False, masked=False, platform="cpu", head_dim=64):
        return select_kernel(
            kernel,
            platform=platform,
            head_dim=head_dim,
            dtype=dtype,
            causal=causal,
            sq=64,
            sk=64,
            heads=4,
            masked=masked,
        )

    assert pick() == "cpu_fused"
    assert pick("cpu_fused") == "cpu_fused"
    assert pick(dtype=jnp.bfloat16) == "xla_chunked"
    assert pick(causal=True) == "xla_chunked"
    assert pick(masked=True) == "xla_chunked"
    assert pick(head_dim=128) == "cpu_fused"
    assert pick(head_dim=512) == "xla_chunked"  # SDXL's VAE: slower than XLA's there
    assert pick("xla_chunked") == "xla_chunked"
    assert pick(platform="cuda") == "xla_blockwise"  # fp32: no cuDNN; never a CPU library on a GPU
    assert pick("cpu_fused", platform="cuda") == "xla_chunked"
    # Through the entry point: a mask or causality reaches the XLA kernels, and their results are the reference's.
    q, k, v = _qkv(5, 1, 64, 64, 4, 16)
    mask = jnp.asarray(np.random.default_rng(0).random((1, 64)) < 0.7)
    for kwargs in (dict(causal=True), dict(kv_mask=mask)):
        out = attention(q, k, v, settings=AttentionSettings(kernel="cpu_fused"), **kwargs)
        assert _rel_err(out, reference_attention(q, k, v, **kwargs)) <= 1e-5


def test_on_a_mesh_each_device_runs_the_kernel_on_its_block(monkeypatch):
    """data 2 x tensor 2: batch rows and heads split over four devices, one custom call each inside shard_map."""
    chosen = []
    run = dispatch.run_local_kernel
    monkeypatch.setattr(
        dispatch, "run_local_kernel", lambda name, *a, **kw: chosen.append(name) or run(name, *a, **kw)
    )
    mesh = make_mesh(MeshSizes(data=2, tensor=2), jax.devices()[:4])
    q, k, v = _qkv(6, 2, 128, 77, 4, 32)
    sharding = NamedSharding(mesh, P("data", None, "tensor", None))
    q, k, v = (jax.device_put(x, sharding) for x in (q, k, v))
    fn = jax.jit(lambda q, k, v: attention(q, k, v, settings=AttentionSettings(mesh=mesh)))
    assert chosen == [] and "meshserve_cpu_fused_attention" in fn.lower(q, k, v).as_text()
    assert chosen == ["cpu_fused"]
    assert _rel_err(fn(q, k, v), reference_attention(q, k, v)) <= 1e-5


def _availability_in_a_fresh_process(env: dict[str, str]) -> str:
    code = (
        "import logging; logging.basicConfig(level=logging.INFO);"
        "from meshserve.models.cpu import fused_attention as f; print('AVAILABLE', f.available());"
        "from meshserve.models.attention.kernels import select_kernel;"
        "print('AUTO', select_kernel('auto', platform='cpu', head_dim=64, dtype='float32', causal=False,"
        " sq=64, sk=64, heads=4))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_without_a_compiler_or_switched_off_the_xla_kernels_run(tmp_path):
    """A slim container has no C++ compiler: the kernel says why once and selection keeps xla_chunked."""
    empty = tmp_path / "bin"
    empty.mkdir()
    out = _availability_in_a_fresh_process({"PATH": str(empty), "CXX": "", "MESHSERVE_CACHE": str(tmp_path)})
    assert "AVAILABLE False" in out and "no C++ compiler" in out and "AUTO xla_chunked" in out
    out = _availability_in_a_fresh_process({"MESHSERVE_CPU_FUSED_ATTENTION": "0"})
    assert "AVAILABLE False" in out and "off" in out and "AUTO xla_chunked" in out

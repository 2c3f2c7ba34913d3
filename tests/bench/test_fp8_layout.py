"""bench/fp8_layout.py on this CPU: both stored forms of the e4m3 kernels compute the same numbers (the
[out, in] form's dot is quantized_matmul's arithmetic with the kernel transposed), and the output is the MLP
blocks' through e4m3, not a copy of the input. The GPU's question, whether the [in, out] form costs a copy
of the kernels, needs a GPU."""

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is no package of the install
from bench import fp8_layout as fl  # noqa: E402


def test_both_stored_forms_compute_the_same_blocks():
    args = argparse.Namespace(blocks=2, dim=64, hidden=256, tokens=32, steps=3, rounds=1, per_round=1)
    result = fl.measure(args)
    assert result["max_rel_diff"] == 0.0, result
    assert set(result["forms"]) == {"in_out", "out_in"}
    assert result["kernel_bytes"] == 2 * 2 * 64 * 256
    for form in result["forms"].values():
        assert form["arguments_bytes"] >= result["kernel_bytes"] and form["ms"]["n"] == 1


def test_the_out_in_matmul_is_the_quantized_matmul_transposed():
    from meshserve.models.components.quantize import quantized_matmul

    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (1, 32, 48), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (1, 48, 80), jnp.float32)
    q, s = fl.quantize_stack(w, 1)
    qt, st = fl.quantize_stack(jnp.swapaxes(w, 1, 2), 2)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(st))
    ours = quantized_matmul(x, q[0], s[0], None, jnp.bfloat16, activations="fp8-upcast")
    theirs = fl.matmul_out_in(x, qt[0], st[0], "fp8-upcast")
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(theirs, np.float32))
    exact = np.asarray(x, np.float32) @ np.asarray(w[0])
    assert (
        1e-3 < np.abs(np.asarray(ours, np.float32) - exact).mean() / np.abs(exact).mean() < 0.1
    )  # e4m3's error

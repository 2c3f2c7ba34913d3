"""bench/fp8_layout.py on this CPU: both stored forms of the e4m3 kernels compute the same numbers (the same
e4m3 values through quantized_matmul, the [out, in] form with kernel_in_axis=1), and the blocks' output is
the MLP's through e4m3. The GPU's question, whether the [in, out] form costs a copy of the kernels, needs a
GPU."""

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


def test_a_kernel_stored_out_in_gives_the_same_product():
    """quantized_matmul with kernel_in_axis=1 on the transposed e4m3 kernel equals the stored form's product,
    with activations quantized and weight-only, and both are x @ w to e4m3's error."""
    from meshserve.models.components.quantize import quantized_matmul

    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (1, 32, 48), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (1, 48, 80), jnp.float32)
    q, s = fl.quantize_stack(w)
    exact = np.asarray(x, np.float32) @ np.asarray(w[0])
    for activations in ("fp8-upcast", None):
        stored = quantized_matmul(x, q[0], s[0], None, jnp.bfloat16, activations=activations)
        transposed = quantized_matmul(
            x, q[0].T, s[0], None, jnp.bfloat16, activations=activations, kernel_in_axis=1
        )
        np.testing.assert_array_equal(np.asarray(stored, np.float32), np.asarray(transposed, np.float32))
        error = np.abs(np.asarray(stored, np.float32) - exact).mean() / np.abs(exact).mean()
        assert 1e-3 < error < 0.1, (
            activations,
            error,
        )  # through e4m3: a few per cent, not exact, not garbage

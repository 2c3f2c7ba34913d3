"""bench/attention_fp8.py on this CPU: the bf16 side and the fp8 recipe's emulation (the GPU's cuDNN fp8 side
needs a GPU). The emulation must really go through e4m3 (an error well above bf16's) with scales that keep the
values in range (a wrong scale saturates or flushes to zero: errors of order 1)."""

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is no package of the install
from bench import attention_fp8 as af  # noqa: E402


def test_the_fp8_recipe_costs_e4m3s_precision_and_no_more():
    args = argparse.Namespace(shape=[1, 512, 2, 64], outlier=1.0, ref_queries=128, rounds=1, per_round=1)
    result = af.run(args)
    bf16, fp8 = result["sides"]["bf16"], result["fp8 emulated"]
    assert bf16["mean_rel"] < 5e-3 and bf16["ms"]["n"] == 1
    assert 1e-2 < fp8["mean_rel"] < 0.1, fp8  # e4m3 keeps 3 mantissa bits: a few per cent
    assert "fp8 cuDNN" not in result["sides"] and not result["errors"]  # no GPU: that side is not tried


def test_values_go_through_e4m3_at_their_scale():
    x = jnp.asarray([[0.0, 1.0, -3.5, 100.0]], jnp.float32)
    scale = af.scale_of(x)
    assert float(scale) == np.float32(4.48)  # absmax 100 -> e4m3's largest, 448
    q = af.to_e4m3(x, scale)
    assert q.dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(np.asarray(q.astype(jnp.float32)) / 4.48, [[0.0, 1.0, -3.5, 100.0]], rtol=0.07)


def test_scales_that_follow_the_outliers_keep_8_bit_attention_close():
    """With a few large channels in q and k, one scale per tensor squeezes the rest into e4m3's few levels;
    SageAttention's recipe (a scale per token, k smoothed) keeps the error near its no-outlier level."""
    args = argparse.Namespace(shape=[1, 512, 2, 64], outlier=4.0, ref_queries=128, rounds=1, per_round=1)
    result = af.run(args)
    per_tensor, per_token = result["fp8 emulated"], result["int8 q/k per token, e4m3 P and v, emulated"]
    assert per_token["mean_rel"] < 0.06 and per_tensor["mean_rel"] > 2 * per_token["mean_rel"], (
        per_token,
        per_tensor,
    )
    assert per_token["mean_rel"] > 3 * result["sides"]["bf16"]["mean_rel"]  # still 8 bits, not bf16

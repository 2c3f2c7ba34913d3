"""Attention in fp8 against bf16, one call at a DiT's shape: is cuDNN's fp8 flash attention the lever for Wan 14B?

    python bench/attention_fp8.py                                  # Wan 2.1 14B's self-attention: 2 x 32760 x 40 x 128
    python bench/attention_fp8.py --shape 1,4608,24,128            # FLUX.1-dev's joint attention
    python bench/attention_fp8.py --tiny                           # CPU: bf16 (XLA) and the emulation: a check that it runs

Why: the 2026-11-27 H200 profiles put attention at 70 % of Wan 2.1 1.3B's step (one cuDNN flash kernel, bf16),
and the fp8 Wan 14B CFG step ran in 5.01 s with its dots already fp8 (issue 24's target: 4.5 s). By FLOPs the
14B step is about half attention, so fp8 dots alone cannot reach the target; 8-bit attention is what LightX2V's
faster step uses (SageAttention). This measures, before any model code changes, what cuDNN's fp8 attention
(jax's `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(..., use_fp8=True)`, a private API:
its signature may move between jax versions) gains over the bf16 cuDNN kernel our models call, and its error.

Per `--shape` B,T,N,H (self-attention, BTNH as our models lay q, k, v out), inputs random normal (q and k with
a few outlier channels x `--outlier`, as real activations have; random data bounds nothing about a trained
model's error, which is for the model benches to measure):

- **bf16**: `jax.nn.dot_product_attention(implementation="cudnn")` (on the CPU: "xla");
- **fp8 cuDNN** (GPU only): q, k, v quantized to e4m3 with one scale per tensor (absmax / 448, computed in the
  program: what a model's call would do), softmax probabilities scaled by 448 into e4m3 inside the kernel
  (they are at most 1), the output scaled by 448 / absmax(v) (|out| <= absmax(v)) and dequantized after;
- **fp8 emulated** (any backend, not timed): the same quantization of q, k, v, the unnormalised probabilities
  and the output, written in XLA on the reference's slice: the recipe's expected error, and on a GPU a check
  of the cuDNN call's scales (read as intended, the two agree more closely than either with fp32);
- **int8 q/k per token, e4m3 P and v** (emulated, not timed): the finer recipe of SageAttention (q and k with a
  scale per token, k smoothed; v with a scale per channel), which no JAX kernel offers: what finer scales buy.

Errors against an fp32 reference on the first head of the first batch row and the first `--ref-queries`
queries (the full fp32 reference of the 14B shape would hold 40 x 2 x 32760^2 scores): max |x - ref| / max |ref|
and the mean |x - ref| / mean |ref|. Times: `--rounds` alternating rounds of `--per-round` calls per side,
medians (min-max) in ms, and each side's TFLOP/s (4 B N T^2 H). Prints a header (date, device, versions) and a
table; `--out` writes the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_vs_diffusers import alternate, summary, timed  # noqa: E402

E4M3_MAX = 448.0


def scale_of(x, target: float = E4M3_MAX):
    """One fp32 scale per tensor: x * scale spans e4m3's range."""
    import jax.numpy as jnp

    return target / jnp.maximum(jnp.max(jnp.abs(x)).astype(jnp.float32), 1e-12)


def to_e4m3(x, scale):
    import jax.numpy as jnp

    return (x.astype(jnp.float32) * scale).astype(jnp.float8_e4m3fn)


def through_e4m3(x, scale):
    """x rounded to e4m3 at `scale` and back, in fp32."""
    import jax.numpy as jnp

    return to_e4m3(x, scale).astype(jnp.float32) / scale


def bf16_attention(q, k, v, implementation: str):
    import jax

    return jax.nn.dot_product_attention(q, k, v, implementation=implementation)


def fp8_cudnn_attention(q, k, v):
    """cuDNN's fp8 flash attention (forward) on q, k, v quantized per tensor; output dequantized to bf16."""
    import jax.numpy as jnp
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention

    sq, sk, sv = scale_of(q), scale_of(k), scale_of(v)
    so = scale_of(v)  # the output is a convex combination of v's rows: |out| <= absmax(v)
    one = jnp.ones((1, 1, 1, 1), jnp.float32)
    params = {
        "descale_q": (1 / sq) * one,
        "descale_k": (1 / sk) * one,
        "descale_v": (1 / sv) * one,
        "descale_s": one / E4M3_MAX,
        "scale_s": one * E4M3_MAX,  # probabilities (at most 1) into e4m3's range
        "scale_o": so * one,
    }
    unused = {  # the backward pass's; the forward reads none of them
        name: one
        for name in (
            "amax_dQ", "amax_dK", "amax_dV", "amax_dP", "descale_o", "descale_dO", "descale_dP",
            "scale_dQ", "scale_dK", "scale_dV", "scale_dP",
        )
    }  # fmt: skip
    out, _amax_s, _amax_o = dot_product_attention(
        to_e4m3(q, sq),
        to_e4m3(k, sk),
        to_e4m3(v, sv),
        fp8_params=params | unused,
        scale=1.0 / q.shape[-1] ** 0.5,
        qkv_layout="BTNH",
        use_fp8=True,
    )
    return (out.astype(jnp.float32) / so).astype(jnp.bfloat16)


def fp8_emulated_attention(q, k, v, sq, sk, sv):
    """The fp8 recipe above written in XLA, in fp32, with the full tensors' scales: q, k, v through e4m3; the
    probabilities before normalisation, exp(s - rowmax) in (0, 1], through e4m3 at scale 448; the row sums of
    the unquantized probabilities (a flash kernel keeps them in fp32); the output through e4m3 at 448 /
    absmax(v). It holds all scores: call it on a slice (one head, some queries)."""
    import jax.numpy as jnp

    qf, kf, vf = through_e4m3(q, sq), through_e4m3(k, sk), through_e4m3(v, sv)
    s = jnp.einsum("btnh,bsnh->bnts", qf, kf) / q.shape[-1] ** 0.5
    p = jnp.exp(s - s.max(-1, keepdims=True))
    out = jnp.einsum("bnts,bsnh->btnh", through_e4m3(p, E4M3_MAX), vf)
    out = out / p.sum(-1).transpose(0, 2, 1)[..., None]
    return through_e4m3(out, sv).astype(jnp.bfloat16)


def smoothed_int8_emulated_attention(q, k, v):
    """A finer recipe no JAX kernel offers yet, SageAttention's shape of it, emulated in fp32 on one head's slice:
    q and k in int8 with one scale per token, k less its mean over the tokens first (a shift softmax ignores:
    it adds the same q . mean(k) to a query's every score), the unnormalised probabilities in e4m3 at 448 and v
    in e4m3 with one scale per channel. What 8-bit attention costs when its scales follow the outliers."""
    import jax.numpy as jnp

    def absmax(x, axis):
        return jnp.maximum(jnp.max(jnp.abs(x), axis=axis, keepdims=True), 1e-12)

    def through_int8(x, scale):
        return jnp.clip(jnp.round(x * scale), -127, 127) / scale

    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    k = k - k.mean(axis=1, keepdims=True)
    qf, kf = through_int8(q, 127 / absmax(q, -1)), through_int8(k, 127 / absmax(k, -1))
    vf = through_e4m3(v, E4M3_MAX / absmax(v, 1))
    s = jnp.einsum("btnh,bsnh->bnts", qf, kf) / q.shape[-1] ** 0.5
    p = jnp.exp(s - s.max(-1, keepdims=True))
    out = jnp.einsum("bnts,bsnh->btnh", through_e4m3(p, E4M3_MAX), vf)
    return (out / p.sum(-1).transpose(0, 2, 1)[..., None]).astype(jnp.bfloat16)


def head(x, queries: int | None = None):
    """Batch row 0, head 0, the first `queries` positions: the slice the reference covers."""
    return x[:1, :queries, :1]


def reference(q, k, v, queries: int):
    """fp32 attention of batch row 0, head 0, the first `queries` queries: [1, queries, 1, H]."""
    import jax
    import jax.numpy as jnp

    q0, k0, v0 = (head(x).astype(jnp.float32) for x in (q, k, v))
    s = jnp.einsum("btnh,bsnh->bnts", q0[:, :queries], k0) / q.shape[-1] ** 0.5
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v0)


def errors(out, ref) -> dict:
    """max |out - ref| / max |ref| and mean |out - ref| / mean |ref| on the reference's slice of out."""
    import numpy as np

    got = np.asarray(head(out, ref.shape[1]), np.float64)
    ref = np.asarray(ref, np.float64)
    diff = np.abs(got - ref)
    return {
        "max_rel": float(diff.max() / np.abs(ref).max()),
        "mean_rel": float(diff.mean() / np.abs(ref).mean()),
    }


def inputs(shape: tuple[int, int, int, int], outlier: float, seed: int = 0):
    import jax
    import jax.numpy as jnp

    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    b, t, n, h = shape
    boost = jnp.ones((h,)).at[: max(1, h // 32)].set(outlier)  # a few large channels in q and k
    q = (jax.random.normal(kq, shape) * boost).astype(jnp.bfloat16)
    k = (jax.random.normal(kk, shape) * boost).astype(jnp.bfloat16)
    v = jax.random.normal(kv, shape).astype(jnp.bfloat16)
    return q, k, v


def run(args) -> dict:
    import jax

    gpu = jax.devices()[0].platform == "gpu"
    shape = tuple(args.shape)
    q, k, v = inputs(shape, args.outlier)
    ref = reference(q, k, v, args.ref_queries)
    b, t, n, h = shape
    flops = 4 * b * n * t * t * h
    result: dict = {"shape": shape, "flops": flops, "sides": {}, "errors": {}}
    scales = [scale_of(x) for x in (q, k, v)]
    emulated = jax.jit(fp8_emulated_attention)(head(q, args.ref_queries), head(k), head(v), *scales)
    result["fp8 emulated"] = errors(emulated, ref)
    smoothed = jax.jit(smoothed_int8_emulated_attention)(head(q, args.ref_queries), head(k), head(v))
    result["int8 q/k per token, e4m3 P and v, emulated"] = errors(smoothed, ref)
    sides = {"bf16": jax.jit(lambda q, k, v: bf16_attention(q, k, v, "cudnn" if gpu else "xla"))}
    if gpu:
        sides["fp8 cuDNN"] = jax.jit(fp8_cudnn_attention)
    runnable = {}
    for name, fn in sides.items():
        try:
            seconds, out = timed(lambda fn=fn: fn(q, k, v), jax.block_until_ready)  # compiles
            result["sides"][name] = {"compile_and_first_s": seconds, **errors(out, ref)}
            runnable[name] = (lambda fn=fn: fn(q, k, v), jax.block_until_ready)
            if name == "fp8 cuDNN":  # the cuDNN call's scales, checked against the recipe
                result["fp8_cudnn_vs_emulated"] = errors(out, emulated.astype("float32"))
        except Exception as e:  # noqa: BLE001
            result["errors"][name] = f"{type(e).__name__}: {e}"[:600]
    times = alternate(runnable, args.rounds, args.per_round)
    for name, t_ in times.items():
        ms = summary(t_["all"])
        result["sides"][name] |= {"ms": ms, "tflops": flops / (ms["median"] * 1e-3) / 1e12}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=lambda s: [int(x) for x in s.split(",")], default=[2, 32760, 40, 128])
    ap.add_argument("--tiny", action="store_true", help="shape 1,256,2,64 (a CPU check)")
    ap.add_argument("--outlier", type=float, default=8.0, help="scale of q's and k's outlier channels")
    ap.add_argument("--ref-queries", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-round", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.tiny:
        args.shape = [1, 256, 2, 64]
    import jax

    device = jax.devices()[0]
    print(
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {device.device_kind} ({device.platform}), "
        f"jax {jax.__version__}; shape B,T,N,H = {tuple(args.shape)}, q/k outlier channels x{args.outlier}; "
        f"{args.rounds} alternating rounds of {args.per_round} calls, medians (min-max)",
        flush=True,
    )
    result = run(args)
    print("| attention | ms | TFLOP/s | max rel err vs fp32 | mean rel err vs fp32 |")
    print("|---|---|---|---|---|")
    for name, side in result["sides"].items():
        ms = side.get("ms")
        timing = f"{ms['median']:.2f} ({ms['min']:.2f}-{ms['max']:.2f})" if ms else "not timed"
        tflops = f"{side['tflops']:.0f}" if ms else ""
        print(f"| {name} | {timing} | {tflops} | {side['max_rel']:.1e} | {side['mean_rel']:.1e} |")
    for name in ("fp8 emulated", "int8 q/k per token, e4m3 P and v, emulated"):
        err = result[name]
        print(f"| {name} (XLA, one head) | not timed | | {err['max_rel']:.1e} | {err['mean_rel']:.1e} |")
    if "fp8_cudnn_vs_emulated" in result:
        print(f"fp8 cuDNN against its emulation: {result['fp8_cudnn_vs_emulated']}")
    for name, error in result["errors"].items():
        print(f"ERROR {name}: {error}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()

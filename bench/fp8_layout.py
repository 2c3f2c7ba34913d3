"""Does an e4m3 kernel stored [in, out] cost a GPU program a copy of every kernel? Stored [in, out] against [out, in].

    python bench/fp8_layout.py                  # GPU: 8 blocks of FLUX.1-dev's MLP, 4 steps, 4608 tokens
    python bench/fp8_layout.py --tiny           # CPU: a check that it runs (the dots on upcast values)

Why: on an H100 (2026-11-27) the FLUX.1-dev generation with `quantize: fp8` failed beside diffusers' pipeline
when our denoise program asked for one buffer of 8.48 GiB, while the e4m3 kernels of its Linear layers that
take fp8 activations come to about 8.0 GiB. XLA:GPU allocates a program's temporaries as one buffer, so the
program likely held a second copy of those kernels. A suspect: cuBLASLt's fp8 GEMM takes its operands in the
"TN" form only (both with the contracted dimension minor), our layers store each kernel [in, out] with out
minor (models/components/quantize.py, as nnx.Linear lays it out), so XLA:GPU has to transpose every kernel,
and layout assignment may give the whole stacked kernels (models/components/block_stack.py) the transposed
layout and copy them once per call. (XLA:CPU did the like to int8 stacks: docs/weights.md, "fp8".)

This compiles the same computation twice, `--blocks` blocks of an MLP (x -> up -> tanh-GELU -> down, a
residual; FLUX.1-dev's 3072 -> 12288 -> 3072 by default) under a scan inside a loop of `--steps` steps, as a
denoise program holds a DiT, with the kernels in e4m3 and one fp32 scale per output channel:

- **[in, out]**: nnx.Linear's own layout (the stored form until that run), the dot through
  models/components/quantize.py's `quantized_matmul`;
- **[out, in]**: the same e4m3 kernels transposed on the host (diffusers' own `weight` layout), the same
  `quantized_matmul` with `kernel_in_axis=1`: the dot contracts both operands' last dimension.

and prints, per form: the compiled program's arguments and temporaries (memory_analysis), its fp8 GEMMs
(`__cublas$lt$matmul$f8`), transposes and copies in the optimized HLO, its time (`--rounds` alternating rounds
of `--per-round` calls, medians with min-max), and the two outputs' max relative difference (the same
numbers: 0 or rounding). A copy of the kernels shows as temporaries about the stack's size.

Answered on an H200 (2026-11-27; bench/README.md, "GPU", fifth run): [in, out] 936 MiB of temporaries and 2
transposes, [out, in] 360 MiB and none, 1.06x faster. The layers whose activations are quantized store their
e4m3 kernels [out, in] since (`kernel_t`); the script keeps both forms to measure the two again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_vs_diffusers import FP8_GEMM, alternate, import_meshserve, summary, timed  # noqa: E402

import_meshserve()


def quantize_stack(w) -> tuple:
    """Stacked kernels w [L, in, out] -> (e4m3 [L, in, out], fp32 scales [L, out]), each block as a pool's
    loader quantizes it (models/components/quantize.py's quantize_fp8)."""
    import numpy as np

    from meshserve.models.components.quantize import quantize_fp8

    blocks = [quantize_fp8(np.asarray(kernel, np.float32)) for kernel in w]
    return np.stack([q for q, _ in blocks]), np.stack([s for _, s in blocks])


def program(form: str, steps: int, activations: str):
    """(x, up, up_scale, down, down_scale) -> x after `steps` steps of the scanned blocks."""
    import jax

    from meshserve.models.components.quantize import quantized_matmul

    def matmul(x, q, s):
        axis = 0 if form == "in_out" else 1
        return quantized_matmul(x, q, s, None, x.dtype, activations=activations, kernel_in_axis=axis)

    def block(x, weights):
        up, up_s, down, down_s = weights
        h = jax.nn.gelu(matmul(x, up, up_s), approximate=True)
        return x + matmul(h, down, down_s), None

    def run(x, *weights):
        def step(_, x):
            return jax.lax.scan(block, x, weights)[0]

        return jax.lax.fori_loop(0, steps, step, x)

    return run


def measure(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from meshserve.models.components.quantize import activation_mode

    activations = activation_mode("fp8", None, jax.devices()[:1]) or "fp8-upcast"
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    d, f = args.dim, args.hidden
    x = jax.random.normal(k1, (1, args.tokens, d), jnp.float32).astype(jnp.bfloat16)
    up = jax.random.normal(k2, (args.blocks, d, f), jnp.float32) * d**-0.5
    down = jax.random.normal(k3, (args.blocks, f, d), jnp.float32) * f**-0.5 * 0.1
    (up_q, up_s), (down_q, down_s) = quantize_stack(up), quantize_stack(down)
    forms = {  # the same e4m3 values and scales; the [out, in] kernels are the [in, out] ones transposed
        "in_out": (up_q, up_s, down_q, down_s),
        "out_in": (np.swapaxes(up_q, 1, 2), up_s, np.swapaxes(down_q, 1, 2), down_s),
    }
    forms = {form: tuple(jnp.asarray(a) for a in arrays) for form, arrays in forms.items()}
    kernel_bytes = sum(int(np.prod(w.shape)) for w in (up, down))  # e4m3: a byte each
    result: dict = {
        "activations": activations,
        "shape": {"blocks": args.blocks, "dim": d, "hidden": f, "tokens": args.tokens, "steps": args.steps},
        "kernel_bytes": kernel_bytes,
        "forms": {},
    }
    runs, outputs = {}, {}
    for form, weights in forms.items():
        fn = jax.jit(program(form, args.steps, activations))
        compiled = fn.lower(x, *weights).compile()
        hlo = compiled.as_text()
        m = compiled.memory_analysis()
        runs[form] = (lambda compiled=compiled, weights=weights: compiled(x, *weights), jax.block_until_ready)
        seconds, outputs[form] = timed(runs[form][0], jax.block_until_ready)
        result["forms"][form] = {
            "arguments_bytes": m.argument_size_in_bytes,
            "temp_bytes": m.temp_size_in_bytes,
            "fp8_gemms": hlo.count(FP8_GEMM),
            "transposes": hlo.count(" transpose("),
            "copies": hlo.count(" copy("),
            "first_call_s": seconds,
        }
    times = alternate(runs, args.rounds, args.per_round)
    for form, t in times.items():
        result["forms"][form]["ms"] = summary(t["all"])
    a, b = (np.asarray(outputs[f], np.float32) for f in ("in_out", "out_in"))
    result["max_rel_diff"] = float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--dim", type=int, default=3072)
    ap.add_argument("--hidden", type=int, default=12288)
    ap.add_argument("--tokens", type=int, default=4608)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-round", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="2 blocks of 64 -> 256 on 32 tokens (a CPU check)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.tiny:
        args.blocks, args.dim, args.hidden, args.tokens = 2, 64, 256, 32
    import jax

    device = jax.devices()[0]
    result = measure(args)
    print(
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {device.device_kind} ({device.platform}), "
        f"jax {jax.__version__}; {result['shape']}, activations {result['activations']}; e4m3 kernels "
        f"{result['kernel_bytes'] / 2**20:.1f} MiB; {args.rounds} alternating rounds of {args.per_round} calls"
    )
    print("| kernels stored | arguments MiB | temporaries MiB | fp8 GEMMs | transposes | copies | ms |")
    print("|---|---|---|---|---|---|---|")
    for form, r in result["forms"].items():
        ms = r["ms"]
        print(
            f"| {form} | {r['arguments_bytes'] / 2**20:.1f} | {r['temp_bytes'] / 2**20:.1f} | {r['fp8_gemms']} "
            f"| {r['transposes']} | {r['copies']} | {ms['median']:.2f} ({ms['min']:.2f}-{ms['max']:.2f}) |"
        )
    print(f"max relative difference between the two outputs: {result['max_rel_diff']:.1e}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

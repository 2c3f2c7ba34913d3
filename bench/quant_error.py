"""What quantization does to the embedded trained models' pictures: error and held-out adherence per mode.

    python bench/quant_error.py [--models tiny-sdxl,tiny-flux] [--dtypes bfloat16,float32] [--seeds 2]

For each model and dtype: the held-out captions (training/evaluate.py: the 24 combinations training never
showed, seeds 0..N-1, the folder's 20 steps; tiny-flux with true CFG 3 and an empty negative prompt, as its
README prompts it) drawn unquantized, then with `quantize` int8, fp8 (weight-only, what a backend without
fp8 dots runs) and fp8 with its activations quantized (`fp8_activations=True`: a GPU's fp8 path, the dot on
upcast values here). Printed per row: adherence (colour / background / shape, training/shape_score.py) and
the per-pixel error against the unquantized pictures of the same dtype (max, mean; pixels in [0, 1]).
Deterministic on a given machine: no timing.
"""

from __future__ import annotations

import argparse
import datetime

import numpy as np

from meshserve.models.cpu.xla_cpu_flags import apply_cpu_defaults

apply_cpu_defaults()

MODES = ((None, None), ("int8", None), ("fp8", None), ("fp8", True))
PROMPTED = {"tiny-flux": {"true_cfg_scale": 3.0, "negative_prompt": ""}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny-sdxl,tiny-flux")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()

    from meshserve.models import load_pipeline
    from meshserve.training.evaluate import evaluate

    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")  # noqa: T201
    print("| model | dtype | quantize | colour / background / shape | max abs | mean abs |")  # noqa: T201
    print("|---|---|---|---|---|---|")  # noqa: T201
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            unquantized = None
            for quantize, activations in MODES:
                pipe = load_pipeline(model, dtype=dtype, quantize=quantize, fp8_activations=activations)
                result, pictures = evaluate(pipe, range(args.seeds), **PROMPTED.get(model, {}))
                label = (quantize or "none") + (" + activations" if activations else "")
                read = f"{result.colour:.3f} / {result.background:.3f} / {result.shape:.3f}"
                if unquantized is None:
                    unquantized, error = pictures, ("", "")
                else:
                    diff = np.abs(pictures.astype(np.float32) - unquantized.astype(np.float32)) / 255.0
                    error = (f"{diff.max():.2e}", f"{diff.mean():.2e}")
                print(f"| {model} | {dtype} | {label} | {read} | {error[0]} | {error[1]} |", flush=True)  # noqa: T201


if __name__ == "__main__":
    main()

"""Prompt adherence of an embedded model on the held-out captions: `meshserve.training.evaluate`.

Every (colour, shape, background) combination that training never showed (training/shapes.HELD_OUT) is
prompted in its plain form ("a red circle on a blue background") with each seed, the pictures are read back
by training/shape_score.py and the shares that match are returned. A video model is prompted with every
held-out combination moving in each direction and still (training/clips.py), and its clips are read back by
training/motion_score.py (colour, background and shape on the middle frame, the motion from the first and
last frames). The tests run it on the shipped models in fp32, bf16 and on a cfg2 x context2 mesh;
`python -m meshserve.training.evaluate FOLDER` prints it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import numpy as np

from meshserve.training.clips import held_out_clip_prompts
from meshserve.training.motion_score import ClipAdherence, clip_adherence
from meshserve.training.shape_score import Adherence, adherence
from meshserve.training.shapes import HELD_OUT, plain_caption


def held_out_prompts(seeds: Sequence[int] = (0,)) -> tuple[list[str], list[int], list[tuple[str, str, str]]]:
    """(prompts, seeds, wanted) for every held-out combination with every seed."""
    rows = [(combo, seed) for seed in seeds for combo in HELD_OUT]
    return (
        [plain_caption(*combo) for combo, _ in rows],
        [seed for _, seed in rows],
        [combo for combo, _ in rows],
    )


def generate(pipeline, prompts: list[str], seeds: list[int], *, batch: int = 24, **kwargs) -> np.ndarray:
    """uint8 [N, H, W, 3] pictures (video: [N, F, H, W, 3]), `batch` prompts per pipeline call (one compiled
    program for all calls)."""
    images = []
    for i in range(0, len(prompts), batch):
        out = pipeline(prompts[i : i + batch], seed=seeds[i : i + batch], output_type="np", **kwargs)
        images.append(np.round(np.asarray(out.images) * 255).astype(np.uint8))
    return np.concatenate(images)


def evaluate(pipeline, seeds: Sequence[int] = (0,), **kwargs) -> tuple[Adherence, np.ndarray]:
    """Pictures for an image model; for a video model (pipeline.limits has "frames"), evaluate_clips."""
    if "frames" in pipeline.limits:
        return evaluate_clips(pipeline, seeds, **kwargs)
    prompts, row_seeds, wanted = held_out_prompts(seeds)
    images = generate(pipeline, prompts, row_seeds, **kwargs)
    return adherence(images, wanted), images


def evaluate_clips(pipeline, seeds: Sequence[int] = (0,), **kwargs) -> tuple[ClipAdherence, np.ndarray]:
    """uint8 clips [N, F, H, W, 3] for every held-out combination in every motion, and their adherence."""
    prompts, row_seeds, wanted = held_out_clip_prompts(seeds)
    clips = generate(pipeline, prompts, row_seeds, **kwargs)
    return clip_adherence(clips, wanted), clips


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="a model folder (default: the embedded model)")
    parser.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 per held-out caption")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--guidance", type=float, default=None)
    parser.add_argument("--true-cfg", type=float, default=None, help="Flux: true CFG with an empty negative")
    parser.add_argument(
        "--grid",
        default=None,
        help="also save the pictures (clips: their middle frames) as one PNG, a row per seed",
    )
    args = parser.parse_args(argv)
    from meshserve.models.registry import load_pipeline

    pipeline = load_pipeline(args.model, dtype=args.dtype)
    extra = {} if args.true_cfg is None else {"true_cfg_scale": args.true_cfg, "negative_prompt": ""}
    result, images = evaluate(
        pipeline, range(args.seeds), num_inference_steps=args.steps, guidance_scale=args.guidance, **extra
    )
    if args.grid:
        from PIL import Image

        if images.ndim == 5:  # clips: their middle frames
            images = images[:, images.shape[1] // 2]
        rows = images.reshape(args.seeds, -1, *images.shape[1:])
        grid = np.concatenate([np.concatenate(list(row), axis=1) for row in rows], axis=0)
        Image.fromarray(grid).save(args.grid)
    print(json.dumps(result.__dict__))  # noqa: T201 - the command's output
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

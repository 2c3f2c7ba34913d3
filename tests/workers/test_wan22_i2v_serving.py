"""Wan 2.2's two-expert image-to-video served with and without a last frame: a worker pool on a tiny I2V-A14B
folder diffusers wrote, the API in-process over ASGI, one Redis. The card says `limits.last_image` and
`last_image_optional`; a job with `image` alone and one with `image` and `last_image` both run, the second
compiling nothing (one image_encode program serves both: models/wan/pipeline_i2v.py), and each MP4 is the
video a direct pipeline call with the same images and seed gives. The pool's warm-up is skipped, as in
tests/workers/test_i2v_serving.py (the first job compiles)."""

from __future__ import annotations

import numpy as np

from meshserve.models import load_pipeline
from tests.workers.test_i2v_serving import (
    PROMPT,
    STEPS,
    data_url,
    direct_video,
    frames_of,
    served_jobs,
    still,
)

MODEL = "tiny-wan22-i2v"
SEED = 5


def test_a_last_frame_is_optional_and_compiles_nothing(tiny_wan_path, tmp_path_factory, monkeypatch):
    from tests.fixtures.tiny_wan_i2v import build_tiny_wan22_i2v

    folder = build_tiny_wan22_i2v(tmp_path_factory.mktemp("wan22_i2v"), tiny_wan_path)
    pipe = load_pipeline(folder)
    first, last = still((220, 20, 20)), still((240, 240, 20))
    base = {"model": MODEL, "prompt": PROMPT, "num_inference_steps": STEPS, "seed": SEED}
    base |= {"image": data_url(first), "output_format": "mp4"}
    bodies = [base, {**base, "last_image": data_url(last)}]
    card, jobs, outputs, compiled = served_jobs(MODEL, folder, pipe, bodies, monkeypatch)
    assert card["limits"]["last_image"] is card["limits"]["last_image_optional"] is True, card
    assert compiled[1] == compiled[0], compiled  # the job with a last frame ran the first job's programs
    alone, with_last = (frames_of(mp4).astype(int) for mp4 in outputs)
    p = jobs[-1]["params"]
    err_alone = np.abs(alone - direct_video(pipe, p, PROMPT, SEED, image=first)).max()
    err_last = np.abs(with_last - direct_video(pipe, p, PROMPT, SEED, image=first, last_image=last)).max()
    moved = np.abs(with_last - alone).mean()
    print(
        f"served vs direct: {err_alone} alone, {err_last} with a last frame; the last frame moved {moved:.2f}"
    )
    assert err_alone <= 2 and err_last <= 2
    assert moved > 1.0

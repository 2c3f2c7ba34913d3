"""Wan 2.2's TI2V-5B layout served end to end: a worker pool on a tiny TI2V folder diffusers wrote, the API
in-process over ASGI, one Redis. The card lists both tasks and 24 fps; a job without an image (text-to-video)
and one with `image` (image-to-video) both run, each MP4 the video a direct pipeline call with the same inputs
and seed gives, at 24 fps. The pool's warm-up is skipped, as in tests/workers/test_i2v_serving.py."""

from __future__ import annotations

import io

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

MODEL = "tiny-wan22-ti2v"
SEED = 6


def test_text_and_image_to_video_from_one_folder(tiny_wan_path, tmp_path_factory, monkeypatch):
    import av

    from tests.fixtures.tiny_wan import build_tiny_wan22_ti2v

    folder = build_tiny_wan22_ti2v(tmp_path_factory.mktemp("wan22_ti2v"), tiny_wan_path)
    pipe = load_pipeline(folder)
    first = still((220, 20, 20))
    base = {"model": MODEL, "prompt": PROMPT, "num_inference_steps": STEPS, "seed": SEED}
    base |= {"height": 64, "width": 96, "output_format": "mp4"}
    # 96 x 64: the tiny folder's default video (diffusers' 832 x 480, 81 frames) would take minutes here
    bodies = [base, {**base, "image": data_url(first)}]
    card, jobs, outputs, _ = served_jobs(MODEL, folder, pipe, bodies, monkeypatch, buckets=[(96, 64)])
    assert card["tasks"] == ["text-to-video", "image-to-video"], card
    assert card["defaults"]["fps"] == 24
    for mp4 in outputs:
        with av.open(io.BytesIO(mp4)) as container:
            assert container.streams.video[0].average_rate == 24
    text_only, from_image = (frames_of(mp4).astype(int) for mp4 in outputs)
    p = jobs[-1]["params"]
    err_text = np.abs(text_only - direct_video(pipe, p, PROMPT, SEED)).max()
    err_image = np.abs(from_image - direct_video(pipe, p, PROMPT, SEED, image=first)).max()
    print(f"served vs direct: text-to-video {err_text}, image-to-video {err_image}")
    assert err_text <= 2 and err_image <= 2
    assert np.abs(from_image - text_only).mean() > 1.0

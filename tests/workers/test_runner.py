"""Output encoding (decoded back and compared) and the fake runner's contract: batches, seeds, callbacks."""

import io

import numpy as np
import pytest
from PIL import Image

from meshserve.service.contract import JobParams
from meshserve.workers.encoding import encode_image, encode_output, encode_video, to_uint8
from meshserve.workers.fake_runner import FakeRunner
from meshserve.workers.runner import Cancelled, InvalidRequest, RunRequest, make_runner


def _image(h=16, w=24):
    rng = np.random.default_rng(0)
    return rng.random((h, w, 3), dtype=np.float32)


def test_png_round_trips_exactly():
    img = _image()
    data, ctype = encode_image(img, "png")
    assert ctype == "image/png"
    back = np.asarray(Image.open(io.BytesIO(data)))
    assert back.shape == (16, 24, 3)
    np.testing.assert_array_equal(back, to_uint8(img))


@pytest.mark.parametrize("fmt, ctype", [("jpeg", "image/jpeg"), ("webp", "image/webp")])
def test_lossy_formats_decode_close(fmt, ctype):
    img = np.full((32, 32, 3), 0.5, np.float32)  # flat: lossy codecs keep it within a few levels
    data, got = encode_image(img, fmt)
    assert got == ctype
    back = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)
    assert np.abs(back - 128).max() <= 3


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="gif"):
        encode_image(_image(), "gif")


def test_video_hooks():
    av = pytest.importorskip("av")
    frames = np.stack([np.full((16, 16, 3), i / 8, np.float32) for i in range(8)])
    data, ctype = encode_video(frames, "mp4", fps=8)
    assert ctype == "video/mp4"
    with av.open(io.BytesIO(data)) as c:
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(decoded) == 8
    assert abs(int(decoded[4].mean()) - 128) <= 6
    data, ctype = encode_output(frames, "webp")
    assert ctype == "image/webp" and Image.open(io.BytesIO(data)).n_frames == 8


def _req(job_id, prompt="p", n=1, seed=7, steps=3):
    params = JobParams(
        model="fake",
        prompt=prompt,
        width=16,
        height=8,
        num_inference_steps=steps,
        guidance_scale=5.0,
        seed=seed,
        n=n,
    )
    return RunRequest(job_id, params)


def test_fake_runner_batch_seeds_and_callback():
    runner = make_runner("fake", "fake", path=None, dtype="float32", mesh=None, devices=None, options={})
    assert isinstance(runner, FakeRunner)
    steps = []
    results = runner.run([_req("a", n=2, seed=10), _req("b", seed=3)], lambda s, t: steps.append((s, t)))
    assert steps == [(1, 3), (2, 3), (3, 3)]
    assert [r.job_id for r in results] == ["a", "b"]
    assert [o.seed for o in results[0].outputs] == [10, 11] and [o.index for o in results[0].outputs] == [
        0,
        1,
    ]
    out = results[1].outputs[0]
    assert (out.width, out.height, out.content_type) == (16, 8, "image/png")
    assert Image.open(io.BytesIO(out.data)).size == (16, 8)
    # Deterministic: the same job gives the same bytes.
    assert runner.run([_req("b", seed=3)])[0].outputs[0].data == out.data
    assert runner.info().defaults.num_inference_steps == 4


def test_fake_runner_stop_and_faults():
    runner = FakeRunner("fake")
    with pytest.raises(Cancelled):
        runner.run([_req("a")], lambda s, t: s < 2)
    with pytest.raises(InvalidRequest):
        runner.run([_req("a", prompt="FAKE_REJECT")])
    with pytest.raises(RuntimeError):
        runner.run([_req("a", prompt="FAKE_RAISE")])


def test_batches_pad_to_power_of_two_buckets():
    from meshserve.workers.runner import _batch_bucket

    assert [_batch_bucket(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [_batch_bucket(n, data=2) for n in (1, 2, 3)] == [2, 2, 4]
    assert _batch_bucket(3, data=3) == 6

"""Video outputs: MP4 (H.264 through PyAV) and animated WebP (Pillow) decode back to the frames that went in,
with the frame count, size and rate asked for."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from meshserve.workers.encoding import encode_output, encode_video

av = pytest.importorskip("av")

F, H, W = 9, 48, 80


def video(frames: int = F, height: int = H, width: int = W) -> np.ndarray:
    """[F, H, W, 3] in [0, 1]: a smooth gradient that moves with time (codec-friendly, and frames differ)."""
    t, y, x = np.meshgrid(np.arange(frames), np.arange(height), np.arange(width), indexing="ij")
    r = (x + 4 * t) % width / width
    g = y / height
    b = 0.5 + 0.4 * np.sin(t / frames * np.pi)
    return np.stack([r, g, np.broadcast_to(b, r.shape)], axis=-1).astype(np.float32)


def decode_mp4(data: bytes):
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return np.stack(frames), stream


@pytest.mark.parametrize("fps", [16, 24])
def test_mp4_decodes_to_the_frames(fps):
    frames = video()
    data, content_type = encode_video(frames, "mp4", fps=fps)
    assert content_type == "video/mp4"
    decoded, stream = decode_mp4(data)
    assert decoded.shape == (F, H, W, 3)
    assert stream.codec_context.name == "h264"
    assert stream.average_rate == fps
    # Lossy (H.264, yuv420p): close to the input, not equal; a shuffled video would be far off.
    ref = np.round(frames * 255)
    err = np.abs(decoded.astype(np.float32) - ref).mean()
    assert err < 6.0, err
    assert np.abs(decoded.astype(np.float32) - ref[::-1]).mean() > 2 * err


def test_mp4_crops_odd_sizes_to_even():
    """yuv420p needs even sizes: one pixel row / column is dropped, not an error."""
    decoded, _ = decode_mp4(encode_video(video(5, 33, 47), "mp4")[0])
    assert decoded.shape == (5, 32, 46, 3)


def test_animated_webp_has_every_frame():
    frames = video()
    data, content_type = encode_output(frames, "webp", fps=16)  # rank 4: a video
    assert content_type == "image/webp"
    im = Image.open(io.BytesIO(data))
    assert im.format == "WEBP" and im.is_animated and im.n_frames == F and im.size == (W, H)
    durations = []
    for i in range(F):
        im.seek(i)
        im.load()  # the frame's duration is read when it is decoded
        durations.append(im.info["duration"])
        got = np.asarray(im.convert("RGB"), np.float32)
        assert np.abs(got - np.round(frames[i] * 255)).mean() < 6.0
    assert durations == [62] * F  # 1000 / 16 ms, whole milliseconds


def test_an_image_format_is_refused_for_video():
    with pytest.raises(ValueError, match="unsupported video format"):
        encode_video(video(), "png")


def test_the_same_frames_encode_to_the_same_mp4():
    """A job run again (a takeover after a worker died) writes the same file: with x264's macroblock tree on,
    this clip encoded to 8 distinct files in 60 encodes (decoded up to 27 levels apart)."""
    rng = np.random.default_rng(0)
    clip = np.zeros((9, 64, 64, 3), np.uint8)
    clip[:, 16:48, 16:48] = 200
    clip = (clip + rng.integers(0, 40, clip.shape)).astype(np.uint8)
    files = {encode_video(clip, "mp4", 16)[0] for _ in range(32)}
    assert len(files) == 1

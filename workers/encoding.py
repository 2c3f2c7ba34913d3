"""Turn model outputs into the bytes a client downloads: PNG / JPEG / WebP with Pillow, MP4 / animated WebP
for video. Arrays arrive as uint8 (the worker's pipelines convert on the device: `output_type="uint8"`,
docs/outputs.md) or as float in [0, 1] (`output_type="np"`, the CLI and the fake runner), converted here by
`to_uint8`, the rounding the device conversion reproduces. The job loop calls these on its encoder threads, off
the pool thread."""

from __future__ import annotations

import importlib.util
import io

import numpy as np
from PIL import Image

from meshserve.service.contract import CONTENT_TYPES, IMAGE_FORMATS, VIDEO_FORMATS

# Lossy quality unless a job asks for its own (`output_compression`): Pillow's defaults are 75 (JPEG) and 80
# (WebP); 90 keeps fine detail at ~1.5x the bytes.
DEFAULT_QUALITY = 90


def to_uint8(image: np.ndarray) -> np.ndarray:
    """[..., 3] float in [0, 1] -> uint8, rounding to nearest (as diffusers' numpy_to_pil does)."""
    if image.dtype == np.uint8:
        return image
    return (np.clip(np.asarray(image, dtype=np.float32), 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def encode_image(image: np.ndarray, fmt: str, quality: int | None = None) -> tuple[bytes, str]:
    """image [H, W, 3] -> (bytes, content type); `quality` 0-100 for JPEG and WebP (None: DEFAULT_QUALITY)."""
    fmt = fmt.lower()
    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"unsupported image format {fmt!r}; use one of {list(IMAGE_FORMATS)}")
    pil = Image.fromarray(to_uint8(image), mode="RGB")
    buf = io.BytesIO()
    if fmt == "png":
        # compress_level 1: ~5x faster than the default 6 for ~10% more bytes; encoding sits on the job's path.
        pil.save(buf, format="PNG", compress_level=1)
    elif fmt == "jpeg":
        pil.save(buf, format="JPEG", quality=DEFAULT_QUALITY if quality is None else quality)
    else:
        pil.save(buf, format="WEBP", quality=DEFAULT_QUALITY if quality is None else quality)
    return buf.getvalue(), CONTENT_TYPES[fmt]


def can_encode(fmt: str) -> bool:
    """Whether this install writes `fmt` (an mp4 needs PyAV, a dependency of meshserve: absent only from an
    install that skipped it)."""
    if fmt == "mp4":
        return importlib.util.find_spec("av") is not None
    return fmt in CONTENT_TYPES


def encode_video(
    frames: np.ndarray, fmt: str = "mp4", fps: int = 16, quality: int | None = None
) -> tuple[bytes, str]:
    """frames [F, H, W, 3] -> (bytes, content type); `quality` for an animated WebP, as `encode_image`'s. MP4
    is H.264 (yuv420p, so even sizes) through PyAV, imported lazily: image-only workers never load it."""
    fmt = fmt.lower()
    frames = to_uint8(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"video frames must be [F, H, W, 3], got {frames.shape}")
    if fmt == "webp":
        pils = [Image.fromarray(f, mode="RGB") for f in frames]
        buf = io.BytesIO()
        pils[0].save(
            buf,
            format="WEBP",
            save_all=True,
            append_images=pils[1:],
            duration=int(1000 / fps),
            loop=0,
            quality=DEFAULT_QUALITY if quality is None else quality,
        )
        return buf.getvalue(), CONTENT_TYPES["webp"]
    if fmt not in VIDEO_FORMATS:
        raise ValueError(f"unsupported video format {fmt!r}; use one of {list(VIDEO_FORMATS)}")
    try:
        import av
    except ImportError as e:  # pragma: no cover - depends on the install
        raise RuntimeError("mp4 output needs PyAV (a meshserve dependency): pip install av") from e
    _, height, width, _ = frames.shape
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
        # x264's macroblock tree (its lookahead's rate control) made the same frames encode to different files:
        # one 9-frame 64x64 clip gave 8 distinct files in 60 encodes in a worker-like process (decoded up to 27
        # levels apart), an 81-frame 480p one 3 in 3 (libx264 via PyAV 18.1 / FFmpeg 8, 2026-11-29; with
        # threads=1 too). Without it: 1 in 40 and 1 in 3, the same speed, files ~20 % larger at the same CRF.
        # A job run again (a takeover after a worker died) must write the same file.
        options = {"x264-params": "mbtree=0"} if codec == "libx264" else {}
        stream = container.add_stream(codec, rate=fps, options=options)
        stream.width, stream.height, stream.pix_fmt = width - width % 2, height - height % 2, "yuv420p"
        for frame in frames:
            video_frame = av.VideoFrame.from_ndarray(frame[: stream.height, : stream.width], format="rgb24")
            for packet in stream.encode(video_frame):
                container.mux(packet)
        for packet in stream.encode():  # flush the encoder's delayed frames
            container.mux(packet)
    return buf.getvalue(), CONTENT_TYPES["mp4"]


def encode_output(
    array: np.ndarray, fmt: str, fps: int = 16, quality: int | None = None
) -> tuple[bytes, str]:
    """One output: an image [H, W, 3] or a video [F, H, W, 3], by rank."""
    if array.ndim == 4:
        return encode_video(array, fmt, fps, quality)
    return encode_image(array, fmt, quality)

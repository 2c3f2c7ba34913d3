"""Image inputs from clients: where the bytes come from, and decoding them safely.

    data = await read_image_field(value, field="image", settings=settings)   # a data: URL or an http(s) URL
    still = decode_image(data, field="image", max_pixels=settings.max_image_pixels)          # RGB, clean PNG
    mask = decode_image(data, field="mask", max_pixels=..., mode="L", size=still.image.size)

A decoder is an attack surface (OWASP API4/API8): a 100-byte PNG can claim 20,000 x 20,000 pixels (1.2 GB
decoded), a GIF or animated WebP holds frames we would silently drop, and EXIF/XMP/ICC metadata can carry
anything. So:

- The format is sniffed from the bytes (the Content-Type of a URL or a data URL is not trusted), and only PNG,
  JPEG and WebP reach a decoder: Pillow is opened with `formats=[that one]`, so no other plugin ever parses a
  client's bytes. A known other format (GIF, BMP, TIFF, AVIF/HEIC, SVG...) is `unsupported_format`; anything
  else `not_an_image`.
- The pixel count is read from the header and checked against `max_pixels` before a pixel is decoded, and so is
  the aspect ratio (at most MAX_ASPECT_RATIO: a sliver of an image is resized into a huge one downstream); Pillow's
  own decompression-bomb warning is an error here too.
- More than one frame (APNG, animated WebP, MPO's second picture) is refused: a still is expected.
- A JPEG of more than MAX_JPEG_SCANS scans is refused before decoding: each scan of a progressive JPEG makes
  the decoder pass over the whole image, and a scan can be 16 bytes, so a small file could hold thousands (an
  audit's 173 KiB 4096 x 4096 file of 400 scans took 26 s of the API's CPU to decode).
- 16-bit grayscale (PNG's I;16) is scaled to 8 bits, not clipped (Pillow's convert makes mid-gray white).
- EXIF orientation is applied (a phone's portrait JPEG is stored landscape), then the pixels are copied into a
  fresh image and re-encoded as PNG: nothing of the original file (metadata, ICC profile, trailing bytes) is
  kept or handed on to the workers.

Every refusal is an `ImageInputError(field, rule, message)`: the API answers it with a 422 naming both.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from PIL import Image, ImageOps, UnidentifiedImageError

from meshserve.service import ssrf

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP")
# libjpeg's progressive JPEGs have 10 scans (jpeg_simple_progression, colour), a baseline JPEG one per component
# at most. 59 scans at 4096 x 4096 decoded in 2.0 s, libjpeg's 10 in 1.3 s (the 2-core development machine,
# loaded, 2026-11-28).
MAX_JPEG_SCANS = 64
# The longer side over the shorter one. Within the pixel bound, a 10 x 1,600,000 image passed, and Wan's CLIP image
# preprocessing (shortest side to 224) then asked for 224 x 35,840,000 pixels (32 GB) on the worker; at 1 x
# 16,000,000 the API's own decode took 410 MB (an audit, 2026-11-28). A 16:1 banner or panorama still passes.
MAX_ASPECT_RATIO = 16

# Magic numbers: the allowed formats, then formats we recognise only to name them in the refusal.
_SIGNATURES: tuple[tuple[bytes, int, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", 0, "PNG"),
    (b"\xff\xd8\xff", 0, "JPEG"),
    (b"WEBP", 8, "WEBP"),  # RIFF....WEBP
    (b"GIF87a", 0, "GIF"),
    (b"GIF89a", 0, "GIF"),
    (b"BM", 0, "BMP"),
    (b"II*\x00", 0, "TIFF"),
    (b"MM\x00*", 0, "TIFF"),
    (b"\x00\x00\x00\x0cjP  ", 0, "JPEG 2000"),
    (b"ftypavif", 4, "AVIF"),
    (b"ftypheic", 4, "HEIC"),
    (b"ftypmif1", 4, "HEIF"),
    (b"\x00\x00\x01\x00", 0, "ICO"),
    (b"8BPS", 0, "PSD"),
    (b"%PDF", 0, "PDF"),
    (b"%!PS", 0, "PostScript"),
    (b"\xff\x0a", 0, "JPEG XL"),
    (b"qoif", 0, "QOI"),
)
_SVG = re.compile(rb"^\s*(<\?xml[^>]*>\s*)?(<!--.*?-->\s*)*<svg[\s>]", re.IGNORECASE | re.DOTALL)
_DATA_URL = re.compile(r"^data:(?P<type>[^;,]*)(?P<params>(;[^;,]*)*),", re.IGNORECASE)


class ImageInputError(ValueError):
    """A client's image input broke a rule: `field` (image, mask), `rule` (the 422 code), a message."""

    def __init__(self, field: str, rule: str, message: str):
        super().__init__(message)
        self.field, self.rule, self.message = field, rule, message


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # a fresh image (RGB, or L for a mask): no metadata, orientation applied
    png: bytes  # the same pixels, re-encoded: what is stored and handed to the workers
    source_format: str  # PNG, JPEG or WEBP
    transparent: bool = (
        False  # the source had an alpha channel (or a transparent colour) with a pixel below opaque
    )


def sniff_format(data: bytes) -> str | None:
    """The format the bytes start like (one of ALLOWED_FORMATS or a name to refuse), or None."""
    for magic, offset, name in _SIGNATURES:
        if data[offset : offset + len(magic)] == magic:
            if name == "WEBP" and data[:4] != b"RIFF":
                continue
            return name
    if _SVG.match(data[:4096]):
        return "SVG"
    return None


def jpeg_segments(data: bytes) -> Iterator[tuple[int, int, int]]:
    """A JPEG's marker segments after SOI, as (marker, start, end) byte offsets; a scan's (SOS) runs to the end of
    its entropy-coded data. A marker's bytes inside another segment (an EXIF thumbnail, an ICC profile) are
    skipped with it, and inside entropy-coded data a 0xFF byte is always followed by 0x00 or a restart marker,
    so the walk is exact. Stops at EOI, at the end of the bytes, or where no marker is (Pillow reports that)."""
    i, n = 2, len(data)
    while i + 4 <= n and data[i] == 0xFF:
        marker, start = data[i + 1], i
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0xD9:  # EOI
            yield marker, start, i + 2
            return
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:  # standalone markers
            i += 2
            continue
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
        if marker == 0xDA:  # SOS: its entropy-coded data runs to the next marker that is not RSTn or 0x00
            while (
                (i := data.find(b"\xff", i)) >= 0
                and i + 1 < n
                and (data[i + 1] == 0 or 0xD0 <= data[i + 1] <= 0xD7)
            ):
                i += 2
            if i < 0:
                yield marker, start, n
                return
        yield marker, start, min(i, n)


def jpeg_scans(data: bytes) -> int:
    """The scans (SOS segments) of a JPEG."""
    return sum(1 for marker, _, _ in jpeg_segments(data) if marker == 0xDA)


def decode_image(
    data: bytes,
    *,
    field: str,
    max_pixels: int,
    mode: Literal["RGB", "L"] = "RGB",
    size: tuple[int, int] | None = None,
    from_alpha: bool = False,
) -> DecodedImage:
    """Decode a client's still image under the rules above; `size` (width, height), when given, must match
    (a mask must be the size of its image). `from_alpha` (OpenAI's edits masks): an image with an alpha
    channel becomes the mask "repaint where transparent" (255 - alpha); one without is read as grayscale."""
    fmt = sniff_format(data)
    if fmt is None:
        raise ImageInputError(
            field, "not_an_image", f"{field} is not an image (no PNG, JPEG or WebP signature)"
        )
    if fmt not in ALLOWED_FORMATS:
        raise ImageInputError(
            field, "unsupported_format", f"{field} is a {fmt} image; supported formats: PNG, JPEG, WebP"
        )
    if fmt == "JPEG" and (scans := jpeg_scans(data)) > MAX_JPEG_SCANS:
        raise ImageInputError(
            field,
            "too_many_scans",
            f"{field} is a JPEG of {scans} scans; at most {MAX_JPEG_SCANS} are decoded",
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=[fmt])  # reads the header only
            width, height = img.size
            if width < 1 or height < 1 or width * height > max_pixels:
                raise ImageInputError(
                    field,
                    "too_many_pixels",
                    f"{field} is {width}x{height} = {width * height} pixels; at most {max_pixels} are decoded",
                )
            if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
                raise ImageInputError(
                    field,
                    "aspect_ratio",
                    f"{field} is {width}x{height}; its longer side may be at most {MAX_ASPECT_RATIO} times the "
                    "shorter",
                )
            frames = getattr(img, "n_frames", 1)
            if frames != 1 or getattr(img, "is_animated", False):
                raise ImageInputError(
                    field, "animated_not_allowed", f"{field} has {frames} frames; a still image is expected"
                )
            img.load()
            img = _upright(img)
            transparent = _has_transparent_pixel(img)
            sixteen_bit = img.mode.startswith("I;16") or img.mode == "I"
            key = img.info.get("transparency") if sixteen_bit else None
            if from_alpha and mode == "L" and isinstance(key, int):
                # 16-bit gray's transparency is one gray value (PNG's tRNS), which the 8-bit conversion below
                # loses (an audit's fully transparent 16-bit mask meant "repaint nothing").
                pixels = _where_value(img, key)
            elif from_alpha and mode == "L" and (img.has_transparency_data or "A" in img.getbands()):
                pixels = ImageOps.invert(img.convert("RGBA").getchannel("A"))
            elif sixteen_bit:  # 16-bit grayscale: 65535 -> 255
                pixels = img.convert("I").point(lambda v: v * (1 / 257)).convert("L").convert(mode)
            else:
                pixels = img.convert(mode)
    except ImageInputError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageInputError(
            field, "too_many_pixels", f"{field} has too many pixels; at most {max_pixels} are decoded"
        ) from None
    except UnidentifiedImageError:  # (its message names a BytesIO object)
        raise ImageInputError(field, "not_an_image", f"{field} could not be decoded as {fmt}") from None
    except Exception as e:  # noqa: BLE001 - whatever a decoder raises on a client's bytes is the bytes' fault
        # (OSError, SyntaxError, ValueError, EOFError and struct.error are Pillow's usual ones; an audit found a
        # TypeError from a malformed EXIF entry, 2026-11-28): a 422, never a 500.
        raise ImageInputError(field, "not_an_image", f"{field} could not be decoded as {fmt}: {e}") from None
    if size is not None and pixels.size != tuple(size):
        raise ImageInputError(
            field,
            "size_mismatch",
            f"{field} is {pixels.size[0]}x{pixels.size[1]}; it must be the image's size, {size[0]}x{size[1]}",
        )
    clean = Image.frombytes(mode, pixels.size, pixels.tobytes())  # no info, no ICC, no EXIF
    buf = io.BytesIO()
    clean.save(buf, format="PNG", compress_level=1)  # fast: it is read once by a worker, then expires
    return DecodedImage(clean, buf.getvalue(), fmt, transparent)


def _has_transparent_pixel(img: Image.Image) -> bool:
    """Whether a decoded image has a pixel that is not fully opaque (an alpha channel, or PNG's transparent colour
    or palette entries): OpenAI's edits read such an image's transparency as the mask when none is sent."""
    if not (img.has_transparency_data or "A" in img.getbands()):
        return False
    if img.mode.startswith("I;16") or img.mode == "I":  # 16-bit gray: one transparent gray value (tRNS)
        key = img.info.get("transparency")
        return isinstance(key, int) and _where_value(img, key).getextrema()[1] > 0
    return img.convert("RGBA").getchannel("A").getextrema()[0] < 255


def _where_value(img: Image.Image, value: int) -> Image.Image:
    """An 8-bit mask of a 16-bit gray image: 255 where a pixel equals `value`, 0 elsewhere."""
    import numpy as np  # (this path alone needs it)

    return Image.fromarray(np.where(np.asarray(img.convert("I")) == value, 255, 0).astype(np.uint8), "L")


# EXIF orientation -> the transpose that shows the picture upright (the EXIF/TIFF spec's eight values).
_ORIENTATION_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def _upright(img: Image.Image) -> Image.Image:
    """The image turned as its EXIF orientation says. Not `ImageOps.exif_transpose`: that also rewrites the EXIF
    block into the copy, and a malformed entry elsewhere in it (an ASCII value in a RATIONAL tag) made it raise
    TypeError; the EXIF is dropped here anyway, so only the orientation tag is read."""
    orientation = img.getexif().get(0x0112)
    method = _ORIENTATION_TRANSPOSE.get(orientation) if isinstance(orientation, int) else None
    return img.transpose(method) if method is not None else img


def decode_data_url(value: str, *, field: str, max_bytes: int) -> bytes:
    """The bytes of a `data:[type][;base64],...` URL (base64 required; its type is not trusted)."""
    m = _DATA_URL.match(value)
    if m is None:
        raise ImageInputError(
            field, "invalid_data_url", f"{field} is not a data URL (data:image/png;base64,...)"
        )
    if ";base64" not in m["params"].lower():
        raise ImageInputError(field, "invalid_data_url", f"{field}: a data URL must be base64 (;base64,)")
    payload = value[m.end() :]
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        raise ImageInputError(field, "too_large", f"{field} is larger than {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageInputError(field, "invalid_base64", f"{field} is not valid base64: {e}") from None
    if len(data) > max_bytes:
        raise ImageInputError(
            field, "too_large", f"{field} is {len(data)} bytes, over the {max_bytes}-byte limit"
        )
    if not data:
        raise ImageInputError(field, "not_an_image", f"{field} is empty")
    return data


async def read_image_field(
    value: str, *, field: str, settings, hold: Callable[[int], bool] | None = None
) -> bytes:
    """The bytes a request's image field names: a data URL, or an http(s) URL fetched under the SSRF rules
    (service/ssrf.py) with the `image_fetch_*` settings, its bytes counted by `hold` as they arrive (ssrf.fetch).
    Raises ImageInputError (a 422), or ssrf.FetchError "busy" when `hold` refused bytes (the server's fault)."""
    scheme = value.split(":", 1)[0].lower() if ":" in value else ""
    if scheme == "data":
        return decode_data_url(value, field=field, max_bytes=settings.max_image_bytes)
    if scheme not in ("http", "https"):
        raise ImageInputError(
            field, "invalid_image_reference", f"{field} must be a data: URL (base64) or an http(s) URL"
        )
    try:
        response = await ssrf.fetch(
            value,
            max_bytes=settings.max_image_bytes,
            connect_timeout_s=settings.image_fetch_connect_timeout_s,
            total_timeout_s=settings.image_fetch_timeout_s,
            max_redirects=settings.image_fetch_max_redirects,
            allow_private=settings.image_fetch_allow_private,
            hold=hold,
        )
    except ssrf.BlockedURL as e:
        raise ImageInputError(field, "url_not_allowed", f"{field}: {e.message}") from None
    except ssrf.FetchError as e:
        if e.reason == "busy":
            raise
        rule = "too_large" if e.reason == "too_large" else "fetch_failed"
        raise ImageInputError(field, rule, f"{field}: fetching the URL failed: {e.message}") from None
    if response.status_code != 200:
        raise ImageInputError(
            field, "fetch_failed", f"{field}: the URL answered HTTP {response.status_code}, not 200"
        )
    if not response.content:
        raise ImageInputError(field, "not_an_image", f"{field}: the URL answered an empty body")
    return response.content

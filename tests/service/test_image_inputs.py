"""Image inputs on the serving side: the decoding rules (service/image_inputs.py), the stored input and the
job's reference (service/input_store.py), and every refusal of `POST /v1/generate` and `POST /v1/images/edits`
as a 422 naming the field and the rule (a fake worker; no JAX)."""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import os
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps, PngImagePlugin

from meshserve.service.contract import StrengthLimits
from meshserve.service.image_inputs import (
    ImageInputError,
    decode_data_url,
    decode_image,
    jpeg_segments,
    sniff_format,
)
from meshserve.service.input_store import InputStore
from meshserve.service.output_store import OutputStore
from tests.service.conftest import TOY, TOY_VIDEO, FakeWorker, api_client
from tests.service.test_ssrf import answer, http_server

pytestmark = pytest.mark.anyio

# A model taking every image task, and one taking image-to-image only.
TOY_IMG = TOY.model_copy(
    update={
        "id": "toy-img",
        "limits": TOY.limits.model_copy(
            update={
                "tasks": ["text-to-image", "image-to-image", "inpaint"],
                "strength": StrengthLimits(defaults={"image-to-image": 0.3, "inpaint": 0.9999}, rule="int"),
            }
        ),
    }
)
# An image-to-video model (a Wan I2V folder): an image is required, no strength.
TOY_I2V = TOY_VIDEO.model_copy(
    update={"id": "toy-i2v", "limits": TOY_VIDEO.limits.model_copy(update={"tasks": ["image-to-video"]})}
)
TOY_I2I = TOY.model_copy(
    update={
        "id": "toy-i2i",
        "limits": TOY.limits.model_copy(
            update={
                "tasks": ["text-to-image", "image-to-image"],
                "strength": StrengthLimits(min=0.0, max=1.0, defaults={"image-to-image": 0.3}),
            }
        ),
    }
)
# An inpainting-only model (SDXL's 9-channel inpainting UNet, FLUX.1 Fill): an image needs a mask.
TOY_FILL = TOY.model_copy(
    update={
        "id": "toy-fill",
        "limits": TOY.limits.model_copy(
            update={"tasks": ["inpaint"], "strength": StrengthLimits(defaults={"inpaint": 1.0})}
        ),
    }
)
# A control model (SDXL with a ControlNet): text-to-image that needs a control image, with the ControlNet's fields.
CONTROLNET_DEFAULTS = {
    "controlnet_conditioning_scale": 1.0,
    "control_guidance_start": 0.0,
    "control_guidance_end": 1.0,
    "guess_mode": False,
}
TOY_CONTROL = TOY.model_copy(
    update={
        "id": "toy-control",
        "limits": TOY.limits.model_copy(update={"control_image": True}),
        "defaults": TOY.defaults.model_copy(update=CONTROLNET_DEFAULTS),
    }
)
MAX_PIXELS = 4096 * 4096


def encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


RED = Image.new("RGB", (40, 24), (200, 10, 10))
FRAMES = [Image.new("RGB", (16, 16), (i * 60, 0, 0)) for i in range(3)]


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


@functools.cache
def _bomb() -> bytes:
    """A 100-byte PNG whose header claims 20,000 x 20,000 RGB pixels (1.2 GB decoded); its data is a stub: the
    header alone must refuse it."""
    header = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + _png_chunk(b"IEND", b"")
    )


@functools.cache
def _many_scans() -> bytes:
    """An audit's decoder amplifier: a progressive JPEG whose small refinement scans (16-33 bytes each) are
    repeated ten times: 90 scans where libjpeg writes 10. At 4096 x 4096, 400 scans in 173 KiB took 26 s to decode."""
    data = encode(Image.new("RGB", (256, 256), (90, 40, 200)), "JPEG", progressive=True)
    segments = [(marker, data[start:end]) for marker, start, end in jpeg_segments(data)]
    scans = [seg for marker, seg in segments if marker == 0xDA]
    head = b"".join(seg for marker, seg in segments if marker not in (0xDA, 0xD9))
    small = [seg for seg in scans[1:] if len(seg) < 100]
    return b"\xff\xd8" + head + b"".join(scans) + b"".join(small) * 10 + b"\xff\xd9"


# (name, bytes, rule) - each refused by decode_image with that rule, before or while decoding.
REFUSED_BYTES = [
    ("text", b"hello, not an image", "not_an_image"),
    ("empty", b"", "not_an_image"),
    ("truncated png", encode(RED, "PNG")[:60], "not_an_image"),
    ("truncated jpeg", encode(RED, "JPEG")[:200], "not_an_image"),
    ("png signature then garbage", b"\x89PNG\r\n\x1a\n" + os.urandom(64), "not_an_image"),
    ("gif", encode(RED, "GIF"), "unsupported_format"),
    ("bmp", encode(RED, "BMP"), "unsupported_format"),
    ("tiff", encode(RED, "TIFF"), "unsupported_format"),
    ("svg", b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"/>', "unsupported_format"),
    ("pdf", b"%PDF-1.7\n...", "unsupported_format"),
    ("apng", encode(FRAMES[0], "PNG", save_all=True, append_images=FRAMES[1:]), "animated_not_allowed"),
    (
        "animated webp",
        encode(FRAMES[0], "WEBP", save_all=True, append_images=FRAMES[1:]),
        "animated_not_allowed",
    ),
    ("mpo", encode(FRAMES[0], "MPO", save_all=True, append_images=FRAMES[1:]), "animated_not_allowed"),
    ("pixel bomb png", _bomb(), "too_many_pixels"),
    ("over max_pixels", encode(Image.new("L", (5000, 4000)), "PNG"), "too_many_pixels"),
    ("jpeg of many scans", _many_scans(), "too_many_scans"),
    ("a sliver, 17:1", encode(Image.new("L", (4, 68)), "PNG"), "aspect_ratio"),
    ("a line, 1 x 16000", encode(Image.new("L", (16000, 1)), "PNG"), "aspect_ratio"),
]


def test_a_16_to_1_banner_is_still_an_image():
    assert decode_image(encode(Image.new("RGB", (64, 4)), "PNG"), field="image", max_pixels=MAX_PIXELS).image


@pytest.mark.parametrize("name,data,rule", REFUSED_BYTES, ids=[r[0] for r in REFUSED_BYTES])
def test_refused_bytes(name, data, rule):
    with pytest.raises(ImageInputError) as e:
        decode_image(data, field="image", max_pixels=MAX_PIXELS)
    assert (e.value.field, e.value.rule) == ("image", rule), e.value.message


def test_pixel_cap_is_checked_before_decoding(monkeypatch):
    """The 20,000 x 20,000 PNG is refused from its header: no pixel is decoded."""
    bomb = _bomb()
    assert len(bomb) < 120
    loads = []
    monkeypatch.setattr(Image.Image, "load", lambda self: loads.append(self) or None)
    for limit in (MAX_PIXELS, 10**9):  # our cap, and Pillow's own bomb check past it (an error here)
        with pytest.raises(ImageInputError, match="pixels") as e:
            decode_image(bomb, field="image", max_pixels=limit)
        assert e.value.rule == "too_many_pixels"
    assert loads == []


def test_refusals_name_our_rule_not_the_decoders_internals():
    """Pillow's own messages named a BytesIO object at an address, and its bomb limit instead of ours."""
    for data, limit in ((encode(RED, "PNG")[:60], MAX_PIXELS), (b"\xff\xd8\xff" + bytes(40), MAX_PIXELS)):
        with pytest.raises(ImageInputError) as e:
            decode_image(data, field="image", max_pixels=limit)
        assert "BytesIO" not in e.value.message and " at 0x" not in e.value.message, e.value.message
    with pytest.raises(ImageInputError) as e:
        decode_image(_bomb(), field="image", max_pixels=10**9)  # past Pillow's own bound
    assert "1000000000" in e.value.message and "178956970" not in e.value.message, e.value.message


def test_jpeg_scans_are_counted_by_walking_segments():
    """libjpeg's progressive JPEGs (10 scans in colour, 6 in gray, 18 in CMYK) decode; marker bytes inside an
    EXIF block are not scans; the amplifier's 90 are refused before a pixel is decoded."""
    from meshserve.service.image_inputs import MAX_JPEG_SCANS, jpeg_scans

    exif = b"Exif\x00\x00" + b"\xff\xda" * 100
    for mode, scans in (("RGB", 10), ("L", 6), ("CMYK", 18)):
        data = encode(Image.new(mode, (64, 48)), "JPEG", progressive=True, exif=exif)
        assert jpeg_scans(data) == scans
        assert decode_image(data, field="image", max_pixels=MAX_PIXELS).image.size == (64, 48)
    assert jpeg_scans(encode(RED, "JPEG")) == 1
    assert jpeg_scans(_many_scans()) == 90 > MAX_JPEG_SCANS


def test_16_bit_grayscale_is_scaled_not_clipped():
    """A 16-bit gray PNG (Pillow's I;16) read as 8 bits: 32768 is mid-gray, not white (Pillow's convert clips
    it to 255, as diffusers' load_image does), as an image and as a mask."""
    values = np.array([[0, 1000, 32768, 65535]], np.uint16)
    data = encode(Image.fromarray(values), "PNG")
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    image = decode_image(data, field="image", max_pixels=MAX_PIXELS).image
    mask = decode_image(data, field="mask", max_pixels=MAX_PIXELS, mode="L").image
    assert np.asarray(image)[0, :, 0].tolist() == np.asarray(mask)[0].tolist() == [0, 3, 127, 255]


def test_a_16_bit_mask_with_a_transparent_gray_repaints_where_transparent():
    """OpenAI's edits mask: transparent = repaint. A 16-bit gray PNG states its transparency as one gray value."""
    values = np.full((4, 8), 1000, np.uint16)
    values[:, :3] = 40000
    data = encode(Image.fromarray(values), "PNG", transparency=1000)
    mask = decode_image(data, field="mask", max_pixels=MAX_PIXELS, mode="L", from_alpha=True).image
    assert np.asarray(mask)[0].tolist() == [0, 0, 0, 255, 255, 255, 255, 255]
    # Read as an image, or as a mask by value (not from alpha), it is scaled as usual.
    gray = decode_image(data, field="mask", max_pixels=MAX_PIXELS, mode="L").image
    assert np.asarray(gray)[0].tolist() == [40000 // 257] * 3 + [1000 // 257] * 5


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_allowed_formats_decode_to_a_clean_png(fmt):
    exif = Image.Exif()
    exif[0x010F] = "a camera maker"
    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", "secret")
    extra = {"pnginfo": info} if fmt == "PNG" else {"exif": exif.tobytes()}
    out = decode_image(encode(RED, fmt, **extra), field="image", max_pixels=MAX_PIXELS)
    assert out.source_format == fmt and out.image.size == (40, 24) and out.image.mode == "RGB"
    clean = Image.open(io.BytesIO(out.png))
    assert clean.format == "PNG" and clean.size == (40, 24)
    assert not clean.info and not clean.getexif()  # no text chunk, no EXIF, no ICC profile
    assert b"secret" not in out.png and b"camera" not in out.png


def test_exif_orientation_is_applied_then_dropped():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    out = decode_image(encode(RED, "JPEG", exif=exif.tobytes()), field="image", max_pixels=MAX_PIXELS)
    assert out.image.size == (24, 40)
    assert not Image.open(io.BytesIO(out.png)).getexif()


@pytest.mark.parametrize("orientation", range(1, 9))
def test_each_exif_orientation_turns_the_image_as_pillow_does(orientation):
    # A picture with no symmetry (a gradient across, a bar down one side), so every turn and flip differs.
    x = np.arange(40, dtype=np.uint8)[None, :, None] * 6
    pixels = np.broadcast_to(x, (24, 40, 3)).copy()
    pixels[:, :5, 1] = 255
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(Image.fromarray(pixels), "PNG", exif=exif.tobytes())
    out = decode_image(data, field="image", max_pixels=MAX_PIXELS).image
    expected = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    assert out.size == expected.size
    assert np.array_equal(np.asarray(out), np.asarray(expected))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_a_malformed_exif_entry_beside_the_orientation_still_decodes(fmt):
    # IFD0 with Orientation 6 and XResolution (a RATIONAL tag) holding ASCII "ab": Pillow's exif_transpose
    # raised TypeError rewriting that block (an audit's 500, 2026-11-28).
    entries = [(0x0112, 3, 1, struct.pack("<HH", 6, 0)), (0x011A, 2, 3, b"ab\0\0")]
    ifd = struct.pack("<H", len(entries))
    ifd += b"".join(struct.pack("<HHI", tag, kind, n) + value for tag, kind, n, value in entries)
    exif = b"Exif\0\0II*\0" + struct.pack("<I", 8) + ifd + struct.pack("<I", 0)
    out = decode_image(encode(RED, fmt, exif=exif), field="image", max_pixels=MAX_PIXELS)
    assert out.image.size == (24, 40)  # turned, then the EXIF dropped
    assert not Image.open(io.BytesIO(out.png)).getexif()


def test_mask_rules():
    mask = decode_image(
        encode(Image.new("RGB", (40, 24), "white"), "PNG"),
        field="mask",
        max_pixels=100_000,
        mode="L",
        size=(40, 24),
    )
    assert mask.image.mode == "L" and mask.image.getextrema() == (255, 255)
    with pytest.raises(ImageInputError) as e:
        decode_image(
            encode(Image.new("L", (41, 24)), "PNG"),
            field="mask",
            max_pixels=MAX_PIXELS,
            mode="L",
            size=(40, 24),
        )
    assert (e.value.field, e.value.rule) == ("mask", "size_mismatch")
    # OpenAI's edits masks: transparent is repainted (white), opaque kept (black).
    rgba = Image.new("RGBA", (2, 1), (0, 0, 0, 255))
    rgba.putpixel((1, 0), (0, 0, 0, 0))
    alpha = decode_image(encode(rgba, "PNG"), field="mask", max_pixels=100, mode="L", from_alpha=True)
    assert [alpha.image.getpixel((0, 0)), alpha.image.getpixel((1, 0))] == [0, 255]


@pytest.mark.parametrize(
    "value,rule",
    [
        ("data:image/png,iVBORw0KGgo=", "invalid_data_url"),  # not base64
        ("data:image/png;base64,@@@@", "invalid_base64"),
        ("data:image/png;base64,iVBORw0KGgo", "invalid_base64"),  # bad padding
        ("data:;base64,", "not_an_image"),
        ("data:image/png;base64," + "A" * 4000, "too_large"),
        ("datum", "invalid_data_url"),
    ],
    ids=["not-base64", "bad-characters", "bad-padding", "empty", "too-large", "not-a-data-url"],
)
def test_data_url_rules(value, rule):
    with pytest.raises(ImageInputError) as e:
        decode_data_url(value, field="image", max_bytes=2048)
    assert e.value.rule == rule


def test_the_declared_type_is_not_trusted():
    """A data URL saying image/png around a GIF is a GIF; around text, not an image."""
    assert sniff_format(encode(RED, "GIF")) == "GIF"
    data = decode_data_url(data_url(b"plain text", "image/png"), field="image", max_bytes=1 << 20)
    with pytest.raises(ImageInputError, match="not an image"):
        decode_image(data, field="image", max_pixels=MAX_PIXELS)


# ---- the API ------------------------------------------------------------------------------------------------


@pytest.fixture
async def api_img(make_settings):
    """The API with a fake worker serving toy (text only), toy-img (every image task), toy-i2i, toy-i2v and
    toy-fill (inpaint only) and toy-control (needs a control image)."""
    settings = make_settings(max_image_bytes=2 << 20, max_image_pixels=1 << 20, image_fetch_timeout_s=2.0)
    async with api_client(settings) as (client, store):
        worker = FakeWorker(store, models=(TOY, TOY_IMG, TOY_I2I, TOY_I2V, TOY_FILL, TOY_CONTROL))
        await worker.register()
        yield client, store, worker
        await worker.stop()


PNG = encode(RED, "PNG")
MASK = encode(Image.new("L", (40, 24), 255), "PNG")


async def test_an_image_job_carries_a_reference_not_bytes(api_img):
    client, store, worker = api_img
    noisy = encode(Image.frombytes("RGB", (700, 700), os.urandom(700 * 700 * 3)), "PNG")  # ~1.4 MB
    body = {"model": "toy-img", "prompt": "p", "image": data_url(noisy), "mask": None, "strength": 0.6}
    assert len(str(body)) > 1 << 20  # over the 1 MiB of routes without images
    r = await client.post("/v1/generate", json=body)
    assert r.status_code == 202, r.text
    job = r.json()
    ref = job["params"]["image"]
    assert ref.startswith("redis:") and job["params"]["strength"] == 0.6 and job["params"]["mask"] is None
    stored = await InputStore.of(store).get(ref)
    assert Image.open(io.BytesIO(stored)).size == (700, 700)
    key = InputStore.of(store).key(ref.split(":", 1)[1])
    assert 0 < await store.redis.ttl(key) <= store.settings.job_ttl_s
    # The job hash and its stream entry stay small: the reference, not the megabytes.
    job_hash = await store.redis.hgetall(store.job_key(job["id"]))
    assert sum(len(v) for v in job_hash.values()) < 4096
    # A mask and the task's default strength; the worker runs it like any job.
    r = await client.post(
        "/v1/generate",
        json={"model": "toy-img", "prompt": "p", "image": data_url(PNG), "mask": data_url(MASK)},
    )
    assert r.status_code == 202, r.text
    params = r.json()["params"]
    assert params["strength"] == 0.9999 and params["mask"].startswith("redis:")
    worker.start()
    r = await client.post(
        "/v1/generate",
        json={"model": "toy-img", "prompt": "p", "image": data_url(PNG)},
        headers={"Prefer": "wait=10"},
    )
    assert r.json()["status"] == "succeeded" and r.json()["params"]["strength"] == 0.3


async def test_a_control_image_job_carries_its_reference_and_runs(api_img):
    client, store, worker = api_img
    worker.start()
    body = {
        "model": "toy-control",
        "prompt": "p",
        "control_image": data_url(PNG),
        "control_guidance_end": 0.5,
    }
    r = await client.post("/v1/generate", json=body, headers={"Prefer": "wait=10"})
    assert r.status_code in (200, 202), r.text
    params = r.json()["params"]
    assert params["image"] is None and params["strength"] is None
    # the ControlNet's fields: the given one, the card's defaults for the others
    assert params["control_guidance_end"] == 0.5 and params["control_guidance_start"] == 0.0
    assert params["guess_mode"] is False and params["controlnet_conditioning_scale"] == 1.0
    stored = await InputStore.of(store).get(params["control_image"])
    assert Image.open(io.BytesIO(stored)).size == Image.open(io.BytesIO(PNG)).size
    assert r.json()["status"] == "succeeded", r.json()


def _bad(**fields):
    return {"model": "toy-img", "prompt": "p", "image": data_url(PNG), **fields}


# (request body, field, rule): every refusal of /v1/generate's image fields.
REFUSED_REQUESTS = [
    (_bad(image="data:image/png;base64,not base64!"), "image", "invalid_base64"),
    (_bad(image="data:image/png,abc"), "image", "invalid_data_url"),
    (_bad(image="just a string"), "image", "invalid_image_reference"),
    (_bad(image="ftp://example.com/a.png"), "image", "invalid_image_reference"),
    (_bad(image=data_url(b"GIF89a not really")), "image", "unsupported_format"),
    (_bad(image=data_url(encode(RED, "GIF"))), "image", "unsupported_format"),
    (_bad(image=data_url(b"\x00" * 100)), "image", "not_an_image"),
    (_bad(image=data_url(REFUSED_BYTES[10][1])), "image", "animated_not_allowed"),
    (_bad(image=data_url(_bomb())), "image", "too_many_pixels"),
    (_bad(image=data_url(b"x" * (3 << 20))), "image", "too_large"),
    (_bad(mask=data_url(encode(Image.new("L", (8, 8)), "PNG"))), "mask", "size_mismatch"),
    (_bad(mask="data:,x"), "mask", "invalid_data_url"),
    (_bad(strength=0), "strength", "greater_than"),
    (_bad(strength=1.5), "strength", "less_than_equal"),
    (_bad(strength=-0.1), "strength", "greater_than"),
    ({"model": "toy-img", "prompt": "p", "mask": data_url(MASK)}, "mask", "mask_without_image"),
    ({"model": "toy-img", "prompt": "p", "strength": 0.5}, "strength", "strength_without_image"),
    (_bad(padding_mask_crop=8), "padding_mask_crop", "padding_mask_crop_without_mask"),
    (_bad(mask=data_url(MASK), padding_mask_crop=-1), "padding_mask_crop", "greater_than_equal"),
    (_bad(mask=data_url(MASK), padding_mask_crop=2.5), "padding_mask_crop", "int_type"),
    (_bad(mask=data_url(MASK), padding_mask_crop=10**6), "padding_mask_crop", "less_than_equal"),
    (_bad(model="toy"), "image", "task_not_supported"),
    (_bad(model="toy-i2i", mask=data_url(MASK)), "mask", "task_not_supported"),
    (_bad(strength=0.2, num_inference_steps=4), "strength", "no_steps"),  # SDXL's rule: int(4 * 0.2) = 0
    # The task's default strength (0.3) of 3 steps runs none either: refused now, not a job that fails later.
    (_bad(num_inference_steps=3), "num_inference_steps", "no_steps"),
    (_bad(image=""), "image", "string_too_short"),  # was a 500
    (_bad(mask=""), "mask", "string_too_short"),  # was inpaint's strength on an image-to-image job
    ({"model": "toy-i2v", "prompt": "p"}, "image", "missing"),
    (_bad(model="toy-i2v", strength=0.5), "strength", "not_supported"),
    (_bad(model="toy-i2v", mask=data_url(MASK)), "mask", "task_not_supported"),
    ({"model": "toy-fill", "prompt": "p"}, "image", "missing"),
    (_bad(model="toy-fill"), "mask", "missing"),  # an inpainting model: an image alone is not its task
    (_bad(control_image=data_url(PNG)), "control_image", "not_supported"),
    (_bad(controlnet_conditioning_scale=0.5), "controlnet_conditioning_scale", "not_supported"),
    (_bad(controlnet_conditioning_scale=11), "controlnet_conditioning_scale", "less_than_equal"),
    ({"model": "toy-control", "prompt": "p"}, "control_image", "missing"),
    (_bad(control_guidance_start=0.2), "control_guidance_start", "not_supported"),
    (_bad(control_guidance_end=0.8), "control_guidance_end", "not_supported"),
    (_bad(guess_mode=True), "guess_mode", "not_supported"),
    (_bad(model="toy-control", guess_mode="yes"), "guess_mode", "bool_type"),
    (_bad(model="toy-control", control_guidance_start=1), "control_guidance_start", "less_than"),
    (_bad(model="toy-control", control_guidance_end=0), "control_guidance_end", "greater_than"),
    (_bad(model="toy-control", control_guidance_end=1.5), "control_guidance_end", "less_than_equal"),
    (
        {"model": "toy-control", "prompt": "p", "control_guidance_start": 0.6, "control_guidance_end": 0.4},
        "control_guidance_end",
        "out_of_range",
    ),
    ({"model": "toy-control", "prompt": "p", "control_guidance_start": 0.5}, "control_image", "missing"),
    (
        {"model": "toy-control", "prompt": "p", "control_image": "data:,x"},
        "control_image",
        "invalid_data_url",
    ),
    (
        {"model": "toy-control", "prompt": "p", "control_image": data_url(b"x" * 99)},
        "control_image",
        "not_an_image",
    ),
    ({"model": "toy-control", "prompt": "p", "control_image": ""}, "control_image", "string_too_short"),
    (
        {"model": "toy-control", "prompt": "p", "control_image": "http://127.0.0.1:6379/"},
        "control_image",
        "url_not_allowed",
    ),
    (_bad(image="http://127.0.0.1:6379/"), "image", "url_not_allowed"),
    (_bad(image="http://169.254.169.254/latest/meta-data/"), "image", "url_not_allowed"),
    (_bad(image="http://2130706433/a.png"), "image", "url_not_allowed"),
    (_bad(image="http://[::ffff:10.0.0.1]/a.png"), "image", "url_not_allowed"),
]


@pytest.mark.parametrize(
    "body,field,rule", REFUSED_REQUESTS, ids=[f"{f}-{r}-{i}" for i, (_, f, r) in enumerate(REFUSED_REQUESTS)]
)
async def test_refused_requests_are_422s(api_img, body, field, rule):
    client, store, _ = api_img
    r = await client.post("/v1/generate", json=body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["field"], error["code"]) == (field, rule), error
    # Nothing was queued and nothing stored.
    assert [k async for k in store.redis.scan_iter(f"{store.prefix}:input:*")] == []
    assert [k async for k in store.redis.scan_iter(f"{store.prefix}:job:*")] == []


async def test_strength_and_video_tasks_admitted(api_img):
    client, *_ = api_img
    r = await client.post("/v1/generate", json=_bad(strength=0.25, num_inference_steps=4))
    assert r.status_code == 202 and r.json()["params"]["strength"] == 0.25, r.text
    r = await client.post("/v1/generate", json=_bad(model="toy-i2v"))
    assert r.status_code == 202, r.text
    assert r.json()["params"]["strength"] is None and r.json()["params"]["num_frames"] == 9


async def test_inputs_in_an_object_store():
    """With `output_dir` set, inputs go to the object store beside the outputs (memory:// here)."""
    inputs = InputStore(None, "p", 60, OutputStore("memory://"))
    ref = await inputs.put(PNG)
    assert ref.startswith("store:") and await inputs.get(ref) == PNG
    await inputs.delete(ref)
    assert await inputs.get(ref) is None
    for bad in ("store:../../etc/passwd", "redis:x", "", "store:" + "A" * 21):
        assert await inputs.get(bad) is None


async def test_image_urls_are_fetched_before_the_job_is_accepted(make_settings):
    async def routes(path, headers, reader, writer):
        if path == "/red.png":
            writer.write(answer(200, PNG, {"content-type": "image/png"}))
        elif path == "/lies.png":  # says image/png, is HTML
            writer.write(answer(200, b"<html>hi</html>", {"content-type": "image/png"}))
        elif path == "/to-metadata":
            writer.write(answer(302, headers={"location": "http://169.254.169.254/latest/"}))
        elif path == "/silent":
            await asyncio.sleep(10)
        else:
            writer.write(answer(404))
        await writer.drain()

    settings = make_settings(
        image_fetch_allow_private=True, image_fetch_timeout_s=0.5, max_image_pixels=1 << 20
    )
    async with api_client(settings) as (client, store), http_server(routes) as (port, seen):
        await FakeWorker(store, models=(TOY_IMG,)).register()
        base = f"http://127.0.0.1:{port}"
        r = await client.post("/v1/generate", json={"prompt": "p", "image": f"{base}/red.png"})
        assert r.status_code == 202, r.text
        stored = await InputStore.of(store).get(r.json()["params"]["image"])
        assert Image.open(io.BytesIO(stored)).size == (40, 24)
        for path, rule in [
            ("/lies.png", "not_an_image"),
            ("/missing.png", "fetch_failed"),
            ("/to-metadata", "url_not_allowed"),
            ("/silent", "fetch_failed"),
        ]:
            r = await client.post("/v1/generate", json={"prompt": "p", "image": f"{base}{path}"})
            assert r.status_code == 422, r.text
            assert (r.json()["error"]["field"], r.json()["error"]["code"]) == ("image", rule), r.text
        assert ("timed out" in r.json()["error"]["message"]) or (
            "no complete answer" in r.json()["error"]["message"]
        )


async def test_fetched_bytes_count_against_the_process_budget_until_the_request_ends(make_settings):
    """A URL that sends its bytes and holds back the last one holds them in the API: they count against
    `max_buffered_body_bytes` with the bodies, and a fetch that would pass it is a 503 (an audit's 150 such
    requests held 1.8 GB)."""
    big = encode(Image.fromarray(np.random.default_rng(0).integers(0, 256, (480, 480, 3), np.uint8)), "PNG")
    assert 600 << 10 < len(big) < 1 << 20
    release = asyncio.Event()

    async def routes(path, headers, reader, writer):
        head = answer(200, big, {"content-type": "image/png"})
        if path == "/held.png":
            writer.write(head[:-1])
            await writer.drain()
            await release.wait()
            writer.write(head[-1:])
        else:
            writer.write(head)
        await writer.drain()

    settings = make_settings(image_fetch_allow_private=True, max_buffered_body_bytes=1 << 20)
    async with api_client(settings) as (client, store), http_server(routes) as (port, _):
        await FakeWorker(store, models=(TOY_IMG,)).register()
        base = f"http://127.0.0.1:{port}"
        held = asyncio.create_task(
            client.post("/v1/generate", json={"prompt": "p", "image": f"{base}/held.png"})
        )
        await asyncio.sleep(0.3)
        r = await client.post("/v1/generate", json={"prompt": "p", "image": f"{base}/now.png"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy", r.text
        assert r.headers["retry-after"] == "1"
        release.set()
        assert (await held).status_code == 202
        r = await client.post("/v1/generate", json={"prompt": "p", "image": f"{base}/now.png"})
        assert r.status_code == 202, r.text  # the first request's bytes were given back when it ended


async def test_images_are_decoded_a_few_at_a_time(make_settings, monkeypatch):
    """What a decode holds follows its pixels, not its bytes (an 87 KB PNG of 4096 x 4096 zeros held ~170 MB):
    `image_decode_slots` bounds the decodes running at once; the requests over it wait, then are accepted."""
    from meshserve.service.api import image_requests

    running, most = 0, 0

    def slow_decode(*args, **kwargs):
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            time.sleep(0.1)
            return decode_image(*args, **kwargs)
        finally:
            running -= 1

    monkeypatch.setattr(image_requests, "decode_image", slow_decode)
    async with api_client(make_settings(image_decode_slots=2)) as (client, store):
        await FakeWorker(store, models=(TOY_IMG,)).register()
        body = {"prompt": "p", "image": data_url(PNG), "mask": data_url(MASK)}
        answers = await asyncio.gather(*(client.post("/v1/generate", json=body) for _ in range(5)))
    assert [r.status_code for r in answers] == [202] * 5
    assert most == 2


async def test_body_limits(make_settings):
    """/v1/generate and /v1/images/edits take max_image_body_bytes; other routes keep max_body_bytes."""
    settings = make_settings(max_body_bytes=4096, max_image_body_bytes=64 * 1024, max_image_pixels=1 << 20)
    async with api_client(settings) as (client, store):
        await FakeWorker(store, models=(TOY_IMG,)).register()
        r = await client.post(
            "/v1/generate",
            json={
                "prompt": "p",
                "image": data_url(PNG),
                "metadata": {"a": "x" * 1000, "b": "x" * 1000, "c": "x" * 1000, "d": "x" * 1000},
            },
        )
        assert r.status_code == 202, r.text  # over 4 KiB, under 64 KiB
        big = {"prompt": "p", "image": data_url(b"x" * 70_000)}
        assert (await client.post("/v1/generate", json=big)).status_code == 413
        r = await client.post("/v1/images/generations", json={"prompt": "x" * 5000})
        assert r.status_code == 413


async def test_refused_submit_and_replay_leave_no_input(make_settings):
    settings = make_settings(queue_max_length=1, max_image_pixels=1 << 20)
    async with api_client(settings) as (client, store):
        await FakeWorker(store, models=(TOY_IMG,)).register()
        body = {"prompt": "p", "image": data_url(PNG)}
        first = await client.post("/v1/generate", json=body, headers={"Idempotency-Key": "k1"})
        replay = await client.post("/v1/generate", json=body, headers={"Idempotency-Key": "k1"})
        assert first.json()["id"] == replay.json()["id"]
        full = await client.post("/v1/generate", json=body)
        assert full.status_code == 429
        inputs = [k async for k in store.redis.scan_iter(f"{store.prefix}:input:*")]
        assert len(inputs) == 1  # the first job's only


async def test_models_list_tasks_and_strength(api_img):
    client, *_ = api_img
    cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert cards["toy"]["tasks"] == ["text-to-image"] and cards["toy"]["limits"]["strength"] is None
    assert cards["toy-img"]["tasks"] == ["text-to-image", "image-to-image", "inpaint"]
    assert cards["toy-img"]["limits"]["strength"] == {
        "min": 0.0,
        "max": 1.0,
        "defaults": {"image-to-image": 0.3, "inpaint": 0.9999},
        "rule": "int",
    }
    assert cards["toy-i2v"]["tasks"] == ["image-to-video"] and cards["toy-i2v"]["limits"]["strength"] is None


# ---- /v1/images/edits (multipart, OpenAI's shape) ---------------------------------------------------------


async def test_images_edits(api_img):
    client, store, worker = api_img
    worker.start()
    rgba = Image.new("RGBA", (40, 24), (0, 0, 0, 255))
    for x in range(20):
        for y in range(24):
            rgba.putpixel((x, y), (0, 0, 0, 0))  # the left half transparent: repainted
    files = {"image": ("in.png", PNG, "image/png"), "mask": ("mask.png", encode(rgba, "PNG"), "image/png")}
    data = {"prompt": "a cat", "model": "toy-img", "n": "2", "size": "64x48", "response_format": "b64_json"}
    r = await client.post("/v1/images/edits", files=files, data=data)
    assert r.status_code == 200, r.text
    images = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in r.json()["data"]]
    assert [im.size for im in images] == [(64, 48), (64, 48)]
    jobs = [k async for k in store.redis.scan_iter(f"{store.prefix}:job:*")]
    (job,) = [await store.get(k.rsplit(":", 1)[1]) for k in jobs]
    mask = Image.open(io.BytesIO(await InputStore.of(store).get(job.params.mask)))
    assert mask.getpixel((0, 0)) == 255 and mask.getpixel((39, 0)) == 0
    # Without a mask: image-to-image, answered with URLs.
    r = await client.post(
        "/v1/images/edits",
        files={"image": ("in.png", PNG, "image/png")},
        data={"prompt": "a cat", "model": "toy-i2i"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["url"].startswith("http://testserver/v1/jobs/")


async def test_an_edit_without_a_mask_reads_the_images_transparency_as_one(api_img):
    """OpenAI's dall-e-2 rule: with no mask, the image's transparent pixels are repainted (an audit's edit of an
    image with a hole ran as image-to-image). An opaque image with an alpha channel, or a model without inpaint,
    is edited whole (image-to-image), as before."""
    client, store, worker = api_img
    worker.start()
    holed = Image.new("RGBA", (40, 24), (200, 0, 0, 255))
    for x in range(10, 20):
        for y in range(24):
            holed.putpixel((x, y), (0, 0, 0, 0))
    opaque = Image.new("RGBA", (40, 24), (200, 0, 0, 255))
    data = {"prompt": "a cat", "size": "64x48", "response_format": "b64_json"}
    for model, picture in (("toy-img", holed), ("toy-img", opaque), ("toy-i2i", holed)):
        files = {"image": ("in.png", encode(picture, "PNG"), "image/png")}
        r = await client.post("/v1/images/edits", files=files, data={**data, "model": model})
        assert r.status_code == 200, r.text
    jobs = [
        await store.get(k.rsplit(":", 1)[1]) async for k in store.redis.scan_iter(f"{store.prefix}:job:*")
    ]
    by_model = sorted(((j.model, j.params.mask is not None, j.params.strength) for j in jobs), key=str)
    defaults = TOY_IMG.limits.strength.defaults
    assert sorted(by_model, key=str) == sorted(
        [("toy-img", True, defaults["inpaint"]), ("toy-img", False, defaults["image-to-image"]),
         ("toy-i2i", False, TOY_I2I.limits.strength.defaults["image-to-image"])], key=str)  # fmt: skip
    (inpaint,) = [j for j in jobs if j.params.mask is not None]
    mask = Image.open(io.BytesIO(await InputStore.of(store).get(inpaint.params.mask)))
    assert mask.getpixel((15, 5)) == 255 and mask.getpixel((5, 5)) == mask.getpixel((30, 5)) == 0
    # The same with an Idempotency-Key: the fields hashed for the key were taken for the request's (a 500 until
    # 2026-11-29).
    files = {"image": ("in.png", encode(holed, "PNG"), "image/png")}
    for _ in range(2):
        r = await client.post(
            "/v1/images/edits",
            files=files,
            data={**data, "model": "toy-img"},
            headers={"Idempotency-Key": "h"},
        )
        assert r.status_code == 200, r.text
    keyed = [
        job
        for job in [
            await store.get(k.rsplit(":", 1)[1]) async for k in store.redis.scan_iter(f"{store.prefix}:job:*")
        ]
        if job.id not in {j.id for j in jobs}
    ]
    assert [(j.params.mask is not None, j.params.strength) for j in keyed] == [(True, defaults["inpaint"])]


async def test_an_edit_takes_padding_mask_crop_with_a_mask_or_a_transparent_image(api_img):
    """/v1/generate's `padding_mask_crop` as a form field: the job's, when the edit is an inpaint (a mask part,
    or an image with transparent pixels); an opaque image without a mask is an image-to-image, which has no
    mask to crop around: refused, and nothing stored. The field is part of an Idempotency-Key's request."""
    client, store, worker = api_img
    worker.start()
    holed = Image.new("RGBA", (40, 24), (200, 0, 0, 255))
    for x in range(10, 20):
        holed.putpixel((x, 3), (0, 0, 0, 0))
    opaque = encode(Image.new("RGBA", (40, 24), (200, 0, 0, 255)), "PNG")
    data = {"prompt": "a cat", "model": "toy-img", "size": "64x48", "padding_mask_crop": "6"}
    for files in (
        {"image": ("in.png", PNG, "image/png"), "mask": ("m.png", MASK, "image/png")},
        {"image": ("in.png", encode(holed, "PNG"), "image/png")},
    ):
        r = await client.post("/v1/images/edits", files=files, data=data)
        assert r.status_code == 200, r.text
    jobs = [
        await store.get(k.rsplit(":", 1)[1]) async for k in store.redis.scan_iter(f"{store.prefix}:job:*")
    ]
    assert sorted((j.params.mask is not None, j.params.padding_mask_crop) for j in jobs) == [(True, 6)] * 2
    inputs = {k async for k in store.redis.scan_iter(f"{store.prefix}:input:*")}
    for files, extra, rule in (
        ({"image": ("in.png", opaque, "image/png")}, {}, "padding_mask_crop_without_mask"),
        ({"image": ("in.png", PNG, "image/png")}, {}, "padding_mask_crop_without_mask"),
        ({"image": ("in.png", PNG, "image/png"), "mask": ("m.png", MASK, "image/png")},
         {"padding_mask_crop": "-1"}, "greater_than_equal"),
        ({"image": ("in.png", PNG, "image/png"), "mask": ("m.png", MASK, "image/png")},
         {"padding_mask_crop": "2.5"}, "int_parsing"),
    ):  # fmt: skip
        r = await client.post("/v1/images/edits", files=files, data={**data, **extra})
        assert r.status_code == 422, r.text
        assert (r.json()["error"]["field"], r.json()["error"]["code"]) == ("padding_mask_crop", rule), r.text
    assert {k async for k in store.redis.scan_iter(f"{store.prefix}:input:*")} == inputs
    files = {"image": ("in.png", PNG, "image/png"), "mask": ("m.png", MASK, "image/png")}
    key = {"Idempotency-Key": "crop"}
    first = await client.post("/v1/images/edits", files=files, data=data, headers=key)
    assert first.status_code == 200, first.text
    r = await client.post(
        "/v1/images/edits", files=files, data={**data, "padding_mask_crop": "7"}, headers=key
    )
    assert r.status_code == 422 and r.json()["error"]["code"] == "idempotency_key_reused", r.text


@pytest.mark.parametrize(
    "files,data,field,rule",
    [
        ({}, {"prompt": "p"}, "image", "missing"),
        ({"image": ("a.png", PNG, "image/png")}, {}, "prompt", "missing"),
        ({"image": ("a.txt", b"hello", "text/plain")}, {"prompt": "p"}, "image", "not_an_image"),
        (
            {"image": ("a.gif", encode(RED, "GIF"), "image/png")},
            {"prompt": "p"},
            "image",
            "unsupported_format",
        ),
        (
            {
                "image": ("a.png", PNG, "image/png"),
                "mask": ("m.png", encode(Image.new("L", (8, 8)), "PNG"), "image/png"),
            },
            {"prompt": "p"},
            "mask",
            "size_mismatch",
        ),
        (
            {"image": ("a.png", PNG, "image/png")},
            {"prompt": "p", "model": "toy"},
            "image",
            "task_not_supported",
        ),
        ({"image": ("a.png", PNG, "image/png")}, {"prompt": "p", "size": "65x48"}, "size", "not_multiple"),
        (
            {"image": ("a.png", PNG, "image/png")},
            {"prompt": "p", "strength": "2"},
            "strength",
            "less_than_equal",
        ),
        (
            {"image": ("a.png", PNG, "image/png")},
            {"prompt": "p", "strength": "nan"},
            "strength",
            "finite_number",
        ),
        (
            {"image": ("a.png", PNG, "image/png")},
            {"prompt": "p", "response_format": "gif"},
            "response_format",
            "literal_error",
        ),
        ({"image": ("a.png", b"x" * (3 << 20), "image/png")}, {"prompt": "p"}, "image", "too_large"),
    ],
)
async def test_images_edits_refusals(api_img, files, data, field, rule):
    client, store, _ = api_img
    data = {"model": "toy-img", **data}
    r = await client.post("/v1/images/edits", files=files or {"x": ("x", b"", "text/plain")}, data=data)
    assert r.status_code == 422, r.text
    assert (r.json()["error"]["field"], r.json()["error"]["code"]) == (field, rule), r.text
    assert [k async for k in store.redis.scan_iter(f"{store.prefix}:input:*")] == []


async def test_an_unreadable_multipart_form_is_a_422_that_says_so(api_img):
    """It was answered `invalid_json`, "the body is not valid JSON" (an audit's finding)."""
    client, *_ = api_img
    for content_type in ("multipart/form-data", "multipart/form-data; boundary=xyz"):
        r = await client.post("/v1/images/edits", content=b"garbage", headers={"content-type": content_type})
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_form", r.text
    r = await client.post("/v1/images/edits", files={f"f{i}": ("a", b"x") for i in range(1001)})
    assert r.status_code == 422 and "Too many files" in r.json()["error"]["message"]


async def test_an_edits_output_compression_is_its_jobs(api_img):
    client, store, worker = api_img
    worker.start()
    files = {"image": ("in.png", PNG, "image/png")}
    data = {"prompt": "a cat", "model": "toy-img", "size": "64x48", "output_format": "webp"}
    r = await client.post("/v1/images/edits", files=files, data={**data, "output_compression": "30"})
    assert r.status_code == 200, r.text
    (job,) = [
        await store.get(k.rsplit(":", 1)[1]) async for k in store.redis.scan_iter(f"{store.prefix}:job:*")
    ]
    assert (job.params.output_format, job.params.output_compression) == ("webp", 30)
    for extra, rule in (
        ({"output_format": "png"}, "not_supported"),
        ({"output_compression": "101"}, "less_than_equal"),
    ):
        r = await client.post(
            "/v1/images/edits", files=files, data={**data, "output_compression": "30", **extra}
        )
        assert r.status_code == 422, r.text
        assert (r.json()["error"]["field"], r.json()["error"]["code"]) == ("output_compression", rule), r.text


async def test_images_edits_take_one_image_and_one_mask(api_img):
    """A second image (or mask) part, or OpenAI's several-image `image[]`, is refused naming the field: the form
    reader kept one silently. Nothing is stored."""
    client, store, _ = api_img
    png = ("a.png", PNG, "image/png")
    for files, field in (
        ([("image", png), ("image", png)], "image"),
        ([("image", png), ("image[]", png)], "image"),
        ([("image", png), ("mask", png), ("mask", png)], "mask"),
        ([("image", png), ("prompt", (None, b"second"))], "prompt"),
    ):
        r = await client.post("/v1/images/edits", files=files, data={"model": "toy-img", "prompt": "p"})
        assert r.status_code == 422, r.text
        assert (r.json()["error"]["field"], r.json()["error"]["code"]) == (field, "too_many"), r.text
    assert [k async for k in store.redis.scan_iter(f"{store.prefix}:input:*")] == []
    # One `image[]` (an SDK's list of one) is the image; a text field in its place is refused as such.
    worker = api_img[2]
    worker.start()
    data = {"model": "toy-img", "prompt": "p", "size": "64x48", "response_format": "b64_json"}
    r = await client.post("/v1/images/edits", files=[("image[]", png)], data=data)
    assert r.status_code == 200, r.text
    for text in ("image", "image[]"):
        r = await client.post("/v1/images/edits", files=[("x", png)], data={**data, text: "text"})
        assert r.status_code == 422 and r.json()["error"]["field"] == "image", r.text


async def test_an_edit_retried_with_its_idempotency_key_is_the_same_job(api_img):
    """OpenAI's SDKs retry a 5xx as a new request: with the same key and files it returns the first job (its
    stored inputs reused, the retry's dropped); other files under the key are a conflict."""
    client, store, worker = api_img
    worker.start()
    files = {"image": ("in.png", PNG, "image/png"), "mask": ("mask.png", MASK, "image/png")}
    data = {"prompt": "a cat", "model": "toy-img", "size": "64x48", "response_format": "b64_json"}
    key = {"Idempotency-Key": "edit-1"}
    first = await client.post("/v1/images/edits", files=files, data=data, headers=key)
    again = await client.post("/v1/images/edits", files=files, data=data, headers=key)
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert first.json()["data"] == again.json()["data"]
    assert len([k async for k in store.redis.scan_iter(f"{store.prefix}:job:*")]) == 1
    other = {**files, "image": ("in.png", encode(Image.new("RGB", (40, 24), (0, 9, 0)), "PNG"), "image/png")}
    r = await client.post("/v1/images/edits", files=other, data=data, headers=key)
    assert r.status_code == 422, r.text

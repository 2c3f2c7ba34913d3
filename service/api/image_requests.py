"""A request's image inputs, between the route and the job: read (data URL or fetched URL), decoded under the
rules of service/image_inputs.py, re-encoded, stored (service/input_store.py), and referenced by the job.

Everything here happens before the job is accepted: a URL that cannot be fetched, bytes that are not an image,
a mask of another size are 422s naming the field and the rule, never a job that fails later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from meshserve.service import metrics
from meshserve.service.api.errors import ApiError, FieldError
from meshserve.service.contract import IMAGE_INPUT_FIELDS, Job, JobParams
from meshserve.service.image_inputs import ImageInputError, decode_image, read_image_field
from meshserve.service.input_store import InputStore
from meshserve.service.settings import Settings
from meshserve.service.ssrf import FetchError
from meshserve.service.store import Store


def _refused(e: ImageInputError) -> FieldError:
    metrics.JOBS_REJECTED.labels("invalid").inc()
    return FieldError(e.field, e.rule, e.message)


async def read_image_fields(
    fields: dict[str, str | None], settings: Settings, hold: Callable[[int], bool] | None = None
) -> dict[str, bytes]:
    """The bytes of a request's image fields by name (`image`, `mask`, `last_image`, `control_image`: data URLs, or http(s)
    URLs fetched now; the fields given). `hold`: the
    request's own share of the process's buffered bytes (service/api/body_limit.py), for the bytes fetched: a
    hundred URLs that each sent 10 MB and held back their last byte took an API to 1.8 GB with nothing to bound
    it (an audit, 2026-11-28); over the budget the request is a 503 `server_busy`, as a body would be."""
    out = {}
    try:
        for name, value in fields.items():
            if value is not None:
                out[name] = await read_image_field(value, field=name, settings=settings, hold=hold)
    except ImageInputError as e:
        raise _refused(e) from None
    except FetchError as e:  # "busy": read_image_field turns every other one into an ImageInputError
        raise ApiError(503, "server_busy", e.message, None, {"Retry-After": "1"}) from None
    return out


async def with_image_inputs(
    store: Store,
    settings: Settings,
    params: JobParams,
    image: bytes | None,
    mask: bytes | None,
    *,
    decode_slots: asyncio.Semaphore,
    mask_from_alpha: bool = False,
    alpha_as_mask: bool = False,
    last_image: bytes | None = None,
    control_image: bytes | None = None,
) -> JobParams:
    """Decode the image (and mask, or a first-last-frame video's last image) and a control model's control image,
    store the re-encoded PNGs and return the params carrying their references. Decoding runs in a thread (a
    4096 x 4096 JPEG takes a second, which the event loop must not wait on), holding one of the process's
    `decode_slots` (settings.image_decode_slots says why).
    `alpha_as_mask` (OpenAI's edits): without a mask, an image with transparent pixels is its own mask."""
    decoded = {}
    try:
        if image is not None:
            decoded["image"] = await _decoded(decode_slots, image, field="image", settings=settings)
            if mask is None and alpha_as_mask and decoded["image"].transparent:
                mask = image
            if mask is not None:
                decoded["mask"] = await _decoded(
                    decode_slots,
                    mask,
                    field="mask",
                    settings=settings,
                    mode="L",
                    size=decoded["image"].image.size,
                    from_alpha=mask_from_alpha,
                )
        for name, data in (("last_image", last_image), ("control_image", control_image)):
            if data is not None:
                decoded[name] = await _decoded(decode_slots, data, field=name, settings=settings)
    except ImageInputError as e:
        raise _refused(e) from None
    inputs = InputStore.of(store)
    return params.model_copy(update={name: await inputs.put(d.png) for name, d in decoded.items()})


async def _decoded(decode_slots: asyncio.Semaphore, data: bytes, *, field: str, settings: Settings, **kw):
    async with decode_slots:
        return await asyncio.to_thread(
            decode_image, data, field=field, max_pixels=settings.max_image_pixels, **kw
        )


async def drop_unused_inputs(store: Store, params: JobParams, job: Job | None) -> None:
    """Delete the inputs stored for a submit that did not make a job with them (refused: queue full, too many
    active jobs; or an idempotent replay answered with the earlier job)."""
    inputs = InputStore.of(store)
    for name in IMAGE_INPUT_FIELDS:
        ref = getattr(params, name)
        if ref is not None and (job is None or getattr(job.params, name) != ref):
            await inputs.delete(ref)

"""Live previews into a running job's event stream (the worker side; docs/previews.md).

A preview is one `preview` event in the job's capped events stream (`P:events:{id}`, the one SSE reads), with
data `{"step", "total_steps", "index", "image"}` where `image` is a small WebP data URL. The write is fenced
like a progress event: only the attempt that holds the job, while it runs, adds one; so a preview never
follows the job's terminal event. What bounds the stream's size: the stream's own cap (`events_max_length`
entries), a job's period (`preview_every`, about ten per run by default), the worker publishing at most the
newest preview per output every progress round (0.25 s) and refusing any above `MAX_PREVIEW_CHARS`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from meshserve.service.contract import Delivery
from meshserve.service.store_lua import _COMMON

# A 128 px WebP of a smooth picture is 2-6 KB (a 1024 px SDXL's 128x128 latents at quality 70: ~5 KB); a data
# URL past this is refused rather than written into the stream.
MAX_PREVIEW_CHARS = 64 * 1024

# ARGV: P, job id, attempt, events maxlen, data. 1: written, 0: not (fenced, or the job is not running).
PREVIEW = (
    _COMMON
    + r"""
local jk = P .. ':job:' .. ARGV[2]
local st = owned(jk, ARGV[3])
if not st or st[1] ~= 'running' then return 0 end
event(ARGV[2], 'preview', ARGV[5], ARGV[4])
return 1
"""
)


async def publish_previews(store, previews: Sequence[tuple[Delivery, int, int, int, str]]) -> list[bool]:
    """(delivery, output index, step, total steps, data URL) each -> written, in one round trip."""
    script = getattr(store, "_preview_script", None)
    if script is None:
        script = store._preview_script = store.redis.register_script(PREVIEW)
    maxlen = store.settings.events_max_length
    async with store.redis.pipeline(transaction=False) as pipe:
        for delivery, index, step, total, url in previews:
            data = json.dumps({"step": step, "total_steps": total, "index": index, "image": url})
            await script(
                keys=[], args=[store.prefix, delivery.job.id, delivery.attempt, maxlen, data], client=pipe
            )
        res = await pipe.execute()
    return [bool(r) for r in res]

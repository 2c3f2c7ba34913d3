"""Output storage: where a job's encoded outputs are written before its commit, how they are read back and
deleted, and their client URLs (signed afresh on every read when the settings ask for signed URLs).

In Redis (the default): a worker SETs each output's bytes (with `output_ttl_s`) under `P:staged:{id}:{attempt}:{i}`
with plain commands; the fenced commit (the END script, service/job_queue.py) only RENAMEs them to `P:out:{id}:{i}`.

In object storage (Settings.output_dir; service/output_store.py): `<output_dir>/<job id>/<out key>/<index>.<ext>`,
where the out key is `<token>-<attempt>`. The token (128 random bits, drawn at submit and kept in the job hash)
makes the path, and so an `output_url_base` URL, unguessable even to whoever knows the job id (worker logs name job
ids): such URLs are bearer links (docs/security.md). The attempt makes each delivery write its own objects: a stale
attempt (its lease lapsed, another delivery took the job) that writes after the new one committed cannot replace
the committed bytes with its own (another pool's mesh rounds differently, so they need not be identical); the fenced
commit records which key won (`out_key`). A loser's objects are never referenced, and it deletes them when its commit
is refused (`_drop_refused_objects`): a job deleted while its worker was still writing would otherwise keep them
for good, since the job's own `delete_outputs` ran before they landed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

from meshserve.service.contract import Delivery, Job, OutputBlob
from meshserve.service.output_store import OutputStoreError
from meshserve.service.store_base import EXTENSIONS, StoreBase, valid_job_id

log = logging.getLogger(__name__)

_OUTPUT_TOKEN = re.compile(r"^[A-Za-z0-9_-]{22}\Z")  # secrets.token_urlsafe(16)


class JobOutputs(StoreBase):
    async def _write_outputs(
        self, delivery: Delivery, outputs: list[OutputBlob]
    ) -> tuple[list[str], str | None, list[tuple[str, str]]] | None:
        """Write an attempt's outputs where its commit takes them from. Returns their client URLs, the object key
        (object storage) and the (staged, final) Redis key pairs to rename (Redis); None when the job's hash is gone
        (nothing written: there is nothing to commit). Raises `OutputStoreError` when an object cannot be written."""
        job = delivery.job
        urls = [f"/v1/jobs/{job.id}/outputs/{o.index}" for o in outputs]
        if self.outputs is None:
            return urls, None, await self._stage_outputs(delivery, outputs)
        unknown = sorted({o.content_type for o in outputs} - set(EXTENSIONS))
        if unknown:
            raise ValueError(f"outputs of job {job.id} have content types with no format: {unknown}")
        token = await self.redis.hget(self.job_key(job.id), "out_token")
        if not (token and _OUTPUT_TOKEN.match(token)):  # every submitted job has one: this one is gone
            return None
        out_key = f"{token}-{delivery.attempt}"
        # Every write ends before an error is raised: one still in flight would land after the caller's cleanup
        # (a failed job's delete_outputs) and leave its object behind.
        ended = await asyncio.gather(
            *(
                self.outputs.put(job.id, o.index, EXTENSIONS[o.content_type], o.data, key=out_key)
                for o in outputs
            ),
            return_exceptions=True,
        )
        errors = [e for e in ended if isinstance(e, BaseException)]
        if errors:
            e = next((e for e in errors if isinstance(e, OutputStoreError)), errors[0])
            if not isinstance(e, OutputStoreError):
                raise e
            # The message goes to worker logs and the job's error: without the path's secret segment.
            raise OutputStoreError(str(e).replace(token, "<token>")) from e.__cause__
        urls = await self._output_urls(job.id, out_key, [(o.index, o.content_type) for o in outputs])
        return urls, out_key, []

    async def _drop_refused_objects(self, job_id: str, out_key: str) -> None:
        """Delete the objects an attempt wrote under `out_key` after its commit was refused (another attempt
        committed, or the job was canceled or deleted meanwhile). Kept when the job records this very key: a
        commit that landed whose reply was lost, then repeated. A failure is logged, not raised: the job's
        outcome stands, and the bucket's lifecycle rule is the backstop."""
        assert self.outputs is not None
        if await self.redis.hget(self.job_key(job_id), "out_key") == out_key:
            return
        try:
            dropped = await self.outputs.delete(job_id, key=out_key)
        except OutputStoreError as e:
            log.warning("job %s: cannot delete a refused attempt's outputs: %s", job_id, e)
            return
        if dropped:
            log.info("job %s: deleted %d outputs of an attempt whose commit was refused", job_id, dropped)

    async def _stage_outputs(self, delivery: Delivery, outputs: list[OutputBlob]) -> list[tuple[str, str]]:
        """SET each output's bytes (with `output_ttl_s`) under this attempt's staged key, with plain commands in
        one pipeline: a script would block Redis for the whole copy. Returns (staged, final) key pairs."""
        job_id, ttl = delivery.job.id, self.settings.output_ttl_s
        pairs = [
            (self.staged_output_key(job_id, delivery.attempt, o.index), self.output_key(job_id, o.index))
            for o in outputs
        ]
        async with self._raw.pipeline(transaction=False) as pipe:
            for (staged, _), out in zip(pairs, outputs, strict=True):
                pipe.set(staged, out.data, ex=ttl)
            await pipe.execute()
        return pairs

    async def output(self, job_id: str, index: int) -> bytes | None:
        """The stored bytes of output `index` (None: unknown, expired, or deleted)."""
        if not valid_job_id(job_id):
            return None
        if self.outputs is None:
            return await self._raw.get(self.output_key(job_id, index))
        out_key, records = await self.redis.hmget(self.job_key(job_id), ["out_key", "outputs"])
        record = next((o for o in json.loads(records or "[]") if o.get("index") == index), None)
        if not out_key or record is None or record.get("content_type") not in EXTENSIONS:
            return None
        try:
            return await self.outputs.get(job_id, index, EXTENSIONS[record["content_type"]], key=out_key)
        except OutputStoreError as e:  # answered and logged by the API: without the path's secret segment
            raise OutputStoreError(str(e).replace(out_key, "<key>")) from e.__cause__

    async def delete_outputs(self, job_id: str) -> int:
        """Delete every stored output of the job, whatever attempt wrote it (objects under `<job id>/`, or its
        Redis keys); returns how many there were. Raises `OutputStoreError` when the object store refuses."""
        if not valid_job_id(job_id):
            return 0
        if self.outputs is not None:
            return await self.outputs.delete(job_id)
        records = json.loads(await self.redis.hget(self.job_key(job_id), "outputs") or "[]")
        keys = [self.output_key(job_id, o["index"]) for o in records]
        return int(await self._raw.delete(*keys)) if keys else 0

    async def _resign(self, job: Job, out_key: str) -> None:
        """Signed output URLs are made afresh on every read: one signed at completion would lapse
        `output_signed_url_ttl_s` later while the job is still listed. When signing fails (credentials), the API's
        own route, which always works, is listed instead of a stale link."""
        try:
            urls = await self._output_urls(job.id, out_key, [(o.index, o.content_type) for o in job.outputs])
        except OutputStoreError as e:
            reason = str(e).replace(out_key, "<key>")
            log.warning("job %s: cannot sign output URLs (%s); listing the API's routes", job.id, reason)
            urls = [f"/v1/jobs/{job.id}/outputs/{o.index}" for o in job.outputs]
        job.outputs = [o.model_copy(update={"url": u}) for o, u in zip(job.outputs, urls, strict=True)]

    async def _output_urls(self, job_id: str, key: str, outputs: list[tuple[int, str]]) -> list[str]:
        """Client URLs of (index, content type) outputs: `output_url_base` or signed ones, else the API's route."""
        assert self.outputs is not None
        urls = await asyncio.gather(
            *(self.outputs.url(job_id, i, EXTENSIONS[ct], key=key) for i, ct in outputs)
        )
        return [url or f"/v1/jobs/{job_id}/outputs/{i}" for url, (i, _) in zip(urls, outputs, strict=True)]

"""The API's reads: a job (tenant-checked), its queue position, its events (SSE, `Prefer: wait`), and the queue
depths and cluster-wide counters the metrics export. Nothing here changes a job."""

from __future__ import annotations

import json
import time

from meshserve.service.contract import PRIORITY_ORDER, Event, EventType, Job, JobStatus, Priority
from meshserve.service.job_outputs import JobOutputs
from meshserve.service.pool_registry import PoolRegistry
from meshserve.service.redis_client import MAX_BLOCK_MS
from meshserve.service.store_base import job_from_hash, valid_job_id


class JobReads(JobOutputs, PoolRegistry):
    async def get(self, job_id: str, tenant: str | None = None) -> Job | None:
        """The job, or None when it never existed, expired, or (with `tenant`) belongs to another tenant: the
        same None, so a caller cannot tell another tenant's job from an unknown id. `tenant` None: any job
        (workers, admin keys)."""
        if not valid_job_id(job_id):
            return None
        h = await self.redis.hgetall(self.job_key(job_id))
        if not h.get("status"):
            return None
        if tenant is not None and (h.get("tenant") or self.settings.default_owner) != tenant:
            return None
        job = job_from_hash(h)
        if job.outputs and h.get("out_key") and self.outputs is not None and self.outputs.signed_url_ttl_s:
            await self._resign(job, h["out_key"])
        return job

    async def queue_position(self, job: Job) -> int | None:
        """Jobs ahead of a queued job (0: it is next); None when it is not queued."""
        if job.status != JobStatus.QUEUED:
            return None
        msg_id = await self.redis.hget(self.job_key(job.id), "msg_id")
        if not msg_id:
            return None
        streams = [self.stream_key(job.model, p) for p in PRIORITY_ORDER]
        return int(await self._run("POSITION", streams, [PRIORITY_ORDER.index(job.priority) + 1, msg_id]))

    async def events(self, job_id: str, last_id: str = "0-0", block_ms: int | None = None) -> list[Event]:
        """Events after `last_id` (XREAD); with `block_ms`, waits up to that long (in slices) for the first one."""
        if not valid_job_id(job_id):
            return []
        block = None if block_ms is None else max(1, min(int(block_ms), MAX_BLOCK_MS))
        client = self.redis if block is None else self.blocking  # store_base.py: blocking reads' own pool
        res = await client.xread({self.events_key(job_id): last_id}, count=100, block=block)
        out = []
        for _, entries in res or []:
            for entry_id, f in entries:
                out.append(
                    Event(id=entry_id, type=EventType(f["type"]), data=json.loads(f.get("data") or "{}"))
                )
        return out

    async def wait(self, job_id: str, timeout_s: float) -> Job | None:
        """Block until the job has ended or `timeout_s` passed; returns its state then (None: unknown job)."""
        deadline = time.monotonic() + timeout_s
        last = "0-0"
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                break
            events = await self.events(job_id, last, block_ms=left_ms)
            if any(e.type.terminal for e in events):
                break
            if events:
                last = events[-1].id
        return await self.get(job_id)

    async def queue_depths(self) -> dict[tuple[str, Priority], dict[str, float]]:
        """Per (model, priority): `depth` (waiting: undelivered, or given back by a pool), `oldest_age_s` (of the
        oldest waiting entry, 0 when none) and `pending` (delivered, not yet acknowledged), for every model ever
        submitted or served."""
        models = set(await self.redis.smembers(f"{self.prefix}:models"))
        models |= {m.id for p in await self.list_pools() for m in p.models}
        keys = [(m, p) for m in sorted(models) for p in PRIORITY_ORDER]
        if not keys:
            return {}
        res = await self._run("QUEUE_STATS", [self.stream_key(m, p) for m, p in keys], [])
        now_ms = time.time() * 1000
        out = {}
        for (m, p), (depth, oldest, pending) in zip(keys, res, strict=True):
            age = max(0.0, (now_ms - int(oldest.split("-")[0])) / 1000) if oldest else 0.0
            out[(m, p)] = {"depth": float(depth), "oldest_age_s": age, "pending": float(pending)}
        return out

    async def stats(self) -> dict[tuple[str, str], int]:
        """Cluster-wide counters kept by the scripts: (model, name) -> count, where name is `finished|<status>`,
        `reclaimed` or `dead_lettered`."""
        raw = await self.redis.hgetall(f"{self.prefix}:stats")
        return {tuple(k.split("|", 1)): int(v) for k, v in raw.items()}

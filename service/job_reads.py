"""The API's reads: a job (tenant-checked), a tenant's jobs (`GET /v1/jobs`), a job's queue position, its events
(SSE, `Prefer: wait`), and the queue depths and cluster-wide counters the metrics export. Nothing here changes a
job."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Collection
from dataclasses import dataclass

from meshserve.service.contract import PRIORITY_ORDER, Event, EventType, Job, JobStatus, Priority
from meshserve.service.job_outputs import JobOutputs
from meshserve.service.pool_registry import PoolRegistry
from meshserve.service.redis_client import MAX_BLOCK_MS
from meshserve.service.store_base import job_from_hash, valid_job_id

# Index entries one listing reads at most: a filter that matches few jobs ends a page early (with a cursor) rather
# than reading a tenant's whole index in one request.
LIST_SCAN_MAX = 1000
_LIST_BATCH = 100


@dataclass(frozen=True)
class JobPage:
    """One page of a tenant's jobs, newest first; `next_cursor` continues after it (None: nothing older)."""

    jobs: list[Job]
    next_cursor: str | None


_CURSOR = re.compile(r"^([0-9]{1,16}(?:\.[0-9]{1,20})?)_([0-9a-f]{32})$")


def parse_cursor(cursor: str) -> tuple[float, str]:
    """A listing's cursor, "<created_at>_<job id>" as `list_jobs` writes it -> (created_at, job id) of the last
    job it covered; ValueError for anything else."""
    match = _CURSOR.match(cursor)
    if match is None:
        raise ValueError("not a cursor this API gave")
    return float(match[1]), match[2]


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
        return await self._as_read(h)

    async def _as_read(self, h: dict[str, str]) -> Job:
        """A job from its hash as clients read it: signed output URLs made afresh (`_resign`)."""
        job = job_from_hash(h)
        if job.outputs and h.get("out_key") and self.outputs is not None and self.outputs.signed_url_ttl_s:
            await self._resign(job, h["out_key"])
        return job

    async def list_jobs(
        self,
        tenant: str,
        *,
        limit: int,
        cursor: str | None = None,
        statuses: Collection[JobStatus] = (),
        model: str | None = None,
    ) -> JobPage:
        """The tenant's jobs that still exist, newest first, `limit` at most, after `cursor` (a page's
        `next_cursor`), only those in `statuses` (any when empty) and of `model` (any when None). At most
        LIST_SCAN_MAX index entries are read: a page of a narrow filter can hold fewer than `limit` jobs and still
        have a `next_cursor`. Ids of jobs that expired are dropped from the index as they are met."""
        key = self.tenant_jobs_key(tenant)
        top, after = (math.inf, None) if cursor is None else parse_cursor(cursor)
        wanted = {s.value for s in statuses}
        found: list[tuple[float, str, dict[str, str]]] = []  # (index score, id, hash), one more than a page
        scanned, at_end = 0, False
        while len(found) <= limit and scanned < LIST_SCAN_MAX and not at_end:
            # Entries of one created_at sort by id (descending here): those up to the cursor's were listed.
            ties = 0 if after is None else await self.redis.zcount(key, top, top)
            num = min(_LIST_BATCH, LIST_SCAN_MAX - scanned) + ties
            high = "+inf" if top == math.inf else repr(top)
            # One row more than read: whether the index goes on past them (a page that ends on the scan's bound
            # exactly at the index's end says so, rather than sending the client to an empty page).
            rows = await self.redis.zrevrangebyscore(key, high, "-inf", start=0, num=num + 1, withscores=True)
            at_end, rows = len(rows) <= num, rows[:num]  # (at_end: until an entry below is left unread)
            fresh = [(m, sc) for m, sc in rows if after is None or sc < top or m < after]
            # Which exist and match: three fields each, then the whole hash of the matches only.
            pipe = self.redis.pipeline(transaction=False)
            for job_id, _ in fresh:
                pipe.hmget(self.job_key(job_id), "status", "model", "tenant")
            gone, matched = [], []
            for i, ((job_id, score), (status, job_model, owner)) in enumerate(
                zip(fresh, await pipe.execute() if fresh else [], strict=True)
            ):
                scanned += 1
                top, after = score, job_id
                if not status or (owner or self.settings.default_owner) != tenant:
                    gone.append(job_id)
                elif (not wanted or status in wanted) and (model is None or job_model == model):
                    matched.append((score, job_id))
                    if len(found) + len(matched) > limit:
                        at_end = at_end and i == len(fresh) - 1
                        break
            if gone:
                await self.redis.zrem(key, *gone)
            pipe = self.redis.pipeline(transaction=False)
            for _, job_id in matched:
                pipe.hgetall(self.job_key(job_id))
            for (score, job_id), h in zip(matched, await pipe.execute() if matched else [], strict=True):
                if h.get("status"):  # (unless it expired between the two reads)
                    found.append((score, job_id, h))
        page = found[:limit]
        if len(found) > limit:
            next_cursor = f"{page[-1][0]!r}_{page[-1][1]}"
        elif not at_end:  # the scan's bound, not the index's end
            next_cursor = f"{top!r}_{after}"
        else:
            next_cursor = None
        return JobPage([await self._as_read(h) for _, _, h in page], next_cursor)

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

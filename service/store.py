"""The Redis store: the durable queue between the API and the worker pools (redis.asyncio, Redis >= 7).

Key layout (`P` is `Settings.key_prefix`, "ms" by default):

| key                          | type   | holds |
|------------------------------|--------|-------|
| `P:stream:{model}:{priority}` | stream, group `pools` | one entry `job=<id>` per job to run |
| `P:job:{id}`                 | hash   | status, tenant, out_token, out_key, params (JSON), times, attempt, worker, progress, outputs/error/timings (JSON), cancel flag, stream + message id; TTL once ended |
| `P:events:{id}`              | stream | `type` + `data` (JSON) per event, capped; TTL once ended. SSE ids are its entry ids |
| `P:out:{id}:{i}`             | string | encoded output bytes, TTL (or an object `<output_dir>/<id>/<out_key>/<i>.<ext>` when set) |
| `P:staged:{id}:{attempt}:{i}` | string | output bytes written by one attempt, renamed to `P:out:{id}:{i}` by its fenced commit (else they expire) |
| `P:idem:{tenant}:{key}`      | string | `<job id> <request hash>`, TTL (idempotency keys are per tenant) |
| `P:active:{tenant}`          | set    | the tenant's queued/running job ids while its key has an active-job limit; pruned on submit |
| `P:lease:{id}`               | string | the attempt holding the job, expires unless renewed (`heartbeat`) |
| `P:dlq:{model}`              | stream | dead-lettered jobs with the reason |
| `P:pools`                    | hash   | pool name -> `PoolInfo` JSON |
| `P:models`, `P:stats`        | set, hash | models ever submitted (for queue metrics); cluster-wide counters `{model}\\|{name}` |

API keys and rate buckets (`P:apikey:*`, `P:apikeys`, `P:ratelimit:*`) are `service/auth.py`'s.

Tenants: every job records the tenant that submitted it (`Settings.default_owner` when none is given, as with
`MESHSERVE_AUTH=none`); `get(job_id, tenant)` answers None for another tenant's job exactly as for an unknown id,
and the API's routes reach a job only through it.

Delivery is at least once: a worker `claim`s entries (XREADGROUP, or takes over entries whose lease expired),
`start`s them, and its `complete`/`fail`/`mark_canceled` write the result and XACK in one script (output bytes
are SET beforehand with plain commands, under keys of the attempt, and only renamed into place by the script). Every worker
write is fenced by the attempt number `claim` took: once another delivery took the job, the old worker's writes
return False and change nothing. The transitions are Lua scripts (`service/store_lua.py`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import secrets
import socket
import time
import uuid
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ConstantBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from meshserve.service import store_lua
from meshserve.service.contract import (
    CONTENT_TYPES,
    PRIORITY_ORDER,
    Delivery,
    Event,
    EventType,
    IdempotencyConflict,
    Job,
    JobError,
    JobParams,
    JobStatus,
    Output,
    OutputBlob,
    PoolInfo,
    Priority,
    Progress,
    QueueFull,
    Timings,
)
from meshserve.service.output_store import OutputStore, OutputStoreError
from meshserve.service.settings import Settings

# File extension of an output object (Settings.output_dir) by content type: the format's name.
_EXTENSIONS = {content_type: fmt for fmt, content_type in CONTENT_TYPES.items()}

log = logging.getLogger(__name__)

GROUP = "pools"
# Blocking reads (XREAD/XREADGROUP BLOCK) last at most this long per call; callers loop. A configured socket read
# timeout is raised above it, so a quiet stream is never a timeout error.
_MAX_BLOCK_MS = 10_000
_JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_OUTPUT_TOKEN = re.compile(r"^[A-Za-z0-9_-]{22}$")  # secrets.token_urlsafe(16)


def request_hash(body: Any) -> str:
    """The hash an Idempotency-Key is bound to: SHA-256 of the body as canonical JSON."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def valid_job_id(job_id: str) -> bool:
    """Ids are uuid4 hex; anything else cannot name a job (and never reaches a Redis key)."""
    return bool(_JOB_ID.match(job_id))


def _f(value: str | None) -> float | None:
    return float(value) if value not in (None, "") else None


def job_from_hash(h: dict[str, str]) -> Job:
    """Build a `Job` from its Redis hash (all values strings)."""
    return Job(
        id=h["id"],
        model=h["model"],
        priority=Priority(h.get("priority", "normal")),
        status=JobStatus(h["status"]),
        params=JobParams.model_validate_json(h["params"]),
        created_at=float(h["created_at"]),
        started_at=_f(h.get("started_at")),
        finished_at=_f(h.get("finished_at")),
        progress=Progress(step=int(h.get("step") or 0), total_steps=int(h.get("total_steps") or 0)),
        outputs=[Output.model_validate(o) for o in json.loads(h["outputs"])] if h.get("outputs") else [],
        error=JobError.model_validate_json(h["error"]) if h.get("error") else None,
        timings=Timings.model_validate_json(h["timings"]) if h.get("timings") else Timings(),
        attempt=int(h.get("attempt") or 0),
        worker=h.get("worker") or None,
        cancel_requested=h.get("cancel") == "1",
    )


def _pairs(flat: list) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


class TooManyActiveJobs(Exception):
    """The tenant already has its key's limit of queued + running jobs: answered 429 with `Retry-After`."""

    def __init__(self, tenant: str, active: int, limit: int):
        super().__init__(
            f"tenant {tenant!r} has {active} queued or running jobs (limit {limit}); wait for one to end"
        )
        self.tenant, self.active, self.limit = tenant, active, limit


class Store:
    """Async access to the Redis data model, for the API (submit/get/cancel/events/...) and the workers
    (register_pool/claim/start/heartbeat/progress/complete/fail/mark_canceled/release).

    One instance per process; call `close()` at shutdown. Redis errors propagate as `redis.exceptions.RedisError`
    (the API answers them with 503), output storage errors as `OutputStoreError` (503 too; workers retry them).

    `outputs`: where outputs go when `settings.output_dir` is set; built from the settings unless given (tests
    pass an `OutputStore` subclass that fails on purpose)."""

    def __init__(self, settings: Settings, outputs: OutputStore | None = None):
        self.settings = settings
        # Built here, so a bad output_dir / URL option fails the process at start-up, not a job later.
        if outputs is None and settings.output_dir:
            outputs = OutputStore(
                settings.output_dir,
                url_base=settings.output_url_base,
                signed_url_ttl_s=settings.output_signed_url_ttl_s,
            )
        self.outputs = outputs
        self.prefix = settings.key_prefix
        kwargs = dict(
            socket_connect_timeout=settings.redis_connect_timeout_s,
            # A read timeout must outlast the longest blocking read (see Settings.redis_socket_timeout_s).
            socket_timeout=settings.redis_socket_timeout_s
            and max(settings.redis_socket_timeout_s, _MAX_BLOCK_MS / 1000 + 5),
            # One quick retry covers a pooled connection that died with a restarted Redis; more would only delay
            # the 503 while Redis is really down.
            retry=Retry(ConstantBackoff(0.05), 1),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
        )
        self.redis = aioredis.Redis.from_url(settings.redis_url, decode_responses=True, **kwargs)
        self._raw = aioredis.Redis.from_url(settings.redis_url, decode_responses=False, **kwargs)
        self._scripts = {
            name: self.redis.register_script(getattr(store_lua, name))
            for name in ("SUBMIT", "ACCEPT", "RECLAIM", "GIVE_BACK", "START", "HEARTBEAT", "PROGRESS", "END")
            + ("RELEASE", "CANCEL", "POSITION", "QUEUE_STATS", "TRIM")
        }
        self._groups: set[str] = set()
        self._trimmed: dict[str, float] = {}

    async def close(self) -> None:
        await self.redis.aclose()
        await self._raw.aclose()

    # -- keys ------------------------------------------------------------------------------------------------

    def stream_key(self, model: str, priority: Priority | str) -> str:
        return f"{self.prefix}:stream:{model}:{Priority(priority).value}"

    def job_key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def events_key(self, job_id: str) -> str:
        return f"{self.prefix}:events:{job_id}"

    def output_key(self, job_id: str, index: int) -> str:
        return f"{self.prefix}:out:{job_id}:{index}"

    def staged_output_key(self, job_id: str, attempt: int, index: int) -> str:
        return f"{self.prefix}:staged:{job_id}:{attempt}:{index}"

    def dlq_key(self, model: str) -> str:
        return f"{self.prefix}:dlq:{model}"

    @property
    def pools_key(self) -> str:
        return f"{self.prefix}:pools"

    async def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return await self._scripts[name](keys=keys, args=[self.prefix, *args])

    # -- API side --------------------------------------------------------------------------------------------

    async def ping(self) -> bool:
        """True when Redis answers."""
        return bool(await self.redis.ping())

    async def submit(
        self,
        params: JobParams,
        priority: Priority = Priority.NORMAL,
        idempotency_key: str | None = None,
        *,
        request_digest: str = "",
        owner: str | None = None,
        max_active: int = 0,
    ) -> Job:
        """Queue a job for tenant `owner` (default `Settings.default_owner`): its hash, its stream entry (XADD)
        and its `queued` event, in one script.

        Admission: when the model already has `queue_max_length` undelivered entries (all priorities) it raises
        `QueueFull`; when `max_active` > 0 and the tenant has that many queued or running jobs, it raises
        `TooManyActiveJobs`. With an `idempotency_key` (scoped to the tenant), a second submit with the same key and
        `request_digest` returns the first job (its current state); another digest raises `IdempotencyConflict`.
        The returned job carries `queue_position` (jobs ahead of it)."""
        s = self.settings
        job_id = uuid.uuid4().hex
        now = time.time()
        tenant = owner or s.default_owner
        idem_key = f"{self.prefix}:idem:{tenant}:{idempotency_key}" if idempotency_key else ""
        active_key = f"{self.prefix}:active:{tenant}" if max_active > 0 else ""
        streams = [self.stream_key(params.model, p) for p in PRIORITY_ORDER]
        args = [job_id, PRIORITY_ORDER.index(priority) + 1, s.queue_max_length, f"{job_id} {request_digest}"]
        args += [
            s.idempotency_ttl_s,
            s.events_max_length,
            params.model,
            priority.value,
            params.model_dump_json(),
        ]
        args += [repr(now), tenant, max_active, s.job_ttl_s, secrets.token_urlsafe(16)]
        res = await self._run("SUBMIT", [self.job_key(job_id), idem_key, *streams, active_key], args)
        if res[0] == "full":
            raise QueueFull(params.model, int(res[1]), s.queue_max_length)
        if res[0] == "busy":
            raise TooManyActiveJobs(tenant, int(res[1]), max_active)
        if res[0] == "idem":
            prev_id, _, prev_digest = res[1].partition(" ")
            if prev_digest != request_digest:
                raise IdempotencyConflict(idempotency_key or "", prev_id)
            prev = await self.get(prev_id)
            if prev is None:  # the job expired before its key: the key is free again
                await self.redis.delete(idem_key)
                return await self.submit(
                    params,
                    priority,
                    idempotency_key,
                    request_digest=request_digest,
                    owner=owner,
                    max_active=max_active,
                )
            prev.queue_position = await self.queue_position(prev)
            return prev
        job = Job(
            id=job_id,
            model=params.model,
            priority=priority,
            status=JobStatus.QUEUED,
            params=params,
            created_at=now,
        )
        job.queue_position = int(res[2])
        return job

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

    async def queue_position(self, job: Job) -> int | None:
        """Jobs ahead of a queued job (0: it is next); None when it is not queued."""
        if job.status != JobStatus.QUEUED:
            return None
        msg_id = await self.redis.hget(self.job_key(job.id), "msg_id")
        if not msg_id:
            return None
        streams = [self.stream_key(job.model, p) for p in PRIORITY_ORDER]
        return int(await self._run("POSITION", streams, [PRIORITY_ORDER.index(job.priority) + 1, msg_id]))

    async def cancel(self, job_id: str) -> Job | None:
        """Cancel a job: a queued one ends `canceled` now; a running one is flagged and its worker stops between
        steps (`cancel_requested`); an ended one is left alone. Returns the job after the change (None: unknown)."""
        if not valid_job_id(job_id):
            return None
        s = self.settings
        res = await self._run("CANCEL", [], [job_id, repr(time.time()), s.job_ttl_s, s.events_max_length])
        if res[0] == "missing":
            return None
        return await self.get(job_id)

    async def events(self, job_id: str, last_id: str = "0-0", block_ms: int | None = None) -> list[Event]:
        """Events after `last_id` (XREAD); with `block_ms`, waits up to that long (in slices) for the first one."""
        if not valid_job_id(job_id):
            return []
        block = None if block_ms is None else max(1, min(int(block_ms), _MAX_BLOCK_MS))
        res = await self.redis.xread({self.events_key(job_id): last_id}, count=100, block=block)
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

    async def output(self, job_id: str, index: int) -> bytes | None:
        """The stored bytes of output `index` (None: unknown, expired, or deleted)."""
        if not valid_job_id(job_id):
            return None
        if self.outputs is None:
            return await self._raw.get(self.output_key(job_id, index))
        out_key, token, records = await self.redis.hmget(
            self.job_key(job_id), ["out_key", "out_token", "outputs"]
        )
        record = next((o for o in json.loads(records or "[]") if o.get("index") == index), None)
        if record is None or record.get("content_type") not in _EXTENSIONS:
            return None
        key = self._committed_key(out_key, token)
        try:
            return await self.outputs.get(job_id, index, _EXTENSIONS[record["content_type"]], key=key)
        except OutputStoreError as e:  # answered and logged by the API: without the path's secret segment
            raise OutputStoreError(str(e).replace(key, "<key>") if key else str(e)) from e.__cause__

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

    # Outputs in object storage (Settings.output_dir; service/output_store.py): `<output_dir>/<job id>/<out key>/
    # <index>.<ext>`, where the out key is `<token>-<attempt>`. The token (128 random bits, drawn at submit and
    # kept in the job hash) makes the path, and so an `output_url_base` URL, unguessable even to whoever knows the
    # job id (worker logs name job ids): such URLs are bearer links (docs/security.md). The attempt makes each
    # delivery write its own objects: a stale attempt (its lease lapsed, another delivery took the job) that
    # writes after the new one committed cannot replace the committed bytes with its own (another pool's mesh
    # rounds differently, so they need not be identical); the fenced commit records which key won (`out_key`),
    # and a loser's objects are never referenced (they go with the job's prefix: `delete_outputs`, or the
    # bucket's lifecycle rule).

    @staticmethod
    def _committed_key(out_key: str | None, token: str | None) -> str | None:
        if out_key:
            return out_key
        # Jobs completed before per-attempt keys: under the token, or (before tokens) in the job's folder.
        return token if token and _OUTPUT_TOKEN.match(token) else None

    async def _output_urls(self, job_id: str, key: str, outputs: list[tuple[int, str]]) -> list[str]:
        """Client URLs of (index, content type) outputs: `output_url_base` or signed ones, else the API's route."""
        assert self.outputs is not None
        urls = await asyncio.gather(
            *(self.outputs.url(job_id, i, _EXTENSIONS[ct], key=key) for i, ct in outputs)
        )
        return [url or f"/v1/jobs/{job_id}/outputs/{i}" for url, (i, _) in zip(urls, outputs, strict=True)]

    async def queue_depths(self) -> dict[tuple[str, Priority], dict[str, float]]:
        """Per (model, priority): `depth` (undelivered), `oldest_age_s` (of the oldest undelivered entry, 0 when
        none) and `pending` (delivered, not yet acknowledged), for every model ever submitted or served."""
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

    # -- pool registry ---------------------------------------------------------------------------------------

    async def register_pool(self, info: PoolInfo) -> None:
        """Add or replace a pool's registry entry (its `last_seen` is set to now)."""
        info = info.model_copy(update={"last_seen": time.time(), "host": info.host or socket.gethostname()})
        await self.redis.hset(self.pools_key, info.name, info.model_dump_json())

    async def heartbeat_pool(self, name: str, ready: bool | None = None) -> bool:
        """Refresh a pool's `last_seen` (and `ready` when given). False when the pool is not registered (e.g. Redis
        lost its data): the caller should `register_pool` again. Only the pool itself writes its entry."""
        raw = await self.redis.hget(self.pools_key, name)
        if raw is None:
            return False
        update: dict[str, Any] = {"last_seen": time.time()}
        if ready is not None:
            update["ready"] = ready
        info = PoolInfo.model_validate_json(raw).model_copy(update=update)
        await self.redis.hset(self.pools_key, name, info.model_dump_json())
        return True

    async def unregister_pool(self, name: str) -> None:
        """Remove a pool's entry (clean shutdown)."""
        await self.redis.hdel(self.pools_key, name)

    async def list_pools(self, include_stale: bool = False) -> list[PoolInfo]:
        """Registered pools; those not seen for `pool_stale_s` are left out unless `include_stale`."""
        raw = await self.redis.hgetall(self.pools_key)
        cutoff = time.time() - self.settings.pool_stale_s
        pools = [PoolInfo.model_validate_json(v) for _, v in sorted(raw.items())]
        return [p for p in pools if include_stale or p.last_seen >= cutoff]

    # -- worker side -----------------------------------------------------------------------------------------

    async def _ensure_groups(self, streams: list[str]) -> None:
        for stream in streams:
            if stream in self._groups:
                continue
            try:
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
            self._groups.add(stream)

    def _deliveries(self, items: list[tuple[str, str, int, list]], consumer: str) -> list[Delivery]:
        out = []
        for stream, msg_id, count, res in items:
            if res[0] != "ok":
                continue
            job = job_from_hash(_pairs(res[2:]))
            out.append(
                Delivery(
                    job=job,
                    stream=stream,
                    message_id=msg_id,
                    delivery_count=count,
                    attempt=int(res[1]),
                    consumer=consumer,
                )
            )
        return out

    async def claim(
        self, models: list[str], consumer: str, max_jobs: int = 1, block_ms: int = 0
    ) -> list[Delivery]:
        """Take up to `max_jobs` jobs of `models` for `consumer`, highest priority first.

        1. Takeover: per stream, entries idle longer than the lease whose lease key expired (their worker is gone)
           are XCLAIMed (the XAUTOCLAIM rule, done in a script so the lease is checked atomically).
        2. New entries: XREADGROUP `>` per stream in priority order (high, normal, low; models in the given order);
           when none, one blocking XREADGROUP on all of them for up to `block_ms` (sliced to 10 s at most).
        Each taken entry then gets a new attempt number and a lease (`lease_s`). Entries of canceled or expired jobs
        are acked and skipped; an entry delivered more than `max_deliveries` times goes to `P:dlq:{model}` and its
        job ends failed with code "too_many_deliveries". May return fewer jobs than asked, or none."""
        streams = [self.stream_key(m, p) for p in PRIORITY_ORDER for m in models]
        try:
            return await self._claim(streams, consumer, max_jobs, block_ms)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._groups.clear()  # Redis lost the groups (restart without persistence): create them again
            return await self._claim(streams, consumer, max_jobs, 0)

    async def _claim(self, streams: list[str], consumer: str, max_jobs: int, block_ms: int) -> list[Delivery]:
        s = self.settings
        await self._ensure_groups(streams)
        lease_ms = int(s.lease_s * 1000)
        common = [consumer, lease_ms, s.max_deliveries, repr(time.time()), s.job_ttl_s, s.events_max_length]
        taken: list[Delivery] = []
        for stream in streams:
            if len(taken) >= max_jobs:
                break
            res = await self._run("RECLAIM", [stream], [*common, max_jobs - len(taken)])
            taken += self._deliveries([(stream, m, int(c), r) for m, _, c, r in res], consumer)
        new: list[tuple[str, str, str]] = []  # (stream, msg id, job id)
        for stream in streams:
            if len(taken) + len(new) >= max_jobs:
                break
            res = await self.redis.xreadgroup(
                GROUP, consumer, {stream: ">"}, count=max_jobs - len(taken) - len(new)
            )
            new += [(stream, m, f.get("job", "")) for _, entries in res or [] for m, f in entries]
        if not taken and not new and block_ms > 0:
            block = max(1, min(int(block_ms), _MAX_BLOCK_MS))
            res = await self.redis.xreadgroup(
                GROUP, consumer, dict.fromkeys(streams, ">"), count=max_jobs, block=block
            )
            got = {stream: entries for stream, entries in res or []}
            for stream in streams:  # priority order; what does not fit is given back untouched
                entries = got.get(stream, [])
                room = max(0, max_jobs - len(new))
                new += [(stream, m, f.get("job", "")) for m, f in entries[:room]]
                if entries[room:]:
                    await self._run("GIVE_BACK", [stream], [consumer, *(m for m, _ in entries[room:])])
        if new:
            res = await self._run("ACCEPT", [], [*common, *(x for triple in new for x in triple)])
            taken += self._deliveries(
                [(st, m, 1, r) for (st, m, _), r in zip(new, res, strict=True)], consumer
            )
        await self._maybe_trim(streams)
        return taken

    async def _maybe_trim(self, streams: list[str]) -> None:
        # Acked entries stay in a stream until trimmed; once a minute per stream is plenty.
        now = time.monotonic()
        for stream in streams:
            if now - self._trimmed.get(stream, 0.0) > 60:
                self._trimmed[stream] = now
                await self._run("TRIM", [stream], [])

    async def start(self, delivery: Delivery, worker: str | None = None) -> bool:
        """Mark the job running (started_at, lease, `started` event). False, and nothing done, when the delivery
        is fenced (a newer attempt owns the job) or the job was canceled meanwhile (then its entry is acked)."""
        s = self.settings
        now = time.time()
        data = json.dumps({"status": "running", "attempt": delivery.attempt})
        args = [
            delivery.job.id,
            delivery.attempt,
            worker or delivery.consumer,
            repr(now),
            int(s.lease_s * 1000),
        ]
        ok = bool(await self._run("START", [], [*args, s.events_max_length, s.job_ttl_s, data]))
        if ok:
            delivery.job.status = JobStatus.RUNNING
            delivery.job.started_at = now
        return ok

    async def heartbeat(self, delivery: Delivery) -> bool:
        """Renew the lease (call well within `lease_s`, e.g. every lease/3). False when another attempt owns the
        job or it ended: stop working on it."""
        args = [delivery.job.id, delivery.attempt, delivery.consumer, int(self.settings.lease_s * 1000)]
        return bool(await self._run("HEARTBEAT", [], args))

    async def progress(self, delivery: Delivery, step: int, total: int) -> bool:
        """Record progress (job hash + `progress` event). False when fenced or not running."""
        data = json.dumps({"status": "running", "step": step, "total_steps": total})
        args = [delivery.job.id, delivery.attempt, step, total, self.settings.events_max_length, data]
        return bool(await self._run("PROGRESS", [], args))

    async def cancel_requested(self, job_id: str) -> bool:
        """True when a client asked to cancel the job (or it no longer exists): stop between steps and call
        `mark_canceled`."""
        flag, status = await self.redis.hmget(self.job_key(job_id), ["cancel", "status"])
        return flag == "1" or status is None or status == JobStatus.CANCELED.value

    async def _end(
        self,
        delivery: Delivery,
        status: JobStatus,
        fields: dict[str, str],
        data: dict,
        renames: list[tuple[str, str]] = (),
    ) -> bool:
        s = self.settings
        args = [
            delivery.job.id,
            delivery.attempt,
            status.value,
            repr(time.time()),
            s.job_ttl_s,
            s.events_max_length,
            json.dumps(data),
            len(fields),
        ]
        args += [x for kv in fields.items() for x in kv]
        args += [x for kv in renames for x in kv]
        return int(await self._run("END", [], args)) == 1

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

    async def complete(
        self, delivery: Delivery, outputs: list[OutputBlob], stages: dict[str, float] | None = None
    ) -> bool:
        """Store the outputs (bytes with `output_ttl_s`, or objects under `output_dir`), mark the job succeeded
        with its outputs and timings, emit `succeeded`, XACK and drop the lease. The bytes are written first
        under this attempt's own keys (Redis) or object paths; one small fenced script then renames them into
        place (Redis) or records the attempt's object key, and commits the job: a stale attempt's call returns
        False and nothing it wrote becomes visible. So a succeeded job always has its outputs. Raises
        `OutputStoreError` when an object cannot be written (nothing is committed; the caller retries or fails
        the job). `stages`: seconds per stage as measured by the worker (text_encode, denoise, ...)."""
        job, now = delivery.job, time.time()
        started = job.started_at or now
        timings = Timings(
            queue_s=started - job.created_at,
            inference_s=now - started,
            total_s=now - job.created_at,
            stages=stages or {},
        )
        urls = [f"/v1/jobs/{job.id}/outputs/{o.index}" for o in outputs]
        out_key = None
        if self.outputs is not None:
            unknown = sorted({o.content_type for o in outputs} - set(_EXTENSIONS))
            if unknown:
                raise ValueError(f"outputs of job {job.id} have content types with no format: {unknown}")
            token = await self.redis.hget(self.job_key(job.id), "out_token")
            if not (token and _OUTPUT_TOKEN.match(token)):  # a job submitted before tokens existed
                token = secrets.token_urlsafe(16)
            out_key = f"{token}-{delivery.attempt}"
            try:
                await asyncio.gather(
                    *(
                        self.outputs.put(job.id, o.index, _EXTENSIONS[o.content_type], o.data, key=out_key)
                        for o in outputs
                    )
                )
            except OutputStoreError as e:
                # The message goes to worker logs and the job's error: without the path's secret segment.
                raise OutputStoreError(str(e).replace(token, "<token>")) from e.__cause__
            urls = await self._output_urls(job.id, out_key, [(o.index, o.content_type) for o in outputs])
        records = [
            Output(
                index=o.index,
                url=url,
                content_type=o.content_type,
                width=o.width,
                height=o.height,
                seed=o.seed,
                num_frames=o.num_frames,
            ).model_dump(mode="json")
            for o, url in zip(outputs, urls, strict=True)
        ]
        total = job.progress.total_steps or job.params.num_inference_steps
        fields = {
            "outputs": json.dumps(records),
            "timings": timings.model_dump_json(),
            "step": str(total),
            "total_steps": str(total),
        }
        if out_key:
            fields["out_key"] = out_key
        renames = [] if self.outputs is not None else await self._stage_outputs(delivery, outputs)
        data = {"status": "succeeded", "outputs": records, "timings": timings.model_dump(mode="json")}
        done = await self._end(delivery, JobStatus.SUCCEEDED, fields, data, renames)
        if not done and renames:
            await self._raw.delete(*(staged for staged, _ in renames))
        return done

    async def fail(self, delivery: Delivery, code: str, message: str) -> bool:
        """End the job failed with `{code, message}` (no redelivery), emit `failed`, XACK. Fenced like `complete`."""
        err = JobError(code=code, message=message)
        data = {"status": "failed", "error": err.model_dump()}
        return await self._end(delivery, JobStatus.FAILED, {"error": err.model_dump_json()}, data)

    async def mark_canceled(self, delivery: Delivery) -> bool:
        """End the job canceled after the worker stopped it on `cancel_requested`; emit `canceled`, XACK. Fenced."""
        return await self._end(delivery, JobStatus.CANCELED, {}, {"status": "canceled"})

    async def release(self, delivery: Delivery) -> bool:
        """Give the job back without finishing it (SIGTERM): back to `queued` at its place in the stream, reclaimed
        by the next `claim` of any pool without spending a delivery; this attempt is fenced off. Fenced itself."""
        data = json.dumps({"status": "queued", "reason": "released"})
        args = [delivery.job.id, delivery.attempt, delivery.consumer, self.settings.events_max_length, data]
        return bool(await self._run("RELEASE", [], args))

"""The Redis store: the durable queue between the API and the worker pools (redis.asyncio, Redis >= 7).

Key layout (`P` is `Settings.key_prefix`, "ms" by default):

| key                          | type   | holds |
|------------------------------|--------|-------|
| `P:stream:{model}:{priority}` | stream, group `pools` | one entry `job=<id>` per job to run |
| `P:job:{id}`                 | hash   | status, params (JSON), times, attempt, worker, progress, outputs/error/timings (JSON), cancel flag, stream + message id; TTL once ended |
| `P:events:{id}`              | stream | `type` + `data` (JSON) per event, capped; TTL once ended. SSE ids are its entry ids |
| `P:out:{id}:{i}`             | string | encoded output bytes, TTL (or a file under `output_dir` when set) |
| `P:staged:{id}:{attempt}:{i}` | string | output bytes written by one attempt, renamed to `P:out:{id}:{i}` by its fenced commit (else they expire) |
| `P:idem:{owner}:{key}`       | string | `<job id> <request hash>`, TTL |
| `P:lease:{id}`               | string | the attempt holding the job, expires unless renewed (`heartbeat`) |
| `P:dlq:{model}`              | stream | dead-lettered jobs with the reason |
| `P:pools`                    | hash   | pool name -> `PoolInfo` JSON |
| `P:models`, `P:stats`        | set, hash | models ever submitted (for queue metrics); cluster-wide counters `{model}\\|{name}` |

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
import re
import socket
import time
import uuid
from pathlib import Path
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
from meshserve.service.settings import Settings

# File extension of an output file (Settings.output_dir) by content type: the format's name.
_EXTENSIONS = {content_type: f".{fmt}" for fmt, content_type in CONTENT_TYPES.items()}

GROUP = "pools"
# Blocking reads (XREAD/XREADGROUP BLOCK) last at most this long per call; callers loop. A configured socket read
# timeout is raised above it, so a quiet stream is never a timeout error.
_MAX_BLOCK_MS = 10_000
_JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


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


class Store:
    """Async access to the Redis data model, for the API (submit/get/cancel/events/...) and the workers
    (register_pool/claim/start/heartbeat/progress/complete/fail/mark_canceled/release).

    One instance per process; call `close()` at shutdown. Redis errors propagate as `redis.exceptions.RedisError`
    (the API answers them with 503)."""

    def __init__(self, settings: Settings):
        self.settings = settings
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
    ) -> Job:
        """Queue a job: its hash, its stream entry (XADD) and its `queued` event, in one script.

        Admission: when the model already has `queue_max_length` undelivered entries (all priorities) it raises
        `QueueFull`. With an `idempotency_key`, a second submit with the same key and `request_digest` returns the
        first job (its current state); another digest raises `IdempotencyConflict`. The returned job carries
        `queue_position` (jobs ahead of it)."""
        s = self.settings
        job_id = uuid.uuid4().hex
        now = time.time()
        idem_key = (
            f"{self.prefix}:idem:{owner or s.default_owner}:{idempotency_key}" if idempotency_key else ""
        )
        streams = [self.stream_key(params.model, p) for p in PRIORITY_ORDER]
        args = [job_id, PRIORITY_ORDER.index(priority) + 1, s.queue_max_length, f"{job_id} {request_digest}"]
        args += [
            s.idempotency_ttl_s,
            s.events_max_length,
            params.model,
            priority.value,
            params.model_dump_json(),
        ]
        args.append(repr(now))
        res = await self._run("SUBMIT", [self.job_key(job_id), idem_key, *streams], args)
        if res[0] == "full":
            raise QueueFull(params.model, int(res[1]), s.queue_max_length)
        if res[0] == "idem":
            prev_id, _, prev_digest = res[1].partition(" ")
            if prev_digest != request_digest:
                raise IdempotencyConflict(idempotency_key or "", prev_id)
            prev = await self.get(prev_id)
            if prev is None:  # the job expired before its key: the key is free again
                await self.redis.delete(idem_key)
                return await self.submit(
                    params, priority, idempotency_key, request_digest=request_digest, owner=owner
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

    async def get(self, job_id: str) -> Job | None:
        """The job, or None when it never existed or expired."""
        if not valid_job_id(job_id):
            return None
        h = await self.redis.hgetall(self.job_key(job_id))
        return job_from_hash(h) if h.get("status") else None

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
        """The stored bytes of output `index` (None: unknown or expired)."""
        if not valid_job_id(job_id):
            return None
        if self.settings.output_dir:
            return await asyncio.to_thread(self._read_output_file, job_id, index)
        return await self._raw.get(self.output_key(job_id, index))

    # Outputs as files (Settings.output_dir). Job ids are validated (`valid_job_id`) before they name a path.

    def _output_url(self, job_id: str, out: OutputBlob) -> str:
        base = self.settings.output_url_base
        if base and self.settings.output_dir:
            return f"{base.rstrip('/')}/{job_id}/{out.index}{_EXTENSIONS.get(out.content_type, '')}"
        return f"/v1/jobs/{job_id}/outputs/{out.index}"

    def _write_output_files(self, job_id: str, outputs: list[OutputBlob]) -> None:
        folder = Path(self.settings.output_dir) / job_id
        folder.mkdir(parents=True, exist_ok=True)
        for out in outputs:
            # Written beside and renamed: a reader never sees half a file. A stale attempt that gets here
            # too writes the same job's image for the same seed; only the fenced job record decides.
            target = folder / f"{out.index}{_EXTENSIONS.get(out.content_type, '')}"
            tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
            tmp.write_bytes(out.data)
            tmp.replace(target)

    def _read_output_file(self, job_id: str, index: int) -> bytes | None:
        for path in (Path(self.settings.output_dir) / job_id).glob(f"{index}.*"):
            return path.read_bytes()
        return None

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
        """Store the outputs (bytes with `output_ttl_s`), mark the job succeeded with its outputs and timings,
        emit `succeeded`, XACK and drop the lease. The bytes are written first under this attempt's own keys;
        one small fenced script then renames them into place and commits the job: a stale attempt's call
        returns False and nothing it wrote becomes visible (its staged bytes are deleted). `stages`: seconds per
        stage as measured by the worker (text_encode, denoise, ...)."""
        job, now = delivery.job, time.time()
        started = job.started_at or now
        timings = Timings(
            queue_s=started - job.created_at,
            inference_s=now - started,
            total_s=now - job.created_at,
            stages=stages or {},
        )
        if self.settings.output_dir:
            await asyncio.to_thread(self._write_output_files, job.id, outputs)
        records = [
            Output(
                index=o.index,
                url=self._output_url(job.id, o),
                content_type=o.content_type,
                width=o.width,
                height=o.height,
                seed=o.seed,
                num_frames=o.num_frames,
            ).model_dump(mode="json")
            for o in outputs
        ]
        total = job.progress.total_steps or job.params.num_inference_steps
        fields = {
            "outputs": json.dumps(records),
            "timings": timings.model_dump_json(),
            "step": str(total),
            "total_steps": str(total),
        }
        renames = [] if self.settings.output_dir else await self._stage_outputs(delivery, outputs)
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

"""The queue protocol: the transitions of a job between the API and the pools, each one Lua script
(service/store_lua.py) so that every write of a worker is fenced by its attempt number.

API side: `submit` (admission, idempotency, the stream entry) and `cancel`. Worker side: `claim` (takeover of
expired leases, then XREADGROUP in priority order), `start`, `heartbeat` (the lease), `progress` /
`cancel_requested` (or both for a whole batch in one round trip: `poll_running`), and the ends: `complete`,
`fail`, `mark_canceled`, `release`.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
import uuid
from typing import Any

from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from meshserve.service import store_lua
from meshserve.service.contract import (
    IMAGE_INPUT_FIELDS,
    PRIORITY_ORDER,
    Delivery,
    IdempotencyConflict,
    Job,
    JobError,
    JobParams,
    JobStatus,
    Output,
    OutputBlob,
    Priority,
    QueueFull,
    Timings,
)
from meshserve.service.input_store import InputStore, is_reference
from meshserve.service.job_reads import JobReads
from meshserve.service.redis_client import MAX_BLOCK_MS
from meshserve.service.store_base import job_from_hash, pairs, valid_job_id
from meshserve.service.webhooks.spec import WebhookSpec

GROUP = "pools"
# How long a tenant's job index (`GET /v1/jobs`) outlives its last submit beyond `job_ttl_s`: the index must list
# a job as long as the job exists, and a job may stay queued or running past its tenant's last submit (a week covers
# any queue and deadline this service is meant for; a job older than that is still read by its id).
JOB_INDEX_GRACE_S = 7 * 24 * 3600
# A claim reads a stream again while what it read were entries of jobs that had ended (canceled or expired while
# queued), at most this many times: past a flood of canceled entries in a few claims, without one claim taking long.
_MAX_READS_PER_STREAM = 16


def request_hash(body: Any) -> str:
    """The hash an Idempotency-Key is bound to: SHA-256 of the body as canonical JSON."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# What tells a running job's worker to stop between steps: a client's cancel, the job gone or canceled, or its
# deadline passed.
_STOP_FIELDS = ["cancel", "status", "deadline"]


def _stop(fields: list[str | None], now: float) -> bool:
    flag, status, deadline = fields
    if flag == "1" or status is None or status in (JobStatus.CANCELED.value, JobStatus.EXPIRED.value):
        return True
    return bool(deadline) and now >= float(deadline)


class SubmitOutcomeUnknown(RedisTimeoutError):
    """Redis did not answer a submit's script within the command deadline, after it was (or may have been) sent:
    a stalled Redis runs it when it resumes, so job `job_id` (chosen before the script runs) may exist or not.
    A RedisError like any other timeout; the API answers it with the job's Location (an audit's client got a
    bare 503 and the job ran anyway)."""

    def __init__(self, job_id: str, message: str):
        super().__init__(message)
        self.job_id = job_id


class TooManyActiveJobs(Exception):
    """The tenant already has its key's limit of queued + running jobs: answered 429 with `Retry-After`."""

    def __init__(self, tenant: str, active: int, limit: int):
        super().__init__(
            f"tenant {tenant!r} has {active} queued or running jobs (limit {limit}); wait for one to end"
        )
        self.tenant, self.active, self.limit = tenant, active, limit


class JobQueue(JobReads):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._groups: set[str] = set()  # streams whose consumer group this process has made sure of
        self._trimmed: dict[str, float] = {}  # stream -> monotonic time of its last trim

    async def submit(
        self,
        params: JobParams,
        priority: Priority = Priority.NORMAL,
        idempotency_key: str | None = None,
        *,
        request_digest: str = "",
        owner: str | None = None,
        max_active: int = 0,
        deadline_at: float | None = None,
        webhook: WebhookSpec | None = None,
    ) -> Job:
        """Queue a job for tenant `owner` (default `Settings.default_owner`): its hash, its stream entry (XADD)
        and its `queued` event, in one script.

        Admission: when the model already has `queue_max_length` jobs waiting (all priorities) it raises
        `QueueFull`; when `max_active` > 0 and the tenant has that many queued or running jobs, it raises
        `TooManyActiveJobs`. With an `idempotency_key` (scoped to the tenant), a second submit with the same key and
        `request_digest` returns the first job (its current state); another digest raises `IdempotencyConflict`.
        The returned job carries `queue_position` (jobs ahead of it). `deadline_at` (unix seconds): a job not
        started by then ends `expired`, one running then is canceled. `webhook`: POSTed (signed, retried) when the
        job ends with one of its statuses, queued by the same script as the end (service/webhooks/)."""
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
        args += [repr(deadline_at) if deadline_at is not None else ""]
        args += [webhook.model_dump_json(), webhook.fires_on()] if webhook is not None else ["", ""]
        args += [s.job_ttl_s + JOB_INDEX_GRACE_S]
        keys = [self.job_key(job_id), idem_key, *streams, active_key, self.tenant_jobs_key(tenant)]
        try:
            res = await self._run("SUBMIT", keys, args)
        except RedisTimeoutError as e:
            # The deadline passed with the script possibly sent: Redis may run it when it resumes (refused
            # connections are ConnectionErrors, raised as they are: nothing was sent).
            raise SubmitOutcomeUnknown(job_id, str(e)) from e
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
                    deadline_at=deadline_at,
                    webhook=webhook,
                )
            prev.queue_position = await self.queue_position(prev)
            prev.replayed = True
            return prev
        job = Job(
            id=job_id,
            model=params.model,
            priority=priority,
            status=JobStatus.QUEUED,
            params=params,
            created_at=now,
            deadline_at=deadline_at,
        )
        job.queue_position = int(res[2])
        return job

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

    async def delete_ended(self, job_id: str) -> str:
        """Delete an ended job: its outputs (Redis or the object store), its stored image inputs, then its record
        (hash, events, index and webhook entries; store_lua.DELETE_ENDED). Returns "deleted", "missing" (no such
        job) or "active" (queued or running: nothing deleted). The outputs go first: when the object store
        refuses (`OutputStoreError`) the job is still there to delete again."""
        if not valid_job_id(job_id):
            return "missing"
        status, params = await self.redis.hmget(self.job_key(job_id), ["status", "params"])
        if not status:
            return "missing"
        if status in (JobStatus.QUEUED.value, JobStatus.RUNNING.value):
            return "active"
        await self.delete_outputs(job_id)
        inputs, params = InputStore.of(self), JobParams.model_validate_json(params)
        for ref in (getattr(params, name) for name in IMAGE_INPUT_FIELDS):
            if is_reference(ref):
                await inputs.delete(ref)
        res = await self._run("DELETE_ENDED", [], [job_id, self.settings.default_owner])
        return res[0]

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

    def _deliveries(self, items: list[tuple[str, str, int, list, bool]], consumer: str) -> list[Delivery]:
        out = []
        for stream, msg_id, count, res, taken_over in items:
            if res[0] != "ok":
                continue
            fields = pairs(res[2:])
            out.append(
                Delivery(
                    job=job_from_hash(fields),
                    stream=stream,
                    message_id=msg_id,
                    delivery_count=count,
                    attempt=int(res[1]),
                    consumer=consumer,
                    tenant=fields.get("tenant") or self.settings.default_owner,
                    taken_over=taken_over,
                )
            )
        return out

    async def claim(
        self, models: list[str], consumer: str, max_jobs: int = 1, block_ms: int = 0
    ) -> list[Delivery]:
        """Take up to `max_jobs` jobs of `models` for `consumer`, highest priority first.

        Stream by stream in priority order (high, normal, low; models in the given order), a stream whose oldest
        waiting entry has waited `priority_aging_s` counting one priority higher (`_claim_order`):
        1. Takeover: entries idle longer than the lease whose lease key expired (their worker is gone, or a pool
           gave them back) are XCLAIMed (the XAUTOCLAIM rule, done in a script so the lease is checked atomically).
        2. New entries: XREADGROUP `>`.
        When there are none in any stream, one blocking XREADGROUP on all of them for up to `block_ms` (sliced to
        10 s at most).
        Each taken entry then gets a new attempt number and a lease (`lease_s`). Entries of canceled or expired jobs
        are acked and skipped; an entry delivered more than `max_deliveries` times goes to `P:dlq:{model}` and its
        job ends failed with code "too_many_deliveries". May return fewer jobs than asked, or none."""
        streams = [self.stream_key(m, p) for p in PRIORITY_ORDER for m in models]
        try:
            streams = await self._claim_order(
                streams, [r for r in range(len(PRIORITY_ORDER)) for _ in models]
            )
            return await self._claim(streams, consumer, max_jobs, block_ms)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._groups.clear()  # Redis lost the groups (restart without persistence): create them again
            return await self._claim(streams, consumer, max_jobs, 0)

    async def _claim_order(self, streams: list[str], ranks: list[int]) -> list[str]:
        """`streams` (in priority order, `ranks` their priorities: 0 high) in the order a claim reads them: each
        counts one priority higher for every `priority_aging_s` its oldest waiting entry (undelivered, or given
        back) has waited (its id is its enqueue time). Ties keep the priority order. One round trip; none with
        aging off."""
        aging = self.settings.priority_aging_s
        if aging <= 0 or len(streams) < 2:
            return streams
        stats = await self._run("QUEUE_STATS", streams, [])
        now_ms = time.time() * 1000

        def rank(i: int) -> float:
            oldest = stats[i][1]
            waited_s = max(0.0, now_ms - int(oldest.split("-")[0])) / 1000 if oldest else 0.0
            return ranks[i] - waited_s / aging

        return [streams[i] for i in sorted(range(len(streams)), key=rank)]

    async def _claim(self, streams: list[str], consumer: str, max_jobs: int, block_ms: int) -> list[Delivery]:
        s = self.settings
        await self._ensure_groups(streams)
        lease_ms = int(s.lease_s * 1000)
        common = [consumer, lease_ms, s.max_deliveries, repr(time.time()), s.job_ttl_s, s.events_max_length]
        taken: list[Delivery] = []
        # Stream by stream in priority order, its takeovers (older) then its new entries: a low job given back by
        # a pool must not be taken before a newer high one (an audit's high job waited behind two low ones).
        for stream in streams:
            if len(taken) >= max_jobs:
                break
            res = await self._run("RECLAIM", [stream], [*common, max_jobs - len(taken)])
            taken += self._deliveries([(stream, m, int(c), r, bool(t)) for m, _, c, r, t in res], consumer)
            # Entries of jobs that ended while queued (canceled, expired) are acked and skipped: read on past
            # them (a bounded number of reads per claim).
            for _ in range(_MAX_READS_PER_STREAM):
                if len(taken) >= max_jobs:
                    break
                res = await self.redis.xreadgroup(GROUP, consumer, {stream: ">"}, count=max_jobs - len(taken))
                read = [(stream, m, f.get("job", "")) for _, entries in res or [] for m, f in entries]
                if not read:
                    break
                taken += await self._accept(read, common, consumer)
        new: list[tuple[str, str, str]] = []  # (stream, msg id, job id)
        if not taken and block_ms > 0:
            block = max(1, min(int(block_ms), MAX_BLOCK_MS))
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
            taken += await self._accept(new, common, consumer)
        await self._maybe_trim(streams)
        return taken

    async def _accept(self, new: list[tuple[str, str, str]], common: list, consumer: str) -> list[Delivery]:
        """First deliveries of `new` (stream, msg id, job id) entries: the jobs still queued, each with an attempt
        and a lease (ACCEPT); the rest are acked and left out."""
        res = await self._run("ACCEPT", [], [*common, *(x for triple in new for x in triple)])
        return self._deliveries(
            [(st, m, 1, r, False) for (st, m, _), r in zip(new, res, strict=True)], consumer
        )

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
        """True when a client asked to cancel the job, its deadline passed, or it no longer exists: stop between
        steps and call `mark_canceled`."""
        return _stop(await self.redis.hmget(self.job_key(job_id), _STOP_FIELDS), time.time())

    async def poll_running(
        self, deliveries: list[Delivery], step: int | None = None, total: int = 0
    ) -> list[tuple[bool, bool]]:
        """For the jobs of a running batch, in one round trip: (cancel requested, progress recorded) each. The
        first is `cancel_requested` (a cancel, or the job's deadline passed); the second, with `step`, is `progress(delivery, step, total)` (False: fenced
        or no longer running), without `step` always True. A worker's progress task calls this a few times a
        second, off the denoise loop (workers/job_loop.py)."""
        s, sha = self.settings, self._scripts["PROGRESS"].sha
        data = json.dumps({"status": "running", "step": step, "total_steps": total})
        async with self.redis.pipeline(transaction=False) as pipe:
            for d in deliveries:
                pipe.hmget(self.job_key(d.job.id), _STOP_FIELDS)
                if step is not None:
                    args = [self.prefix, d.job.id, d.attempt, step, total, s.events_max_length, data]
                    pipe.evalsha(sha, 0, *args)
            res = await pipe.execute(raise_on_error=False)
        if any(isinstance(r, NoScriptError) for r in res):  # Redis restarted empty: load the script, go again
            await self.redis.script_load(store_lua.PROGRESS)
            return await self.poll_running(deliveries, step, total)
        for r in res:
            if isinstance(r, Exception):
                raise r
        per_job, now = (1 if step is None else 2), time.time()
        out = []
        for i in range(len(deliveries)):
            canceled = _stop(res[i * per_job], now)
            out.append((canceled, step is None or bool(res[i * per_job + 1])))
        return out

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

    async def complete(
        self,
        delivery: Delivery,
        outputs: list[OutputBlob],
        stages: dict[str, float] | None = None,
        *,
        cached_steps: int | None = None,
    ) -> bool:
        """Store the outputs (bytes with `output_ttl_s`, or objects under `output_dir`), mark the job succeeded
        with its outputs and timings, emit `succeeded`, XACK and drop the lease. The bytes are written first
        under this attempt's own keys (Redis) or object paths (service/job_outputs.py); one small fenced script
        then renames them into place (Redis) or records the attempt's object key, and commits the job: a stale
        attempt's call returns False, and what it wrote never becomes visible (and is deleted). So a succeeded
        job always has its outputs. Raises `OutputStoreError` when an object cannot be written (nothing is
        committed; the caller retries or fails the job). `stages`: seconds per stage as measured by the worker
        (text_encode, ...); `cached_steps`: the steps a step cache skipped (a job with `cache`)."""
        job, now = delivery.job, time.time()
        started = job.started_at or now
        timings = Timings(
            queue_s=started - job.created_at,
            inference_s=now - started,
            total_s=now - job.created_at,
            stages=stages or {},
        )
        written = await self._write_outputs(delivery, outputs)
        if written is None:
            return False
        urls, out_key, renames = written
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
        # The steps the worker reported running (an image's strength runs fewer than the job's steps; Heun's or
        # DPM2's loop calls the model 2N - 1 times), so that the job ends on the count its progress events gave.
        reported = await self.redis.hget(self.job_key(job.id), "total_steps")
        total = int(reported or 0) or job.progress.total_steps or job.params.num_inference_steps
        fields = {
            "outputs": json.dumps(records),
            "timings": timings.model_dump_json(),
            "step": str(total),
            "total_steps": str(total),
        }
        if out_key:
            fields["out_key"] = out_key
        data = {"status": "succeeded", "outputs": records, "timings": timings.model_dump(mode="json")}
        if cached_steps is not None:
            fields["cached_steps"] = str(cached_steps)
            data["cached_steps"] = cached_steps
        done = await self._end(delivery, JobStatus.SUCCEEDED, fields, data, renames)
        if not done and renames:
            await self._raw.delete(*(staged for staged, _ in renames))
        elif not done and out_key:
            await self._drop_refused_objects(job.id, out_key)
        return done

    async def note_error(self, delivery: Delivery, message: str) -> bool:
        """Record why this attempt failed in the engine (the job is then retried after its lease): a dead letter's
        error quotes it. Fenced."""
        return bool(await self._run("NOTE_ERROR", [], [delivery.job.id, delivery.attempt, message[:500]]))

    async def fail(self, delivery: Delivery, code: str, message: str) -> bool:
        """End the job failed with `{code, message}` (no redelivery), emit `failed`, XACK. Fenced like `complete`."""
        err = JobError(code=code, message=message)
        data = {"status": "failed", "error": err.model_dump()}
        return await self._end(delivery, JobStatus.FAILED, {"error": err.model_dump_json()}, data)

    async def mark_canceled(self, delivery: Delivery) -> bool:
        """End the job canceled after the worker stopped it on `cancel_requested`; emit `canceled`, XACK. Fenced.
        Stopped by its deadline (no client cancel): with error `deadline_exceeded`."""
        flag, deadline = await self.redis.hmget(self.job_key(delivery.job.id), ["cancel", "deadline"])
        if flag != "1" and deadline and time.time() >= float(deadline):
            err = JobError(code="deadline_exceeded", message="the job was still running at its deadline")
            data = {"status": "canceled", "error": err.model_dump()}
            return await self._end(delivery, JobStatus.CANCELED, {"error": err.model_dump_json()}, data)
        return await self._end(delivery, JobStatus.CANCELED, {}, {"status": "canceled"})

    async def expire_due(self, limit: int = 100) -> list[str]:
        """The deadline sweep: end the jobs whose deadline has passed (up to `limit`): queued ones `expired`,
        running ones whose worker is gone (lease expired) `canceled`; those a live pool holds are left to it
        (`poll_running`) and checked again a lease later. Returns the ids ended. A deliverer runs it every
        `webhook_poll_s` (service/webhooks/deliverer.py)."""
        s = self.settings
        args = [repr(time.time()), s.job_ttl_s, s.events_max_length, limit, s.lease_s]
        return list(await self._run("EXPIRE_DUE", [], args))

    async def fail_unserved(self, model: str, unserved_s: float, limit: int = 100) -> list[str]:
        """End `failed` (code `no_pool`) the jobs of `model` that no pool holds (queued, or running with an
        expired lease), up to `limit` per stream: for a model no pool has served for `unserved_s` (the
        deliverer's sweep decides). Returns the ids failed."""
        s = self.settings
        message = (
            f"no pool served model {model!r} for {unserved_s:.0f} s (unserved_timeout_s); the job was not run to "
            "its end: submit it again when a pool serves the model"
        )
        args = [repr(time.time()), s.job_ttl_s, s.events_max_length, int(s.lease_s * 1000), message, limit]
        failed: list[str] = []
        for priority in Priority:
            failed += await self._run("FAIL_UNSERVED", [self.stream_key(model, priority)], args)
        return failed

    async def forget_consumers(self, models: list[str], idle_s: float) -> int:
        """Delete the consumers of `models`' streams that hold no pending entry and have been idle for `idle_s`
        (those of crashed or stopped pools). Returns how many."""
        streams = [self.stream_key(m, p) for m in models for p in PRIORITY_ORDER]
        return int(await self._run("FORGET_CONSUMERS", streams, [int(idle_s * 1000)])) if streams else 0

    async def models_with_jobs(self) -> list[str]:
        """Every model a job was ever submitted for (`P:models`)."""
        return sorted(await self.redis.smembers(f"{self.prefix}:models"))

    async def release(self, delivery: Delivery) -> bool:
        """Give the job back without finishing it (SIGTERM): back to `queued` at its place in the stream, reclaimed
        by the next `claim` of any pool without spending a delivery; this attempt is fenced off. Fenced itself."""
        data = json.dumps({"status": "queued", "reason": "released"})
        args = [delivery.job.id, delivery.attempt, delivery.consumer, self.settings.events_max_length, data]
        return bool(await self._run("RELEASE", [], args))

"""The Redis store: the durable queue between the API and the worker pools (redis.asyncio, Redis >= 7).

Key layout (`P` is `Settings.key_prefix`, "ms" by default):

| key                          | type   | holds |
|------------------------------|--------|-------|
| `P:stream:{model}:{priority}` | stream, group `pools` | one entry `job=<id>` per job to run |
| `P:job:{id}`                 | hash   | status, tenant, out_token, out_key, params (JSON), times, attempt, worker, progress, outputs/error/timings (JSON), cancel flag, stream + message id, deadline, webhook + its delivery state (`wh_*`); TTL once ended |
| `P:events:{id}`              | stream | `type` + `data` (JSON) per event, capped; TTL once ended. SSE ids are its entry ids |
| `P:out:{id}:{i}`             | string | encoded output bytes, TTL (or an object `<output_dir>/<id>/<out_key>/<i>.<ext>` when set) |
| `P:staged:{id}:{attempt}:{i}` | string | output bytes written by one attempt, renamed to `P:out:{id}:{i}` by its fenced commit (else they expire) |
| `P:idem:{tenant}:{key}`      | string | `<job id> <request hash>`, TTL (idempotency keys are per tenant) |
| `P:active:{tenant}`          | set    | the tenant's queued/running job ids while its key has an active-job limit; pruned on submit |
| `P:jobs_of:{tenant}`         | sorted set | the tenant's job ids by created_at (`GET /v1/jobs`); ids of expired jobs pruned on submit and on listing |
| `P:lease:{id}`               | string | the attempt holding the job, expires unless renewed (`heartbeat`) |
| `P:dlq:{model}`              | stream | dead-lettered jobs with the reason |
| `P:pools`                    | hash   | pool name -> `PoolInfo` JSON |
| `P:models`, `P:stats`        | set, hash | models ever submitted (for queue metrics); cluster-wide counters `{model}\\|{name}` |
| `P:deadlines`                | sorted set | job id -> its deadline (unix s) while it may still expire; the sweep (`expire_due`) reads it |
| `P:webhooks:due`             | sorted set | job id -> when its webhook is due (service/webhooks/queue.py; the job hash keeps its state) |

API keys and rate buckets (`P:apikey:*`, `P:apikeys`, `P:ratelimit:*`) are `service/auth.py`'s.

Tenants: every job records the tenant that submitted it (`Settings.default_owner` when none is given, as with
`MESHSERVE_AUTH=none`); `get(job_id, tenant)` answers None for another tenant's job exactly as for an unknown id,
and the API's routes reach a job only through it.

Delivery is at least once: a worker `claim`s entries (XREADGROUP, or takes over entries whose lease expired),
`start`s them, and its `complete`/`fail`/`mark_canceled` write the result and XACK in one script (output bytes
are SET beforehand with plain commands, under keys of the attempt, and only renamed into place by the script). Every worker
write is fenced by the attempt number `claim` took: once another delivery took the job, the old worker's writes
return False and change nothing. The transitions are Lua scripts (`service/store_lua.py`).

`Store` is one facade over four parts, each in its own module: the queue protocol (`service/job_queue.py`), the
API's reads (`service/job_reads.py`), output storage and signing (`service/job_outputs.py`) and the pool registry
(`service/pool_registry.py`), on a shared base holding the clients, keys and scripts (`service/store_base.py`).
Every Redis command has a deadline (`service/redis_client.py`): a Redis that stops answering is an error, never a
wait for ever.
"""

from __future__ import annotations

from meshserve.service.job_queue import GROUP, JobQueue, TooManyActiveJobs, request_hash
from meshserve.service.store_base import job_from_hash, valid_job_id

__all__ = ["GROUP", "Store", "TooManyActiveJobs", "job_from_hash", "request_hash", "valid_job_id"]


class Store(JobQueue):
    """Async access to the Redis data model, for the API (submit/get/cancel/events/...) and the workers
    (register_pool/claim/start/heartbeat/progress/poll_running/complete/fail/mark_canceled/release).

    One instance per process; call `close()` at shutdown. Redis errors propagate as `redis.exceptions.RedisError`
    (the API answers them with 503), output storage errors as `OutputStoreError` (503 too; workers retry them).

    `outputs`: where outputs go when `settings.output_dir` is set; built from the settings unless given (tests
    pass an `OutputStore` subclass that fails on purpose)."""

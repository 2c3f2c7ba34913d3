"""What every part of the store shares: the Redis clients, the key names, the scripts, and the job hash's decoding.

`Store` (service/store.py) is this base plus its four parts: the queue protocol (service/job_queue.py), the API's
reads (service/job_reads.py), output storage (service/job_outputs.py) and the pool registry
(service/pool_registry.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from meshserve.service import store_lua
from meshserve.service.contract import (
    CONTENT_TYPES,
    Job,
    JobError,
    JobParams,
    JobStatus,
    Output,
    Priority,
    Progress,
    Timings,
    WebhookState,
)
from meshserve.service.output_store import OutputStore
from meshserve.service.redis_client import connect
from meshserve.service.settings import Settings

# File extension of an output object (Settings.output_dir) by content type: the format's name.
EXTENSIONS = {content_type: fmt for fmt, content_type in CONTENT_TYPES.items()}

_JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

_SCRIPTS = (
    "SUBMIT ACCEPT RECLAIM GIVE_BACK START HEARTBEAT PROGRESS END RELEASE CANCEL POSITION QUEUE_STATS TRIM"
    " EXPIRE_DUE FAIL_UNSERVED NOTE_ERROR FORGET_POOLS FORGET_CONSUMERS DELETE_ENDED"
)


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
        deadline_at=_f(h.get("deadline")),
        webhook=_webhook_state(h),
        cached_steps=int(h["cached_steps"]) if h.get("cached_steps") else None,
    )


def _webhook_state(h: dict[str, str]) -> WebhookState | None:
    """The delivery state the webhook scripts keep in the job hash (service/webhooks/queue.py), once queued."""
    if not h.get("wh_status"):
        return None
    status = "pending" if h["wh_status"] == "delivering" else h["wh_status"]
    return WebhookState(
        status=status, attempts=int(h.get("wh_attempts") or 0), last_error=h.get("wh_error") or None
    )


def pairs(flat: list) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


class StoreBase:
    """The clients, keys and scripts. `redis` answers strings (decode_responses), `_raw` bytes (outputs)."""

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
        common = dict(
            connect_timeout_s=settings.redis_connect_timeout_s,
            health_check_interval_s=settings.redis_health_check_interval_s,
        )
        self.redis = connect(settings.redis_url, command_timeout_s=settings.redis_command_timeout_s, **common)
        # Blocking reads (an SSE stream's or a `Prefer: wait`'s XREAD BLOCK) hold a connection each for seconds:
        # they get a pool of their own, so that however many wait, the rest (keys, submits, probes) never finds
        # its pool exhausted (an audit took /readyz to 503 "Too many connections" with 120 streams). The API
        # bounds the waiters to this pool's size (service/api/wait_slots.py).
        self.blocking = connect(
            settings.redis_url,
            command_timeout_s=settings.redis_command_timeout_s,
            max_connections=settings.max_waiting,
            **common,
        )
        self._raw = connect(
            settings.redis_url,
            command_timeout_s=max(settings.redis_command_timeout_s, settings.redis_output_timeout_s),
            decode_responses=False,
            **common,
        )
        self._scripts = {
            name: self.redis.register_script(getattr(store_lua, name)) for name in _SCRIPTS.split()
        }

    async def close(self) -> None:
        await self.redis.aclose()
        await self.blocking.aclose()
        await self._raw.aclose()

    async def ping(self) -> bool:
        """True when Redis answers."""
        return bool(await self.redis.ping())

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

    def tenant_jobs_key(self, tenant: str) -> str:
        return f"{self.prefix}:jobs_of:{tenant}"

    def dlq_key(self, model: str) -> str:
        return f"{self.prefix}:dlq:{model}"

    @property
    def pools_key(self) -> str:
        return f"{self.prefix}:pools"

    async def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return await self._scripts[name](keys=keys, args=[self.prefix, *args])

"""The front end's and the store's settings: one pydantic-settings class, read from `MESHSERVE_*` variables.

Workers import this class too (for the Redis URL, key prefix, lease and delivery limits), so the two sides of the
queue always agree on the data model's knobs.
"""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Every knob of the API and of the Redis store. Environment: `MESHSERVE_<FIELD>` (case-insensitive)."""

    model_config = SettingsConfigDict(env_prefix="MESHSERVE_", frozen=True, extra="ignore")

    # Redis. A short connect timeout makes a dead Redis a 503 within about a second (a killed Redis resets open
    # connections at once). No read timeout by default: with one, redis-py wraps every send in
    # `asyncio.wait_for`, which on Python 3.11 swallows a task's cancellation when the send has just finished
    # (measured: 55 of 60 cancelled GET/SET loops kept running), so workers and SSE streams could not be stopped.
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_connect_timeout_s: float = 1.0
    redis_socket_timeout_s: float | None = None
    # Every key the service and the workers write starts with this; tests use a unique prefix per test.
    key_prefix: str = "ms"

    # Admission: jobs not yet delivered to a pool, per model (all priorities together). Past it: 429.
    queue_max_length: int = Field(1000, ge=1)
    retry_after_s: int = Field(5, ge=1)

    # Lifetimes. A job hash and its event stream live `job_ttl_s` after the job ends; outputs `output_ttl_s`.
    job_ttl_s: int = Field(24 * 3600, ge=1)
    output_ttl_s: int = Field(3600, ge=1)
    idempotency_ttl_s: int = Field(24 * 3600, ge=1)
    events_max_length: int = Field(1000, ge=10)

    # Outputs live in Redis (`output_ttl_s`) unless `output_dir` is set: then they are files
    # `<output_dir>/<job id>/<index>.<ext>` (a volume the API and the workers share, or a bucket mounted
    # there), and their lifetime is the folder's (e.g. a bucket lifecycle rule), not Redis'. With
    # `output_url_base` too, jobs list `<output_url_base>/<job id>/<index>.<ext>` as the output URL (an object
    # store or CDN serving that folder) instead of the API's own `/v1/jobs/{id}/outputs/{i}`.
    output_dir: str | None = None
    output_url_base: str | None = None

    # Delivery: a running job's lease must be renewed within `lease_s`, else another pool takes it over;
    # a job delivered more than `max_deliveries` times goes to the dead-letter stream and ends failed.
    lease_s: float = Field(30.0, gt=0)
    max_deliveries: int = Field(3, ge=1)
    # A pool whose heartbeat is older than this is left out of /v1/models and /readyz.
    pool_stale_s: float = Field(15.0, gt=0)
    # How long the API trusts its cached copy of the pool registry (read on every submit).
    pool_cache_s: float = Field(1.0, ge=0)

    # Request limits.
    max_wait_s: int = Field(60, ge=0)  # `Prefer: wait=N` is clamped to this
    openai_timeout_s: float = Field(300.0, gt=0)  # /v1/images/generations waits this long for the result
    max_prompt_chars: int = Field(4000, ge=1)
    sse_keepalive_s: float = Field(15.0, gt=0)
    # Owner of idempotency keys when no API key identifies the caller.
    default_owner: str = "public"


@lru_cache
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()

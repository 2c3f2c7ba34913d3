"""The front end's and the store's settings: one pydantic-settings class, read from `MESHSERVE_*` variables.

Workers import this class too (for the Redis URL, key prefix, lease and delivery limits), so the two sides of the
queue always agree on the data model's knobs.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Every knob of the API and of the Redis store. Environment: `MESHSERVE_<FIELD>` (case-insensitive)."""

    model_config = SettingsConfigDict(env_prefix="MESHSERVE_", frozen=True, extra="ignore")

    # Redis (service/redis_client.py). A short connect timeout makes a dead Redis a 503 within about a second (a
    # killed Redis resets open connections at once). Every command has a deadline, `redis_command_timeout_s` (plus
    # its BLOCK time for a blocking stream read): a Redis that stops answering - a half-open connection after a
    # partition or a NAT timeout, a hung server - is an error on the API (503) and a retry on a fresh connection
    # in a worker, never a wait for ever. The deadline is an `asyncio.timeout`, not redis-py's `socket_timeout`,
    # which wraps every send in `asyncio.wait_for` and so, on Python 3.11, can swallow a task's cancellation
    # (measured: 55 of 60 cancelled GET/SET loops kept running). Output bytes (up to hundreds of MB) get
    # `redis_output_timeout_s`. A pooled connection idle longer than `redis_health_check_interval_s` is PINGed
    # before use (0: never); TCP keepalive is always on.
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_connect_timeout_s: float = Field(1.0, gt=0)
    redis_command_timeout_s: float = Field(5.0, gt=0)
    redis_output_timeout_s: float = Field(60.0, gt=0)
    redis_health_check_interval_s: float = Field(15.0, ge=0)
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

    # Outputs live in Redis (`output_ttl_s`) unless `output_dir` is set: a local folder (a volume the API and
    # the workers share), `gs://bucket/prefix`, `s3://bucket/prefix` or `az://container/prefix`
    # (service/output_store.py; credentials from the usual AWS_* / GOOGLE_* / AZURE_* environment or the
    # instance's). Objects are `<output_dir>/<job id>/<token>-<attempt>/<index>.<ext>` (`<token>` is 128 random
    # bits per job, so paths are unguessable; `<attempt>` keeps a stale delivery's writes apart), and their
    # lifetime is the location's (e.g. a bucket lifecycle rule), not Redis'. Jobs list the API's own
    # `/v1/jobs/{id}/outputs/{i}` as the output URL, unless either `output_url_base` is set: then
    # `<output_url_base>/<job id>/<token>-<attempt>/<index>.<ext>` (a bucket or CDN serving `output_dir`; a
    # bearer link, docs/security.md), or `output_signed_url_ttl_s` (cloud locations only): a URL signed with the
    # service's credentials, valid that many seconds from when the job was read (at most 7 days). Not both.
    output_dir: str | None = None
    output_url_base: str | None = None
    output_signed_url_ttl_s: int | None = Field(None, ge=1, le=7 * 24 * 3600)

    # Delivery: a running job's lease must be renewed within `lease_s`, else another pool takes it over;
    # a job delivered more than `max_deliveries` times goes to the dead-letter stream and ends failed.
    lease_s: float = Field(30.0, gt=0)
    max_deliveries: int = Field(3, ge=1)
    # Priorities are read high -> normal -> low, but a waiting job counts one priority higher for every
    # `priority_aging_s` it has waited: under steady high-priority load a low job waits about 2 x this longer
    # than a high one, not for ever (an audit's low job, queued at 0.3 s, started at 28.4 s, after every high job
    # that arrived meanwhile). 0: strict priorities.
    priority_aging_s: float = Field(60.0, ge=0)
    # A model that no pool serves for this long has its waiting jobs (queued, or running with an expired lease)
    # failed with code `no_pool` (service/unserved_sweep.py); 0 lets them wait for ever. Long enough for a pool
    # to restart, load and compile (minutes for a real model).
    unserved_timeout_s: float = Field(600.0, ge=0)
    # A pool whose heartbeat is older than this is left out of /v1/models and /readyz.
    pool_stale_s: float = Field(15.0, gt=0)
    # How long the API trusts its cached copy of the pool registry (read on every submit).
    pool_cache_s: float = Field(1.0, ge=0)

    # Who may call (docs/security.md). `keys`: every route but /livez, /readyz, /metrics and the API docs needs
    # `Authorization: Bearer <key>` (`meshserve keys create`); `none`: everyone is the one tenant
    # `default_owner`. `create_app()` and `meshserve serve` (127.0.0.1) default to none; `meshserve api` (0.0.0.0)
    # to keys unless MESHSERVE_AUTH=none is set.
    auth: Literal["keys", "none"] = "none"
    # An admin key the API installs at start-up (as key `admin`, tenant `admin`, no limits), for deployments that
    # provision it from a Secret or an env file (docker-compose, Kubernetes) instead of `meshserve keys create`.
    # Changing it and restarting replaces the old one (rotation). Generate: `msk_` + secrets.token_urlsafe(32).
    admin_key: SecretStr | None = None
    # What `meshserve keys create` gives a key unless told otherwise (0: no limit).
    key_rate_per_minute: int = Field(600, ge=0)
    key_max_active: int = Field(100, ge=0)

    # Request limits. A body over `max_body_bytes` is a 413 before it is read further (prompts are bounded by
    # `max_prompt_chars` on top).
    max_body_bytes: int = Field(1 << 20, ge=1024)
    max_wait_s: int = Field(60, ge=0)  # `Prefer: wait=N` is clamped to this
    openai_timeout_s: float = Field(300.0, gt=0)  # /v1/images/generations waits this long for the result
    max_prompt_chars: int = Field(4000, ge=1)
    sse_keepalive_s: float = Field(15.0, gt=0)
    # Requests that wait on a job (an SSE stream, a `Prefer: wait` submit, the OpenAI route) hold a Redis
    # connection each: at most `max_waiting` per API process (the blocking reads' own pool), and, with API keys,
    # at most `max_waiting_per_key` of one tenant (service/api/wait_slots.py). Past them a stream is a 503 / 429
    # with Retry-After, a `Prefer: wait` submit is answered at once (202) and the OpenAI route refuses before
    # submitting.
    max_waiting: int = Field(256, ge=1)
    max_waiting_per_key: int = Field(32, ge=1)
    # On SIGTERM the API ends its waits and SSE streams at once (service/api/draining.py); whatever is still open
    # after this long is cut (uvicorn's timeout_graceful_shutdown). Below Kubernetes' grace period (30 s).
    shutdown_grace_s: float = Field(10.0, gt=0)
    # FastAPI's /docs and /redoc pages load their scripts from a CDN (cdn.jsdelivr.net) into the API's origin,
    # where the playground keeps a key in sessionStorage: off unless asked for. /openapi.json is always served.
    api_docs: bool = False
    # Whether the app installs the SIGTERM/SIGINT hook that starts draining (`meshserve api` sets it; a process
    # that owns its signals itself, as `meshserve serve`, sets `app.state.draining` when it stops).
    drain_on_signals: bool = False
    # Image inputs (docs/security.md, "Image inputs"). Routes that take images (/v1/generate, /v1/images/edits)
    # accept bodies up to `max_image_body_bytes` (an image and a mask as base64 data URLs: 4/3 of their bytes);
    # every other route keeps `max_body_bytes`. One image (decoded from base64 or fetched) is at most
    # `max_image_bytes` and `max_image_pixels` (checked from its header before it is decoded: 4096 x 4096).
    # Image URLs are fetched by the API before the job is accepted, under the SSRF rules of service/ssrf.py:
    # public addresses only unless `image_fetch_allow_private` (on-premise image stores), metadata never.
    max_image_body_bytes: int = Field(24 << 20, ge=1024)
    # The bodies one API process holds at once, summed over the requests in flight: past it a request is a 503
    # (`server_busy`, Retry-After) as its bytes arrive. An image request holds about 3x its body while it
    # is parsed (an audit measured 38 MB per 14 MB body), so 256 MiB bounds that part of the process near
    # 0.8 GB however many clients send images at once.
    max_buffered_body_bytes: int = Field(256 << 20, ge=1 << 20)
    # Images decoded at once per API process. What a decode holds depends on its pixels, not its bytes: an
    # 87 KB PNG of 4096 x 4096 zeros held ~170 MB while decoded and re-encoded (an audit: 8 at once took the API
    # from 112 to 1,433 MiB); the others wait their turn (each decode is also CPU: 1-2 s at 4096 x 4096).
    image_decode_slots: int = Field(2, ge=1)
    # A request's line and headers: at most this many bytes (else 431, closed), arrived within this many seconds
    # of the connection opening or of its previous response (else closed): service/api/http_protocol.py.
    max_header_bytes: int = Field(64 << 10, ge=4096)
    header_timeout_s: float = Field(20.0, gt=0)
    # A request body must arrive whole within this (else 408 body_timeout): 24 MiB at 2 Mbit/s takes 100 s.
    body_timeout_s: float = Field(120.0, gt=0)
    max_image_bytes: int = Field(10 << 20, ge=1024)
    max_image_pixels: int = Field(4096 * 4096, ge=64)
    image_fetch_allow_private: bool = False
    image_fetch_connect_timeout_s: float = Field(3.0, gt=0)
    image_fetch_timeout_s: float = Field(10.0, gt=0)
    image_fetch_max_redirects: int = Field(3, ge=0, le=10)
    # The tenant of every request when no API key identifies the caller (MESHSERVE_AUTH=none), and of jobs
    # submitted without one.
    default_owner: str = "public"

    # Webhooks (docs/webhooks.md, service/webhooks/). Signed per Standard Webhooks with the submitting key's own
    # secret; `webhook_secret` (`whsec_<base64>`) signs for keys that have none and in open mode (MESHSERVE_AUTH=
    # none), where a request with a webhook is refused (422) unless it is set. Targets must resolve to public
    # addresses (service/ssrf.py) unless `webhook_allow_private` (on-premise receivers, tests); cloud metadata
    # addresses never. Retries: exponential from `webhook_retry_base_s` (doubling, capped at
    # `webhook_retry_max_s`, times a random 0.5-1.5 jitter) until `webhook_max_attempts` POSTs or
    # `webhook_max_age_s` after the job ended (the defaults: 2 s first, about 34 attempts over a day). A claimed
    # delivery is hidden from other deliverers for `webhook_lease_s` (more than the POST's timeout): a deliverer
    # killed mid-POST is retried by another after it. The API process runs a deliverer (and the deadline sweep)
    # as a background task unless `webhook_deliver_in_api` is false; `meshserve webhooks` runs one alone.
    webhook_secret: SecretStr | None = None
    webhook_allow_private: bool = False
    webhook_timeout_s: float = Field(10.0, gt=0)
    webhook_retry_base_s: float = Field(2.0, gt=0)
    webhook_retry_max_s: float = Field(3600.0, gt=0)
    webhook_max_attempts: int = Field(40, ge=1)
    webhook_max_age_s: float = Field(24 * 3600.0, gt=0)
    webhook_lease_s: float = Field(30.0, gt=0)
    webhook_concurrency: int = Field(16, ge=1)
    # Of those, at most this many POSTs of one tenant at once (the others' deliveries pass ahead of the rest).
    webhook_concurrency_per_key: int = Field(4, ge=1)
    webhook_deliver_in_api: bool = True
    # How often a deliverer looks for due deliveries and expired deadlines (both are one Redis script each).
    webhook_poll_s: float = Field(0.5, gt=0)
    # A deadline (`Cancel-After` header or `deadline_s`) may be at most this far from submission.
    max_deadline_s: float = Field(7 * 24 * 3600.0, gt=0)

    # LoRA adapters (docs/lora.md, "Served"; service/lora_sources.py): the one folder whose files pools.yaml and
    # `POST /v1/loras` may name (relative to it, or absolute inside it once symlinks are resolved); None: files
    # are refused, only Hub ids. `lora_allow_hub`: Hub ids (`owner/name[/file.safetensors]`, never URLs) too.
    # Pools read their adapter changes every `lora_poll_s`; `POST /v1/loras` waits up to `lora_wait_s` for the
    # pools' answers before it answers 202 (then `GET /v1/loras` says where it stands).
    lora_root: str | None = None
    lora_allow_hub: bool = True
    lora_poll_s: float = Field(1.0, gt=0)
    lora_wait_s: float = Field(10.0, ge=0)


@lru_cache
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()

"""Front-end metrics (prometheus-client, prefix `meshserve_`), in the default registry.

The default registry is shared with the worker's `meshserve_worker_*` metrics so that `meshserve serve` (API and
worker in one process) exposes both on one /metrics. Labels are route templates, methods, statuses, models,
priorities and reasons: never a job id or a prompt (unbounded cardinality, and prompts are user data).

Queue depth and age, pool counts and the cluster-wide job counters that the store's scripts keep in Redis are
read at scrape time (`refresh_from_store`), so every API replica reports the same numbers.
"""

from __future__ import annotations

import logging
import platform
import time

from prometheus_client import REGISTRY, Counter, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

# Loopback requests take ~0.5 ms; a `Prefer: wait` or /v1/images request lasts as long as the generation.
_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
)

HTTP_REQUESTS = Counter(
    "meshserve_http_requests_total",
    "HTTP requests answered, by route template, method and status.",
    ["route", "method", "status"],
)
HTTP_LATENCY = Histogram(
    "meshserve_http_request_duration_seconds",
    "Seconds to answer an HTTP request (SSE: the stream's life).",
    ["route", "method"],
    buckets=_LATENCY_BUCKETS,
)
JOBS_SUBMITTED = Counter(
    "meshserve_jobs_submitted_total", "Jobs accepted into a queue.", ["model", "priority"]
)
JOBS_REJECTED = Counter(
    "meshserve_jobs_rejected_total",
    "Generation requests refused, by reason (invalid, model_not_found, queue_full, "
    "no_ready_pool, store_unavailable, idempotency_conflict, rate_limited, too_many_active_jobs).",
    ["reason"],
)
# By reason only: never the key, its name or the tenant (metrics are open, docs/security.md).
AUTH_REFUSED = Counter(
    "meshserve_auth_refused_total",
    "Requests refused by authentication or the per-key rate limit, by reason (missing_api_key, "
    "invalid_api_key, rate_limited).",
    ["reason"],
)
BUILD_INFO = Info("meshserve_build", "API build information.")

# Webhooks (service/webhooks/deliverer.py), counted by the process that delivers them: the API's background task
# or `meshserve webhooks` (its own --metrics-port). A POST takes one round trip to the receiver; the slowest a
# deliverer allows is `webhook_timeout_s` (10 s by default).
_WEBHOOK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
WEBHOOK_DELIVERIES = Counter(
    "meshserve_webhook_deliveries_total",
    "Webhooks settled for good: delivered (a 2xx) or failed (410, a refused address, or retries spent).",
    ["outcome"],
)
WEBHOOK_RETRIES = Counter(
    "meshserve_webhook_retries_total", "Webhook POSTs that failed and were scheduled again."
)
WEBHOOK_ATTEMPT_SECONDS = Histogram(
    "meshserve_webhook_attempt_duration_seconds",
    "Seconds per webhook POST, by result (2xx, 4xx, 5xx, error: no answer, refused: address rules).",
    ["result"],
    buckets=_WEBHOOK_BUCKETS,
)
WEBHOOK_DELIVERY_SECONDS = Histogram(
    "meshserve_webhook_delivery_latency_seconds",
    "Seconds from a job's end to its webhook's successful delivery (retries included).",
    buckets=(*_WEBHOOK_BUCKETS, 60, 300, 1800, 3600, 6 * 3600, 24 * 3600),
)


def set_build_info() -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ms_version = version("meshserve")
    except PackageNotFoundError:
        ms_version = "dev"
    BUILD_INFO.info({"version": ms_version, "python": platform.python_version()})


class StoreCollector(Collector):
    """Exposes the last snapshot read from Redis by `refresh_from_store` (collectors are synchronous, the store
    is not, so the /metrics handler reads first and then renders)."""

    def __init__(self) -> None:
        self.queues: dict = {}
        self.stats: dict = {}
        self.pools: list = []
        self.webhooks_pending = 0
        self.up = 0  # 1 when the last read of Redis succeeded; the other families are that read's
        self.read_at = 0.0  # unix seconds of the last successful read (0: never)

    def collect(self):
        yield GaugeMetricFamily(
            "meshserve_store_up",
            "1 when this scrape read the store (Redis); 0: the store families below are the last snapshot read.",
            value=self.up,
        )
        yield GaugeMetricFamily(
            "meshserve_store_snapshot_timestamp_seconds",
            "When the store families were last read (unix seconds; 0: never).",
            value=self.read_at,
        )
        depth = GaugeMetricFamily(
            "meshserve_queue_depth",
            "Jobs queued and not yet delivered to a pool.",
            labels=["model", "priority"],
        )
        age = GaugeMetricFamily(
            "meshserve_queue_oldest_age_seconds",
            "Age of the oldest undelivered job (0: none).",
            labels=["model", "priority"],
        )
        pending = GaugeMetricFamily(
            "meshserve_queue_pending",
            "Jobs delivered to a pool and not yet acknowledged.",
            labels=["model", "priority"],
        )
        for (model, priority), q in sorted(self.queues.items()):
            depth.add_metric([model, priority.value], q["depth"])
            age.add_metric([model, priority.value], q["oldest_age_s"])
            pending.add_metric([model, priority.value], q["pending"])
        yield from (depth, age, pending)

        finished = CounterMetricFamily(
            "meshserve_jobs_finished",
            "Jobs that ended, by outcome (all pools, kept in Redis).",
            labels=["model", "outcome"],
        )
        reclaimed = CounterMetricFamily(
            "meshserve_jobs_reclaimed",
            "Jobs taken over after their lease expired (all pools).",
            labels=["model"],
        )
        dead = CounterMetricFamily(
            "meshserve_jobs_dead_lettered",
            "Jobs sent to the dead-letter stream (all pools).",
            labels=["model"],
        )
        for (model, name), value in sorted(self.stats.items()):
            if name.startswith("finished|"):
                finished.add_metric([model, name.split("|", 1)[1]], value)
            elif name == "reclaimed":
                reclaimed.add_metric([model], value)
            elif name == "dead_lettered":
                dead.add_metric([model], value)
        yield from (finished, reclaimed, dead)

        pools = GaugeMetricFamily(
            "meshserve_pools", "Live pools in the registry, by readiness.", labels=["ready"]
        )
        ready = sum(1 for p in self.pools if p.ready)
        pools.add_metric(["true"], ready)
        pools.add_metric(["false"], len(self.pools) - ready)
        yield pools
        yield GaugeMetricFamily(
            "meshserve_webhooks_pending",
            "Webhooks queued or waiting for a retry (all deliverers).",
            value=self.webhooks_pending,
        )


STORE_COLLECTOR = StoreCollector()
REGISTRY.register(STORE_COLLECTOR)


async def refresh_from_store(store) -> None:
    """Read queue depths, counters and pools from Redis into the collector; a Redis error leaves the last snapshot
    (the scrape still answers) and says so: `meshserve_store_up` 0, and the snapshot's time."""
    try:
        queues = await store.queue_depths()
        stats = await store.stats()
        pools = await store.list_pools()
        webhooks_pending = int(await store.redis.zcard(f"{store.prefix}:webhooks:due"))
    except Exception as e:  # a scrape must not fail because Redis is away
        log.warning("metrics: could not read the store: %s", e)
        STORE_COLLECTOR.up = 0
        return
    c = STORE_COLLECTOR
    c.queues, c.stats, c.pools, c.webhooks_pending = queues, stats, pools, webhooks_pending
    c.up, c.read_at = 1, time.time()


class MetricsMiddleware:
    """Counts and times every HTTP request by its route template (pure ASGI: a BaseHTTPMiddleware would cost a
    task and a queue per request)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            method = scope["method"]
            HTTP_REQUESTS.labels(path, method, str(status)).inc()
            HTTP_LATENCY.labels(path, method).observe(time.perf_counter() - start)

"""Worker metrics (prometheus-client), all named `meshserve_worker_*` so they never collide with the API's own
when `meshserve serve` runs both in one process (one registry, one /metrics), except
`meshserve_compilations_total`, which only workers export. Labels are model, pool, stage,
outcome: never a job id or a prompt (unbounded cardinality, and prompts are user data).

Dead-lettering happens inside the store's claim script, whichever consumer meets the entry, so its count is the
cluster-wide `meshserve_jobs_dead_lettered_total` the API reads from Redis, not a per-worker counter here."""

from __future__ import annotations

import os
import platform

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Info, start_http_server

# Seconds from a 64x64 CPU toy step (~1 ms) to a 1024^2 SDXL step on a slow device (~2 s) and whole stages.
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_COMPILE_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

STAGE_SECONDS = Histogram(
    "meshserve_worker_stage_seconds",
    "Seconds per pipeline stage and batch (text_encode, denoise, vae_decode, encode).",
    ["model", "stage"],
    buckets=_STAGE_BUCKETS,
)
CACHED_STEPS = Counter(
    "meshserve_worker_cached_steps_total",
    "Denoising steps a step cache skipped (docs/step-cache.md), counted once per batch (its jobs share each "
    "step's decision), by model and method.",
    ["model", "method"],
)
DENOISE_STEP_SECONDS = Histogram(
    "meshserve_worker_denoise_step_seconds",
    "Wall seconds between two denoise-step callbacks.",
    ["model"],
    buckets=_STEP_BUCKETS,
)
INFERENCE_SECONDS = Histogram(
    "meshserve_worker_inference_seconds",
    "Seconds from a batch's start to its results (all stages).",
    ["model"],
    buckets=_STAGE_BUCKETS,
)
QUEUE_WAIT_SECONDS = Histogram(
    "meshserve_worker_queue_wait_seconds",
    "Seconds a job waited between submission and its start.",
    ["model"],
    buckets=_STAGE_BUCKETS,
)
END_TO_END_SECONDS = Histogram(
    "meshserve_worker_end_to_end_seconds",
    "Seconds from submission to stored results, for succeeded jobs.",
    ["model"],
    buckets=_STAGE_BUCKETS,
)
BATCH_IMAGES = Histogram(
    "meshserve_worker_batch_size",
    "Images per device batch.",
    ["model"],
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
)
BATCH_JOBS = Histogram(
    "meshserve_worker_batch_jobs",
    "Jobs per device batch.",
    ["model"],
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
)
# Named as issue 8 asks (not meshserve_worker_*): a compilation on the request path is what an alert watches.
COMPILATIONS = Counter(
    "meshserve_compilations_total",
    "Programs compiled, by pool and reason: warmup (at start, for the pool's buckets) or request (a shape "
    "not warmed up, compiled while jobs wait: expected only in any_size pools).",
    ["pool", "reason"],
)
COMPILE_SECONDS = Histogram(
    "meshserve_worker_compile_seconds",
    "Warm-up seconds per model and pool (compiling the configured buckets).",
    ["model", "pool"],
    buckets=_COMPILE_BUCKETS,
)
POOL_BUSY = Gauge("meshserve_worker_pool_busy", "1 while the pool runs a batch.", ["pool"])
POOL_READY = Gauge(
    "meshserve_worker_pool_ready", "1 once the pool has loaded and warmed up its models.", ["pool"]
)
JOBS = Counter(
    "meshserve_worker_jobs_total",
    "Jobs this worker finished, by outcome (succeeded, failed, canceled, released: given back at a stop, "
    "given_back: claimed but not fitting the batch, fenced: another attempt owns it).",
    ["model", "outcome"],
)
RECLAIMED = Counter(
    "meshserve_worker_reclaimed_total",
    "Jobs this worker took over from a consumer whose lease lapsed (not ones a pool gave back).",
    ["model"],
)
CANCELLED = Counter(
    "meshserve_worker_cancelled_total", "Running jobs stopped by a cancel request.", ["model"]
)
BUILD_INFO = Info("meshserve_worker_build", "Worker build information.")
# LoRA adapters (docs/lora.md, "Served"; workers/adapters.py), by model.
LORA_LOADS = Counter(
    "meshserve_worker_lora_loads_total",
    "LoRA adapters loaded onto the devices: register (pools.yaml or POST /v1/loras) or reload (a job named one "
    "evicted from the pool's table).",
    ["model", "reason"],
)
LORA_EVICTIONS = Counter(
    "meshserve_worker_lora_evictions_total",
    "LoRA adapters evicted from the pool's table (least recently used) to make room for another.",
    ["model"],
)
LORA_HITS = Counter(
    "meshserve_worker_lora_hits_total",
    "Adapters named by a job that were resident when its batch started (one per job and adapter).",
    ["model"],
)
PREVIEWS = Counter(
    "meshserve_worker_previews_total",
    "Live previews published (SSE `preview` events), or skipped: a newer one came first, or too large.",
    ["model", "outcome"],
)
PREVIEW_ENCODE_SECONDS = Histogram(
    "meshserve_worker_preview_encode_seconds",
    "Seconds to encode one preview to a WebP data URL (off the pool thread).",
    ["model"],
    buckets=_STEP_BUCKETS,
)


class PromptCacheCollector:
    """The pools' prompt-embedding caches (models/engine/prompt_cache.py), read at scrape time: hits, misses,
    evictions (text rows), bytes and entries held, per model."""

    def __init__(self):
        self.caches: dict[str, object] = {}

    def watch(self, model: str, cache) -> None:
        self.caches[model] = cache

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        name = "meshserve_worker_prompt_cache"
        families = {
            "hits": CounterMetricFamily(
                f"{name}_hits", "Text rows found in the prompt cache.", labels=["model"]
            ),
            "misses": CounterMetricFamily(
                f"{name}_misses", "Text rows encoded (not cached).", labels=["model"]
            ),
            "evictions": CounterMetricFamily(
                f"{name}_evictions", "Text rows dropped past the byte bound.", labels=["model"]
            ),
            "bytes": GaugeMetricFamily(
                f"{name}_bytes", "Device bytes the prompt cache holds.", labels=["model"]
            ),
            "entries": GaugeMetricFamily(
                f"{name}_entries", "Text rows the prompt cache holds.", labels=["model"]
            ),
        }
        for model, cache in list(self.caches.items()):
            for attr, family in families.items():
                family.add_metric([model], float(getattr(cache, attr)))
        yield from families.values()


PROMPT_CACHES = PromptCacheCollector()
REGISTRY.register(PROMPT_CACHES)


def set_build_info() -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ms_version = version("meshserve")
    except PackageNotFoundError:
        ms_version = "dev"
    BUILD_INFO.info({"version": ms_version, "python": platform.python_version(), "pid": str(os.getpid())})


def serve_metrics(port: int, addr: str = "0.0.0.0") -> int:
    """Serve the default registry on `port` (0: any free port) in a daemon thread; returns the bound port."""
    server, _thread = start_http_server(port, addr=addr, registry=REGISTRY)
    return server.server_address[1]

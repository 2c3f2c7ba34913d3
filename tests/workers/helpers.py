"""Shared pieces of the worker tests: settings with a unique key prefix and short leases, job submission
straight through the store (no HTTP: the API is engineer S's and has its own tests), waiting, cleanup, and
worker subprocesses with the fake runner."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis
import yaml

from meshserve.service.contract import Job, JobParams, JobStatus, Priority
from meshserve.service.settings import Settings
from meshserve.service.store import Store
from meshserve.workers.fake_runner import FakeRunner

ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("MESHSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def make_settings(lease_s: float = 1.0, **kw) -> Settings:
    return Settings(
        redis_url=REDIS_URL,
        key_prefix=f"mswtest-{uuid.uuid4().hex[:10]}",
        lease_s=lease_s,
        pool_stale_s=5.0,
        **kw,
    )


def cleanup(settings: Settings) -> None:
    r = redis.Redis.from_url(settings.redis_url)
    keys = list(r.scan_iter(match=f"{settings.key_prefix}:*", count=1000))
    for i in range(0, len(keys), 500):
        r.delete(*keys[i : i + 500])
    r.close()


def params(
    prompt: str = "a cat", *, model: str = "fake", steps: int = 4, seed: int = 1, size: int = 16, n: int = 1
):
    return JobParams(
        model=model,
        prompt=prompt,
        width=size,
        height=size,
        num_inference_steps=steps,
        guidance_scale=5.0,
        seed=seed,
        n=n,
    )


async def submit_many(
    store: Store, items: list[JobParams], priority: Priority = Priority.NORMAL
) -> list[str]:
    return [(await store.submit(p, priority)).id for p in items]


async def wait_ended(store: Store, ids: list[str], timeout: float) -> dict[str, Job]:
    deadline = time.monotonic() + timeout
    while True:
        jobs = {i: await store.get(i) for i in ids}
        if all(j is not None and j.status.terminal for j in jobs.values()):
            return jobs
        if time.monotonic() > deadline:
            states = {i: (j.status.value if j else None) for i, j in jobs.items()}
            raise AssertionError(f"jobs not ended within {timeout} s: {states}")
        await asyncio.sleep(0.05)


async def wait_status(store: Store, job_id: str, status: JobStatus, timeout: float, step: int = 0) -> Job:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = await store.get(job_id)
        if job is not None and job.status == status and job.progress.step >= step:
            return job
        await asyncio.sleep(0.02)
    raise AssertionError(f"job {job_id} did not reach {status} (step >= {step}) within {timeout} s: {job}")


def fake_config(
    path: Path, *, pools: list[dict] | None = None, drain_seconds: float = 30.0, **options
) -> Path:
    """A pools.yaml for the fake runner (no JAX): one pool on device 0 unless `pools` says otherwise."""
    cfg = {
        "models": {"fake": {"runner": "fake", "options": options}},
        "pools": pools
        or [{"name": "p0", "devices": "0", "models": ["fake"], "max_batch": 1, "batch_wait_ms": 0}],
        "metrics_port": None,
        "drain_seconds": drain_seconds,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def spawn_worker(config: Path, settings: Settings, log_path: Path) -> subprocess.Popen:
    """A real `run_worker` process with the test's Redis settings (env MESHSERVE_*)."""
    env = {
        **os.environ,
        "MESHSERVE_REDIS_URL": settings.redis_url,
        "MESHSERVE_KEY_PREFIX": settings.key_prefix,
        "MESHSERVE_LEASE_S": str(settings.lease_s),
        "MESHSERVE_POOL_STALE_S": str(settings.pool_stale_s),
        "MESHSERVE_MAX_DELIVERIES": str(settings.max_deliveries),
    }
    code = f"from meshserve.workers.main import run_worker; run_worker({str(config)!r})"
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
    )


async def wait_pools_ready(
    store: Store, names: set[str], timeout: float = 30.0, count: int | None = None
) -> None:
    """Wait until ready pools with these config names (registry names are "<host>-<pid>/<pool>") are
    registered; `count`: how many registry entries in all."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pools = [p for p in await store.list_pools() if p.ready]
        if names <= {p.name.rsplit("/", 1)[1] for p in pools} and (count is None or len(pools) >= count):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"pools {names} not ready within {timeout} s")


async def all_events(store: Store, job_id: str) -> list[str]:
    """Every event type of a job's stream, in order (the store pages by 100)."""
    out, last = [], "0-0"
    while True:
        batch = await store.events(job_id, last)
        if not batch:
            return out
        out += [e.type.value for e in batch]
        last = batch[-1].id


class CompilingRunner(FakeRunner):
    """The fake runner, counting a "compilation" per new (width, height, rows) shape as a JAX pipeline does
    (`runner: "tests.workers.helpers:CompilingRunner"`): the pool's compilation accounting is tested with it."""

    def __init__(self, name: str, **options):
        super().__init__(name, **options)
        self.options = options
        self.shapes: set[tuple[int, int, int]] = set()

    def warm_up(self, buckets, batch_sizes, num_inference_steps) -> float:
        self.shapes |= {(w, h, b) for w, h in buckets for b in batch_sizes}
        return 0.0

    def run(self, batch, callback=None):
        first = batch[0].params
        self.shapes.add((first.width, first.height, sum(r.params.n for r in batch)))
        return super().run(batch, callback)

    @property
    def compilations(self) -> int:
        return len(self.shapes)


async def job_when_ended(client, job_id: str, timeout: float = 900) -> dict:
    """Polls GET /v1/jobs/{id} through an API client until the job ends; its JSON."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        job = (await client.get(f"/v1/jobs/{job_id}")).json()
        if job["status"] in ("succeeded", "failed", "canceled", "expired"):
            return job
        await asyncio.sleep(0.1)
    raise AssertionError(f"job {job_id} did not end within {timeout} s")

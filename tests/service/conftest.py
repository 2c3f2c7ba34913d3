"""Fixtures of the service tests: a unique Redis key prefix per test (on the real Redis at 127.0.0.1:6379, or
the one `MESHSERVE_TEST_REDIS_URL` names), the API over ASGI, and a fake worker that drives the store's
worker-side methods the way a pool does (no JAX)."""

from __future__ import annotations

import asyncio
import io
import os
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
from PIL import Image

from meshserve.service.app import create_app
from meshserve.service.contract import (
    FrameLimits,
    ModelDefaults,
    ModelInfo,
    ModelLimits,
    OutputBlob,
    PoolInfo,
)
from meshserve.service.settings import Settings
from meshserve.service.store import Store

REDIS_URL = os.environ.get("MESHSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

TOY = ModelInfo(
    id="toy",
    family="sdxl",
    task="text-to-image",
    defaults=ModelDefaults(width=64, height=48, num_inference_steps=4, guidance_scale=5.0),
    limits=ModelLimits(
        size_multiple=8,
        min_size=32,
        max_size=256,
        min_steps=1,
        max_steps=50,
        max_n=4,
        schedulers=["euler", "ddim"],
    ),
)
# A Flux-like card as a Flux pool publishes it: defaults carry true_cfg_scale (1.0: off), limits its step cache.
TOY_FLUX = ModelInfo(
    id="toy-flux",
    family="flux",
    task="text-to-image",
    defaults=ModelDefaults(
        width=64, height=48, num_inference_steps=4, guidance_scale=3.5, true_cfg_scale=1.0
    ),
    limits=ModelLimits(
        size_multiple=16,
        min_size=16,
        max_size=256,
        max_steps=50,
        max_n=4,
        schedulers=["flow_match_euler"],
        cache={"first_block": {"default_threshold": 0.08}},
    ),
)
TOY_VIDEO = ModelInfo(
    id="toy-video",
    family="wan",
    task="text-to-video",
    defaults=ModelDefaults(width=64, height=64, num_inference_steps=2, guidance_scale=4.0),
    limits=ModelLimits(
        min_size=32,
        max_size=128,
        max_steps=10,
        max_n=1,
        output_formats=["mp4", "webp"],
        buckets=[(64, 64), (96, 64)],
        frames=FrameLimits(min_frames=5, max_frames=33, step=4, offset=1, default=9),
    ),
)


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def drop_keys(store: Store) -> None:
    keys = [k async for k in store.redis.scan_iter(f"{store.prefix}:*", count=1000)]
    if keys:
        await store.redis.delete(*keys)


@pytest.fixture
def make_settings() -> Callable[..., Settings]:
    """Settings with a unique key prefix (one per fixture use) and any overrides."""
    prefix = f"mstest-{uuid.uuid4().hex[:12]}"

    def make(**overrides) -> Settings:
        base = dict(redis_url=REDIS_URL, key_prefix=prefix, pool_cache_s=0, pool_stale_s=300)
        return Settings(**{**base, **overrides})

    return make


@pytest.fixture
async def store(make_settings) -> AsyncIterator[Store]:
    s = Store(make_settings(lease_s=0.3))
    yield s
    await drop_keys(s)
    await s.close()


def png_bytes(width: int, height: int, value: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (value % 256, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


class FakeWorker:
    """A pool that 'generates' by sleeping `step_s` per step: claim -> start -> progress (checking cancel between
    steps) -> complete with real PNGs. `run_forever` loops until `stop`; Redis errors are waited out."""

    def __init__(
        self,
        store: Store,
        name: str = "pool-a",
        models: tuple[ModelInfo, ...] = (TOY,),
        step_s: float = 0.005,
        max_jobs: int = 1,
    ):
        self.store, self.name, self.models, self.step_s, self.max_jobs = store, name, models, step_s, max_jobs
        self.task: asyncio.Task | None = None
        self.finished: list[str] = []

    async def register(self, ready: bool = True) -> None:
        await self.store.register_pool(
            PoolInfo(
                name=self.name,
                models=list(self.models),
                buckets=[(64, 48)],
                mesh={"data": 1},
                max_batch=self.max_jobs,
                ready=ready,
                pid=os.getpid(),
            )
        )

    async def run_one(self, delivery) -> None:
        store, job = self.store, delivery.job
        if not await store.start(delivery):
            return
        total = job.params.num_inference_steps
        for step in range(1, total + 1):
            if await store.cancel_requested(job.id):
                await store.mark_canceled(delivery)
                return
            await asyncio.sleep(self.step_s)
            await store.progress(delivery, step, total)
        p = job.params
        blobs = [
            OutputBlob(
                index=i,
                data=png_bytes(p.width, p.height, p.seed + i),
                content_type="image/png",
                width=p.width,
                height=p.height,
                seed=p.seed + i,
            )
            for i in range(p.n)
        ]
        if await store.complete(delivery, blobs, stages={"denoise": total * self.step_s}):
            self.finished.append(job.id)

    async def run_forever(self) -> None:
        while True:
            try:
                for d in await self.store.claim([m.id for m in self.models], self.name, self.max_jobs, 50):
                    await self.run_one(d)
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis away: retry like a real worker would
                await asyncio.sleep(0.05)

    def start(self) -> None:
        self.task = asyncio.create_task(self.run_forever())

    async def stop(self) -> None:
        if self.task:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass


@asynccontextmanager
async def api_client(settings: Settings) -> AsyncIterator[tuple[httpx.AsyncClient, Store]]:
    """The app over ASGI with its lifespan, and the store it uses; drops the prefix's keys afterwards."""
    store = Store(settings)
    app = create_app(settings, store)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                yield client, store
    finally:
        try:
            await drop_keys(store)
        finally:
            await store.close()


@pytest.fixture
async def api(make_settings):
    """(client, store, worker): the API, its store, and a registered ready fake worker that is not yet running
    (call `worker.start()`)."""
    async with api_client(make_settings()) as (client, store):
        worker = FakeWorker(store)
        await worker.register()
        yield client, store, worker
        await worker.stop()


@pytest.fixture
async def toy_and_flux(make_settings):
    """(client, store): the API with one ready pool serving the SDXL-like `toy` and the Flux-like `toy-flux`."""
    async with api_client(make_settings()) as (client, store):
        await FakeWorker(store, name="mixed", models=(TOY, TOY_FLUX)).register()
        yield client, store

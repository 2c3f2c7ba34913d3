"""A pool: a slice of the process's devices, the mesh over them, the runners of the models it serves, and its
job loop. Several pools in one process each have their own thread (model calls) and their own asyncio task
(the Redis side), so two pools on disjoint device slices compute side by side.

Life: `start` loads and warms up every model on the pool thread, then registers the pool as ready in the
registry (`/v1/models` and `/readyz` read it); `run` is the job loop plus a registry heartbeat; `request_stop`
starts draining; `close` unregisters and frees the devices.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

from redis.exceptions import RedisError

from meshserve.service.contract import PoolInfo
from meshserve.service.settings import Settings
from meshserve.service.store import Store
from meshserve.workers import metrics
from meshserve.workers.config import ModelSpec, PoolConfig
from meshserve.workers.job_loop import JobLoop
from meshserve.workers.runner import Runner, make_runner
from meshserve.workers.threads import PoolThread

log = logging.getLogger(__name__)


def pool_devices(cfg: PoolConfig) -> list:
    """The pool's jax devices, checked against what this process has."""
    import jax

    available = jax.devices()
    missing = [i for i in cfg.device_ids if i >= len(available)]
    if missing:
        raise ValueError(
            f"pool {cfg.name!r}: devices {missing} do not exist; this process has {len(available)} "
            f"({available[0].platform}). On CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N."
        )
    return [available[i] for i in cfg.device_ids]


class Pool:
    def __init__(
        self,
        cfg: PoolConfig,
        models: dict[str, ModelSpec],
        store: Store,
        settings: Settings,
        worker_name: str,
    ):
        self.cfg, self.specs, self.store, self.settings = (
            cfg,
            {m: models[m] for m in cfg.models},
            store,
            settings,
        )
        self.name = cfg.name
        # One consumer per pool: the stream's pending list then says which pool holds which job. It is also the
        # registry name: replicas started from one config (compose --scale) share pool names, not consumers.
        self.consumer = f"{worker_name}/{cfg.name}"
        self.thread = PoolThread(cfg.name)
        self.runners: dict[str, Runner] = {}
        self.info: PoolInfo | None = None
        self.loop: JobLoop | None = None

    # -- start -----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load and warm up every model (on the pool thread), then register as ready."""
        await self.thread.submit(self._load_all)
        self.info = PoolInfo(
            name=self.consumer,
            models=[r.info() for r in self.runners.values()],
            buckets=list(self.cfg.buckets),
            mesh=self.cfg.mesh.as_dict(),
            max_batch=self.cfg.max_batch,
            ready=True,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        await self.store.register_pool(self.info)
        metrics.POOL_READY.labels(self.name).set(1)
        metrics.POOL_BUSY.labels(self.name).set(0)
        self.loop = JobLoop(
            pool=self.name,
            consumer=self.consumer,
            runners=self.runners,
            store=self.store,
            settings=self.settings,
            thread=self.thread,
            max_batch=self.cfg.max_batch,
            batch_wait_ms=self.cfg.batch_wait_ms,
        )
        log.info(
            "pool %s ready: models %s on devices %s, mesh %s",
            self.name,
            list(self.runners),
            self.cfg.device_ids,
            self.cfg.mesh.as_dict(),
        )

    def _options(self, spec) -> dict:
        """The model's runner options, plus the pool's attention settings for pipeline runners."""
        attention = self.cfg.attention.model_dump(exclude_none=True)
        if spec.runner == "pipeline" and attention:
            return {**spec.options, "attention": attention}
        return dict(spec.options)

    def _load_all(self) -> None:
        # A single-device pool on device 0 with no mesh runs unplaced: the pipeline's plain single-device path.
        trivial = self.cfg.device_ids == [0] and self.cfg.mesh.size == 1
        needs_devices = any(spec.runner == "pipeline" for spec in self.specs.values()) and not trivial
        devices = pool_devices(self.cfg) if needs_devices else None
        mesh = None if trivial else self.cfg.mesh.as_dict()
        for name, spec in self.specs.items():
            runner = make_runner(
                name,
                spec.runner,
                path=spec.path,
                dtype=spec.dtype,
                mesh=mesh,
                devices=devices,
                options=self._options(spec),
            )
            runner.load()
            before = runner.compilations
            seconds = runner.warm_up(self.cfg.buckets, self.cfg.warm_up_batch_sizes, self.cfg.warm_up_steps)
            compiled = runner.compilations - before
            if compiled:
                metrics.COMPILATIONS.labels(name, "warmup").inc(compiled)
                metrics.COMPILE_SECONDS.labels(name, self.name).observe(seconds)
            log.info("pool %s: %s loaded, warm-up %.1f s (%d programs)", self.name, name, seconds, compiled)
            self.runners[name] = runner

    # -- run -------------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """The job loop until `request_stop`, with the registry heartbeat beside it."""
        assert self.loop is not None, "start() first"
        beat = asyncio.create_task(self._registry_heartbeat(), name=f"{self.name}-registry")
        try:
            await self.loop.run()
        finally:
            beat.cancel()

    async def _registry_heartbeat(self) -> None:
        interval = min(self.settings.pool_stale_s / 3, 5.0)
        while True:
            await asyncio.sleep(interval)
            try:
                if not await self.store.heartbeat_pool(self.consumer):
                    await self.store.register_pool(
                        self.info
                    )  # Redis lost the registry (restart): announce again
            except RedisError as e:
                log.warning("pool %s: registry heartbeat failed: %s", self.name, e)

    def request_stop(self, drain_seconds: float) -> None:
        if self.loop is not None:
            self.loop.request_stop(drain_seconds)

    # -- close -----------------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Leave the registry and free the devices (runners shut down on the pool thread)."""
        metrics.POOL_READY.labels(self.name).set(0)
        try:
            await self.store.unregister_pool(self.consumer)
        except RedisError as e:
            log.warning("pool %s: could not unregister: %s", self.name, e)
        runners = list(self.runners.values())
        self.runners.clear()
        if runners:
            try:
                await asyncio.wait_for(
                    self.thread.submit(lambda: [r.shutdown() for r in runners]), timeout=5.0
                )
            except TimeoutError:
                log.warning("pool %s: runner still busy at exit; leaving it to the process exit", self.name)
        self.thread.close()

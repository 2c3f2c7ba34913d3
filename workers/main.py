"""`meshserve worker --config pools.yaml`: one process, one asyncio loop, one Store, the pools of the config.

    run_worker(config_path)   # blocks until SIGTERM / SIGINT, then drains and exits

On SIGTERM every pool stops claiming, finishes or releases its batch (within the config's `drain_seconds`),
gives back claimed leftovers and leaves the registry; a second signal only repeats the request (the process
manager's SIGKILL is the hard stop, and the leases make that safe too).

A multi-host worker (`--coordinator/--num-processes/--process-id`, the MESHSERVE_* equivalents, a
LeaderWorkerSet or a Cloud TPU slice: workers/multihost.py) joins its process group first; its config has one
pool on `devices: all`. Process 0 runs the pool as here; the others load the same models and follow it. A
member that stops because of the group exits with EXIT_GROUP_FAILED (3) or EXIT_LEADER_SILENT (4).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys

from meshserve.service.settings import Settings, get_settings
from meshserve.service.store import Store
from meshserve.workers import metrics
from meshserve.workers.config import WorkerConfig, load_config
from meshserve.workers.multihost import (
    EXIT_GROUP_FAILED,
    Group,
    GroupFailed,
    GroupSpec,
    GroupTiming,
    check_same_pool,
    follow,
    group_from_environment,
    initialize_group,
)
from meshserve.workers.pool import Pool, load_runners

log = logging.getLogger(__name__)


class Worker:
    """The pools of one config, sharing one Store (one Redis connection pool) and one event loop."""

    def __init__(self, config: WorkerConfig, settings: Settings | None = None, group: Group | None = None):
        settings = settings or get_settings()
        if config.redis_url:
            settings = settings.model_copy(update={"redis_url": config.redis_url})
        if config.lora_root:
            settings = settings.model_copy(update={"lora_root": config.lora_root})
        self.config, self.settings, self.group = config, settings, group  # group: this process leads it
        self.name = config.name or f"{socket.gethostname()}-{os.getpid()}"
        self._stop = asyncio.Event()
        self.pools: list[Pool] = []
        self.ready = asyncio.Event()  # set once every pool is registered as ready (tests, `serve`)

    def stop(self) -> None:
        """Begin a graceful stop (safe to call from a signal handler on the loop, more than once)."""
        if not self._stop.is_set():
            log.info("worker %s: stopping (drain up to %.0f s)", self.name, self.config.drain_seconds)
        self._stop.set()
        for pool in self.pools:
            pool.request_stop(self.config.drain_seconds)

    async def run(self) -> None:
        _ensure_host_devices(max(d for p in self.config.pools for d in p.device_ids) + 1)
        if any(p.weights.shard_over for p in self.config.pools):
            _prefer_memory_minimizing_cpu_scheduler()
        from meshserve.models.engine.compile_cache import enable_compilation_cache

        # The config's folder, else meshserve's default cache: a restarted worker reads its programs back.
        enable_compilation_cache(self.config.compilation_cache_dir)
        store = Store(self.settings)
        self.pools = [
            Pool(p, self.config.models, store, self.settings, self.name, group=self.group)
            for p in self.config.pools
        ]
        tasks: list[asyncio.Task] = []
        try:
            # Pools load and compile concurrently, each on its own thread.
            starting = [asyncio.create_task(p.start(), name=f"{p.name}-start") for p in self.pools]
            stop_wait = asyncio.create_task(self._stop.wait())
            await asyncio.wait([*starting, stop_wait], return_when=asyncio.FIRST_COMPLETED)
            if self._stop.is_set():
                for t in starting:
                    t.cancel()
                await asyncio.gather(*starting, return_exceptions=True)
                return
            await asyncio.gather(*starting)  # a load error ends the worker with that error
            stop_wait.cancel()
            self.ready.set()
            if self._stop.is_set():
                return
            tasks = [asyncio.create_task(p.run(), name=f"{p.name}-loop") for p in self.pools]
            stopper = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
            self.stop()  # a pool loop that ended by itself (an error) stops the others too
            results = await asyncio.gather(*tasks, return_exceptions=True)
            stopper.cancel()
            for pool, result in zip(self.pools, results, strict=True):
                if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                    log.error("pool %s ended with an error", pool.name, exc_info=result)
                    raise result
        finally:
            for t in tasks:
                t.cancel()
            for pool in self.pools:
                await pool.close()
            await store.close()
            log.info("worker %s: stopped", self.name)


# XLA:CPU flags go in XLA_FLAGS before JAX is imported (XLA reads it once), and only where JAX will run on the
# CPU: JAX_PLATFORMS' first entry is "cpu", or it is unset and no accelerator plugin is installed
# (models/cpu/xla_cpu_flags.py: cpu_is_the_platform, decided without importing JAX). A GPU or TPU host gets none.


def _cpu_flags_apply() -> bool:
    from meshserve.models.cpu.xla_cpu_flags import cpu_is_the_platform  # JAX-free; only when a pool starts

    return "jax" not in sys.modules and cpu_is_the_platform()


def _ensure_host_devices(count: int) -> None:
    """Pools on CPU need as many host devices as the config names; XLA makes one unless told otherwise."""
    flags = os.environ.get("XLA_FLAGS", "")
    if count > 1 and "xla_force_host_platform_device_count" not in flags and _cpu_flags_apply():
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


# XLA:CPU's default scheduler puts all of a step's FSDP weight gathers together, so a pool that stores its
# weights split still holds them all gathered at once: SDXL-base at 1024 px, 2-way, peaked at 14,423 MiB per
# device (replicated: 13,756); with this scheduler 3,766 MiB (docs/weights.md, bench/weight_memory.py). Only the
# process-wide flag takes effect (a per-compilation compiler option was accepted and ignored). CPU only: GPU and
# TPU have schedulers of their own.
_CPU_MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _prefer_memory_minimizing_cpu_scheduler() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_enable_concurrency_optimized_scheduler" not in flags and _cpu_flags_apply():
        os.environ["XLA_FLAGS"] = f"{flags} {_CPU_MEMORY_SCHEDULER}".strip()


def install_signal_handlers(loop: asyncio.AbstractEventLoop, stop) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)


def run_worker(
    config_path: str,
    *,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """Run the pools of `config_path` until SIGTERM/SIGINT (the `meshserve worker` command). With a process
    group (the arguments, else the environment: multihost.group_from_environment) this process joins it first."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(config_path)
    spec = group_from_environment(coordinator, num_processes, process_id)
    if spec is None:
        try:
            asyncio.run(_main(config))
        except Exception:
            # A pool that failed to start leaves the others' threads loading or compiling: ending through the
            # interpreter's finalization with a daemon thread inside XLA aborted the process (C++ terminate).
            log.exception("worker: ends with an error; exiting with 1")
            logging.shutdown()
            os._exit(1)
        return
    timing = GroupTiming.from_environment()
    check_group_config(config, spec)
    _ensure_host_devices(config.pools[0].mesh.size // spec.num_processes if spec.num_processes else 1)
    if config.pools[0].weights.shard_over:
        _prefer_memory_minimizing_cpu_scheduler()
    initialize_group(spec, heartbeat_timeout_s=timing.heartbeat_s)
    import jax

    group = Group(leader=jax.process_index() == 0, timing=timing)
    try:
        pool = config.pools[0]
        check_same_pool(
            {"pool": pool.model_dump(), "models": {m: config.models[m].model_dump() for m in pool.models}}
        )
        if group.leader:
            asyncio.run(_main(config, group))
        else:
            _follow(config, group)
    except Exception as e:
        # Past JAX's exit handler: its shutdown barrier would wait (shutdown_timeout) for a member that is gone.
        code = EXIT_GROUP_FAILED if isinstance(e, GroupFailed) else 1
        log.error("worker: process %d of the group ends: %r; exiting with %d", jax.process_index(), e, code)
        logging.shutdown()
        os._exit(code)


def check_group_config(config: WorkerConfig, spec: GroupSpec) -> None:
    """A process group serves one pool over all its devices: the followers mirror that pool's programs."""
    if len(config.pools) != 1 or config.pools[0].devices != "all":
        raise ValueError(
            f"a multi-host worker ({spec.source}: {spec.num_processes or 'auto'} processes) needs exactly one pool "
            f"with `devices: all`; the config has {[(p.name, p.devices) for p in config.pools]}"
        )
    size = config.pools[0].mesh.size
    if spec.num_processes and size % spec.num_processes:
        raise ValueError(
            f"pool {config.pools[0].name!r}: mesh {config.pools[0].mesh.as_dict()} ({size} devices) does not "
            f"split over {spec.num_processes} processes"
        )


def _follow(config: WorkerConfig, group: Group) -> None:
    """A follower: load and warm up the pool's models exactly as the leader does, then run what it sends."""
    from meshserve.models.engine.compile_cache import enable_compilation_cache

    enable_compilation_cache(config.compilation_cache_dir)
    (pool,) = config.pools
    try:
        settings = get_settings()
        runners, _ = load_runners(
            pool,
            {m: config.models[m] for m in pool.models},
            lora_root=config.lora_root or settings.lora_root,
            lora_allow_hub=settings.lora_allow_hub,
        )
    except Exception as e:  # the leader's load runs the same programs: its collectives fail, not hang
        raise GroupFailed(f"follower could not load pool {pool.name!r}: {e!r}") from e
    log.info("follower of pool %s: ready, waiting for the leader's batches", pool.name)
    follow(group, runners)


async def _main(config: WorkerConfig, group: Group | None = None) -> None:
    worker = Worker(config, group=group)
    install_signal_handlers(asyncio.get_running_loop(), worker.stop)
    metrics.set_build_info()
    if config.metrics_port is not None:
        try:
            port = metrics.serve_metrics(config.metrics_port)
        except OSError as e:  # before any pool starts: the worker ends at once, saying why
            raise RuntimeError(
                f"cannot serve /metrics on port {config.metrics_port}: {e.strerror} (a worker still draining "
                "there? another process?); set `metrics_port` to a free port, or 0 for any"
            ) from None
        log.info("worker %s: /metrics on port %d", worker.name, port)
    await worker.run()

"""A pool: a slice of the process's devices, the mesh over them, the runners of the models it serves, and its
job loop. Several pools in one process each have their own thread (model calls) and their own asyncio task
(the Redis side), so two pools on disjoint device slices compute side by side.

Life: `start` loads and warms up every model on the pool thread, then registers the pool as ready in the
registry (`/v1/models` and `/readyz` read it), each model's limits listing the pool's buckets as the only sizes
(and, for video, its frame counts as the only ones) it serves (`served_info`), so the API admits no shape that
would compile on the request path, and starts its registry heartbeat; `run` is the job loop; `request_stop`
starts draining; `close` stops the heartbeat, unregisters and frees the devices.

A multi-host pool (`devices: all` over a process group, workers/multihost.py) is a Pool in its leader process
with `group` set: its runners send each batch to the followers first, and `run` pings them between batches.
The followers run `load_runners` and `multihost.follow`, no Pool.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import time

from redis.exceptions import RedisError

from meshserve.limits import LimitError, check_request
from meshserve.service.contract import LoraSpec, ModelInfo, PoolInfo
from meshserve.service.lora_requests import LoraRequests
from meshserve.service.settings import Settings
from meshserve.service.store import Store
from meshserve.workers import metrics
from meshserve.workers.adapters import Adapters
from meshserve.workers.config import ModelSpec, PoolConfig
from meshserve.workers.job_loop import JobLoop
from meshserve.workers.multihost import Group, GroupFailed, LeaderRunner
from meshserve.workers.runner import Runner, make_runner
from meshserve.workers.threads import PoolThread

log = logging.getLogger(__name__)


def served_info(info: ModelInfo, cfg: PoolConfig) -> ModelInfo:
    """The model as this pool serves it: its limits list the pool's buckets as the only sizes (no buckets: the
    model's default size), or None with `any_size`. A default size the pool does not serve becomes its first
    bucket, so a request that names no size is admitted. A video model's frame limits list the pool's `frames`
    as the only frame counts (`served`; none given: the default count), the default moved the same way.
    Raises ValueError for a bucket or a frame count the model cannot run."""
    lim, d = info.limits, info.defaults
    # The one limits check the API and the pipelines run too (meshserve/limits.py).
    for width, height in cfg.buckets:
        try:
            check_request(lim, {"width": width, "height": height}, model=info.id)
        except LimitError as e:
            raise ValueError(
                f"pool {cfg.name!r}: bucket {width}x{height} is not a size {info.id} can run ({e})"
            ) from None
    for n in cfg.frames:
        try:
            check_request(lim, {"num_frames": n}, model=info.id)
        except LimitError as e:
            raise ValueError(
                f"pool {cfg.name!r}: {n} frames is not a frame count {info.id} can run ({e})"
            ) from None
    fr = lim.frames
    if cfg.any_size:
        return info
    buckets = list(cfg.buckets) or [(d.width, d.height)]
    defaults = d
    if (d.width, d.height) not in buckets:
        defaults = d.model_copy(update={"width": buckets[0][0], "height": buckets[0][1]})
    update = {"buckets": buckets}
    if fr is not None:  # the frame counts served, the default among them (else the first becomes the default)
        frames = list(cfg.frames) or [fr.default]
        default = fr.default if fr.default in frames else frames[0]
        update["frames"] = fr.model_copy(update={"served": frames, "default": default})
    limits = lim.model_copy(update=update)
    return info.model_copy(update={"defaults": defaults, "limits": limits})


def pool_devices(cfg: PoolConfig) -> list:
    """The pool's jax devices, checked against what this process has (`devices: all`: every device of the
    process group, which is this process's alone without jax.distributed)."""
    import jax

    available = jax.devices()
    if cfg.devices == "all":
        if len(available) != cfg.mesh.size:
            raise ValueError(
                f"pool {cfg.name!r}: devices: all gives {len(available)} devices "
                f"({jax.process_count()} processes x {jax.local_device_count()}), but the mesh "
                f"{cfg.mesh.as_dict()} needs {cfg.mesh.size}"
            )
        return list(available)
    missing = [i for i in cfg.device_ids if i >= len(available)]
    if missing:
        raise ValueError(
            f"pool {cfg.name!r}: devices {missing} do not exist; this process has {len(available)} "
            f"({available[0].platform}). On CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N."
        )
    return [available[i] for i in cfg.device_ids]


def runner_options(cfg: PoolConfig, spec: ModelSpec) -> dict:
    """The model's runner options, plus the pool's attention settings for pipeline runners and, for an
    any_size pool, `max_programs` (load_pipeline's bound on the compiled programs it keeps); `weights`
    (shard_over) when the pool stores its weights split; `quantize` when the pool quantizes them; the pool's
    `vae_dtype` unless the model's options set one; `scan_blocks` when the pool unrolls them;
    `xla_options` when the pool sets any."""
    options = dict(spec.options)
    attention = cfg.attention.model_dump(exclude_none=True)
    if spec.runner == "pipeline" and attention:
        options["attention"] = attention
    if spec.runner == "pipeline" and cfg.weights.shard_over:
        options["weights"] = cfg.weights.model_dump()
    if spec.runner == "pipeline" and cfg.quantize != "none":
        options["quantize"] = cfg.quantize
    if spec.runner == "pipeline" and cfg.vae_dtype is not None:  # a model's own option is the more specific
        options.setdefault("vae_dtype", cfg.vae_dtype)
    if spec.runner == "pipeline" and not cfg.scan_blocks:
        options["scan_blocks"] = False
    if spec.runner == "pipeline" and cfg.xla_options:
        options["xla_options"] = dict(cfg.xla_options)
    if spec.runner == "pipeline":  # the pool's LoRA table (docs/lora.md)
        options.update(cfg.lora_options())
    if cfg.any_size:
        options["max_programs"] = cfg.max_programs
    return options


def load_runners(
    cfg: PoolConfig,
    specs: dict[str, ModelSpec],
    *,
    lora_root: str | None = None,
    lora_allow_hub: bool = True,
) -> tuple[dict[str, Runner], dict[str, ModelInfo]]:
    """Load and warm up every model of the pool, in the config's order: (runners, models as served here).
    A model's pools.yaml LoRA adapters are loaded before its warm-up (under `lora_root`, or Hub ids); one that
    cannot be stops the pool at start, as a bucket the model cannot run does.

    Every process of a multi-host pool calls this with the same config, so all of them load the same weights
    and compile and run the same warm-up programs in the same order (each is one program over the group)."""
    # A single-device pool on device 0 with no mesh runs unplaced: the pipeline's plain single-device path.
    trivial = cfg.device_ids == [0] and cfg.mesh.size == 1
    needs_devices = any(spec.runner == "pipeline" for spec in specs.values()) and not trivial
    devices = pool_devices(cfg) if needs_devices else None
    mesh = None if trivial else cfg.mesh.as_dict()
    runners, models = {}, {}
    for name, spec in specs.items():
        runner = make_runner(
            name,
            spec.runner,
            path=spec.path,
            dtype=spec.dtype,
            mesh=mesh,
            devices=devices,
            options=runner_options(cfg, spec),
        )
        runner.max_rows = cfg.max_batch  # a job with more images runs in parts (runner.row_parts)
        runner.load()
        adapters = _declared_adapters(cfg, name, spec, runner, lora_root, lora_allow_hub)
        if cfg.prompt_cache_mb:  # before the warm-up, which compiles the cache's programs too
            runner.keep_prompt_cache(int(cfg.prompt_cache_mb * 2**20))
        info = served_info(runner.info(), cfg)
        if adapters is not None:
            info = info.model_copy(update={"adapters": adapters.published()})
        # Warm up exactly the sizes published as served (any_size: the configured buckets, if any).
        buckets = info.limits.buckets or list(cfg.buckets)
        frames = (info.limits.frames.served or list(cfg.frames)) if info.limits.frames else []
        before, t0 = runner.compilations, time.perf_counter()
        # `frames` only for a video model: an image model's runner need not take the argument.
        extra = {"frames": frames} if frames else {}
        # Image tasks too: only then (and "all" only for a model with several), so that a runner without
        # image inputs need not take the argument.
        if cfg.warm_up_tasks == "all":
            if len(info.limits.tasks) > 1:
                extra["tasks"] = list(info.limits.tasks)
        elif cfg.warm_up_tasks:
            unknown = sorted(set(cfg.warm_up_tasks) - set(info.limits.tasks))
            if unknown:
                raise ValueError(
                    f"pool {cfg.name!r}: warm_up_tasks {unknown} are not tasks of {name} ({info.limits.tasks})"
                )
            # A list adds to the text task every such pool serves: in its place (an audit's [image-to-image])
            # it left text jobs compiling their programs on the request path, 33-45 s each on 2 CPU cores.
            base = [info.task] if info.task in info.limits.tasks else []
            extra["tasks"] = list(dict.fromkeys([*base, *cfg.warm_up_tasks]))
        if cfg.warm_up_cache:  # (only then: a runner without a step cache need not take it)
            if not info.limits.cache:
                raise ValueError(f"pool {cfg.name!r}: warm_up_cache, but {name} has no step cache")
            extra["cache"] = True
        if cfg.warm_up_schedulers:
            offered = list(info.limits.schedulers)
            wanted = offered if cfg.warm_up_schedulers == "all" else list(cfg.warm_up_schedulers)
            unknown = sorted(set(wanted) - set(offered))
            if unknown:
                raise ValueError(
                    f"pool {cfg.name!r}: warm_up_schedulers {unknown} are not schedulers of {name} ({offered})"
                )
            extra["schedulers"] = wanted
        seconds = runner.warm_up(buckets, cfg.batch_sizes(), cfg.warm_up_steps, **extra)
        compiled = runner.compilations - before
        if compiled:
            metrics.COMPILATIONS.labels(cfg.name, "warmup").inc(compiled)
            metrics.COMPILE_SECONDS.labels(name, cfg.name).observe(seconds)
        log.info(
            "pool %s: %s loaded; warm-up compiled %d programs for sizes %s%s, batch sizes %s in %.1f s",
            cfg.name,
            name,
            compiled,
            ", ".join(f"{w}x{h}" for w, h in buckets) or "(the runner's default)",
            f", frames {frames}" if frames else "",
            cfg.batch_sizes(),
            time.perf_counter() - t0,
        )
        if adapters is not None and not adapters.published():
            # No adapter at start: the LoRA programs compile when the first one is added at run time (POST
            # /v1/loras), before it is published, so that no job naming an adapter compiles them.
            adapters.warm_up_loras = functools.partial(
                _compile_lora_programs, cfg, name, runner, buckets, extra
            )
        runners[name], models[name] = runner, info
    return runners, models


def _compile_lora_programs(cfg: PoolConfig, name: str, runner: Runner, buckets, extra: dict) -> None:
    """The pool's warm-up once more, now that an adapter is registered: its LoRA programs compile (those
    compiled already run one step), counted as warm-up compilations."""
    before, t0 = runner.compilations, time.perf_counter()
    runner.warm_up(buckets, cfg.batch_sizes(), cfg.warm_up_steps, **extra)
    compiled = runner.compilations - before
    if compiled:
        metrics.COMPILATIONS.labels(cfg.name, "warmup").inc(compiled)
    elapsed = time.perf_counter() - t0
    log.info(
        "pool %s: %s's first LoRA adapter: compiled %d programs in %.1f s", cfg.name, name, compiled, elapsed
    )


def _declared_adapters(
    cfg: PoolConfig, name: str, spec: ModelSpec, runner: Runner, root: str | None, allow_hub: bool
) -> Adapters | None:
    """The model's adapter bookkeeping with its pools.yaml adapters loaded (None: a runner without LoRA)."""
    if not runner.takes_loras:
        if spec.loras:
            raise ValueError(f"pool {cfg.name!r}: {name}'s runner takes no LoRA adapters; remove its `loras`")
        return None
    runner.adapters = Adapters(runner, model=name, root=root, allow_hub=allow_hub)
    for lora, declared in spec.loras.items():
        entry = runner.adapters.add(lora, declared, origin="config")
        if entry.error is not None:
            raise ValueError(f"pool {cfg.name!r}: {name}'s LoRA {lora!r} ({declared.source}): {entry.error}")
    return runner.adapters


class Pool:
    def __init__(
        self,
        cfg: PoolConfig,
        models: dict[str, ModelSpec],
        store: Store,
        settings: Settings,
        worker_name: str,
        group: Group | None = None,
    ):
        # A multi-host pool's channel to its followers (this process leads); None: a one-process pool.
        self.group = group
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
        self.models: dict[str, ModelInfo] = {}  # as served here (served_info), filled by _load_all
        self.info: PoolInfo | None = None
        self.loop: JobLoop | None = None
        self._beat: asyncio.Task | None = None
        self._loras: asyncio.Task | None = None
        # Held while the registry entry is rewritten (heartbeat, adapters): a heartbeat reads, changes and
        # writes the entry, and must not write back one read before the adapters changed.
        self._registry_lock = asyncio.Lock()

    # -- start -----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load and warm up every model (on the pool thread), then register as ready."""
        await self.thread.submit(self._load_all)
        if self.group is not None:  # each batch goes to the followers first
            self.runners = {name: LeaderRunner(r, self.group) for name, r in self.runners.items()}
        self.info = PoolInfo(
            name=self.consumer,
            models=list(self.models.values()),
            buckets=sorted({b for m in self.models.values() for b in m.limits.buckets or self.cfg.buckets}),
            mesh=self.cfg.mesh.as_dict(),
            max_batch=self.cfg.max_batch,
            ready=True,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        try:
            await self.store.register_pool(self.info)
        except RedisError as e:
            # Not fatal: the loaded, warmed-up models are worth keeping (minutes for a real one), and the
            # heartbeat below registers the pool as soon as Redis answers (as after a Redis restart).
            log.warning(
                "pool %s: ready, but not registered yet (%s); retrying with the heartbeat", self.name, e
            )
        # The heartbeat starts with the registration, not with `run`: the worker runs its pools only once all
        # are ready, and a pool that warmed up pool_stale_s before the slowest one would otherwise drop out of
        # /v1/models meanwhile (seen with a Flux pool beside an SDXL pool on the loaded 2-core machine).
        self._beat = asyncio.create_task(self._registry_heartbeat(), name=f"{self.name}-registry")
        # Adapters added or removed at run time (POST/DELETE /v1/loras): one-process pools only (a multi-host
        # pool's followers would have to load them in step; they keep their pools.yaml adapters).
        if self.group is None and any(r.adapters is not None for r in self.runners.values()):
            self._loras = asyncio.create_task(self._watch_loras(), name=f"{self.name}-loras")
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

    def _load_all(self) -> None:
        self.runners, self.models = load_runners(
            self.cfg,
            self.specs,
            lora_root=self.settings.lora_root,
            lora_allow_hub=self.settings.lora_allow_hub,
        )

    # -- run -------------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """The job loop until `request_stop` (the registry heartbeat runs from `start` to `close`)."""
        assert self.loop is not None, "start() first"
        ping = asyncio.create_task(self._ping_followers(), name=f"{self.name}-group") if self.group else None
        loop = None
        try:
            if ping is None:
                await self.loop.run()
                return
            loop = asyncio.create_task(self.loop.run(), name=f"{self.name}-jobs")
            await asyncio.wait([loop, ping], return_when=asyncio.FIRST_COMPLETED)
            if not loop.done():  # the group failed while idle: take no more jobs, give back the claimed ones
                self.loop.request_stop(0.0)
            await loop
            if self.group.failed is not None:
                raise GroupFailed(f"pool {self.name}: its process group failed: {self.group.failed}")
        finally:
            for task in (ping, loop):
                if task is not None:
                    task.cancel()

    async def _ping_followers(self) -> None:
        """Between batches, tell the followers every `timing.ping_s` that the leader is alive (their watchdog
        exits when it hears nothing); a failed ping is a failed group. On the pool thread, so a ping never
        runs beside a batch's collectives."""
        while True:
            await asyncio.sleep(self.group.timing.ping_s)
            try:
                await self.thread.submit(self.group.ping)
            except GroupFailed:
                return

    async def _registry_heartbeat(self) -> None:
        interval = min(self.settings.pool_stale_s / 3, 5.0)
        while True:
            await asyncio.sleep(interval)
            try:
                async with self._registry_lock:
                    if not await self.store.heartbeat_pool(self.consumer):
                        # Redis lost the registry (restart): announce again
                        await self.store.register_pool(self.info)
            except RedisError as e:
                log.warning("pool %s: registry heartbeat failed: %s", self.name, e)

    async def _watch_loras(self) -> None:
        """Every `lora_poll_s`, read each model's run-time adapters (service/lora_requests.py) and apply what
        changed on the pool thread, after the batch running now (the thread runs one call at a time), then
        publish the outcome in the registry entry, where the API reads it."""
        wanted = LoraRequests(self.store)
        failing = False
        while True:
            await asyncio.sleep(self.settings.lora_poll_s)
            try:
                for model, runner in self.runners.items():
                    if runner.adapters is None:
                        continue
                    target = await wanted.get(model)
                    current = runner.adapters.by_origin("api")
                    if target != current:
                        # Files first, beside the jobs: a Hub download of tens of seconds held every batch when
                        # it ran on the pool thread. Then the device part there, between batches.
                        changed = {n: s.source for n, s in target.items() if current.get(n) != s}
                        fetched = await asyncio.to_thread(_fetch_loras, runner.adapters, changed)
                        await self.thread.submit(_apply_loras, runner.adapters, target, fetched)
                        await self._publish_adapters(model, runner.adapters)
                failing = False
            except RedisError as e:
                if not failing:
                    log.warning("pool %s: reading LoRA changes failed (%s); retrying", self.name, e)
                failing = True
            except Exception:  # never let the watcher die silently: the next poll tries again
                log.exception("pool %s: applying LoRA changes failed", self.name)

    async def _publish_adapters(self, model: str, adapters: Adapters) -> None:
        self.models[model] = self.models[model].model_copy(update={"adapters": adapters.published()})
        self.info = self.info.model_copy(update={"models": list(self.models.values())})
        async with self._registry_lock:
            await self.store.register_pool(self.info)

    def request_stop(self, drain_seconds: float) -> None:
        if self.loop is not None:
            self.loop.request_stop(drain_seconds)

    # -- close -----------------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Leave the registry and free the devices (runners shut down on the pool thread)."""
        metrics.POOL_READY.labels(self.name).set(0)
        for task in (self._beat, self._loras):
            if task is not None:
                task.cancel()
        try:
            await self.store.unregister_pool(self.consumer)
        except RedisError as e:
            log.warning("pool %s: could not unregister: %s", self.name, e)
        if self.group is not None and self.group.failed is None and self.runners:
            try:  # a clean stop: the followers exit 0 with the leader
                await asyncio.wait_for(self.thread.submit(self.group.stop_followers), timeout=10.0)
            except (TimeoutError, GroupFailed) as e:
                log.warning("pool %s: could not stop the followers: %r", self.name, e)
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


def _fetch_loras(adapters: Adapters, sources: dict[str, str]) -> dict:
    """Each source's file (name -> `Adapters.fetch`'s answer); off the pool thread."""
    return {name: adapters.fetch(source) for name, source in sources.items()}


def _apply_loras(adapters: Adapters, target: dict[str, LoraSpec], fetched: dict) -> None:
    """Make a model's run-time adapters those of `target` (name -> spec), their files `fetched` (name ->
    `Adapters.fetch`'s answer); on the pool thread. A name that pools.yaml declares is never replaced from the
    API (the API refuses it; this is the pool's own guard)."""
    current, declared = adapters.by_origin("api"), adapters.by_origin("config")
    for name in current.keys() - target.keys():
        adapters.remove(name)
    for name, spec in target.items():
        if current.get(name) != spec and name not in declared:
            adapters.add(name, spec, origin="api", fetched=fetched.get(name))

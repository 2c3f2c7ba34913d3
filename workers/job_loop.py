"""One pool's job loop: claim -> batch -> start -> run (progress, cancel, lease heartbeat) -> complete | fail.

Delivery is at least once (service/store.py): a job is acknowledged only by `complete` / `fail` /
`mark_canceled`, all fenced by the delivery's attempt number. What this loop decides:

- Claimed jobs it holds (running or waiting as batch leftovers) keep their lease alive through a background
  heartbeat every lease/3; a refused heartbeat means another delivery owns the job: it is dropped here.
- The denoise loop never waits on the network. The runner's step callback (on the pool thread, after every
  step) only hands the step over (`_StepHandoff`, no lock held across anything slow) and answers from flags
  kept fresh by the batch's progress task: a task on the event loop that, a few times a second and whenever a new
  step came, reads the jobs' cancel flags and publishes the newest step (older ones are skipped) in one round trip
  (`Store.poll_running`). It ends the canceled jobs at once and drops the fenced ones; the batch stops at the next
  step when no job is left in it. A slow or silent Redis (every command has a deadline: service/redis_client.py)
  delays only progress and cancel, never a step.
- Faults: `InvalidRequest` (the job's own fault) fails the job with no retry. Any other exception in a batch of
  several jobs re-runs them one by one, so one poison job cannot take its neighbours down with it; a single job
  that raises is abandoned - no ack, no heartbeat - so its lease lapses and a later claim (here or in another
  pool) takes it again, until the store dead-letters it after `max_deliveries`. A crash of the whole process
  leaves the same state behind, so both faults end the same way.
- Outputs that cannot be stored (`OutputStoreError` from `complete`: a bucket refusing writes, a full disk) are
  retried for up to one lease while the heartbeat keeps the job; then the job is abandoned for redelivery like a
  crashed one, and on its last delivery it ends failed with code "output_store_error" (whatever it wrote is
  deleted): an output is never lost silently, and a job never succeeds without its outputs.
- A multi-host pool whose process group failed (`GroupFailed`) abandons its batch and stops claiming; the
  worker then exits non-zero so the group restarts (workers/multihost.py).
- Encoding runs off the pool thread: the runner's `generate` ends with uint8 arrays, which go to the loop's
  encoder threads; a finishing task per batch encodes each job, stores its outputs and ends it, while the pool
  thread is already on the next batch (docs/outputs.md). At most `max_encoding` batches wait for or are in
  encoding (so memory stays bounded); past that the next batch waits. A job still ends succeeded only once its
  outputs are stored, and its lease is renewed until then; an encoding error fails that job with code
  "encode_error" (an encoder cannot write what the model made: retrying would fail the same way). A cancel that
  comes while a job is encoded is too late: the job is done computing and succeeds.
- Stop (SIGTERM): no new claims; the running batch may finish within `drain_seconds`, else it is stopped at the
  next step and its jobs are released (requeued without spending a delivery), as are claimed leftovers. Batches
  being encoded finish within the same deadline (plus the grace the pool thread gets); a job whose encoding is
  still running past it is released too: no job is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

from meshserve.service.contract import PRIORITY_ORDER, Delivery, JobParams
from meshserve.service.job_previews import MAX_PREVIEW_CHARS, publish_previews
from meshserve.service.output_store import OutputStoreError
from meshserve.service.settings import Settings
from meshserve.service.store import Store
from meshserve.workers import metrics
from meshserve.workers.batching import BatchKey, gather_batch
from meshserve.workers.multihost import GroupFailed
from meshserve.workers.runner import (
    Cancelled,
    Generated,
    InvalidRequest,
    Runner,
    RunRequest,
    RunResult,
    encode_job,
    read_inputs,
)
from meshserve.workers.threads import EncoderThreads, PoolThread

log = logging.getLogger(__name__)

# While a batch runs its jobs' cancel flags are read at least this often (and at every new step, if steps are
# slower than a round trip): a cancel stops the loop within about this much, plus a round trip, plus a step.
_POLL_S = 0.25
# After a failed round (Redis down or silent: the round took up to its command deadline) the next one waits this.
_RETRY_S = 0.5
# Past the drain deadline, the pool thread's batch and the batches being encoded get this much more.
_GRACE_S = 5.0
# Encoder threads per pool, and batches that may wait for or be in encoding at once. Two threads: an MP4 (PyAV)
# and a PNG (Pillow, compress_level 1) release the GIL, so two jobs encode side by side; two batches bound the
# host memory at two batches' uint8 outputs (an 81-frame 480p video: 97 MB each) beside the one computing.
ENCODE_THREADS = 2
MAX_ENCODING = 2


@dataclass
class Work:
    """A claimed job, as the batcher sees it."""

    delivery: Delivery
    key: BatchKey
    images: int
    priority_rank: float  # the priority (0 high), less one per `priority_aging_s` waited
    runs_alone: bool  # an earlier delivery did not finish (workers/batching.py)

    @classmethod
    def of(
        cls, delivery: Delivery, batch_key: Callable[[JobParams], tuple], priority_aging_s: float = 0.0
    ) -> Work:
        """batch_key: the model's runner's `batch_key` (the fields its pipeline needs equal within a batch);
        priority_aging_s: as the claim that read it (Settings: a job waiting that long counts one priority
        higher), so that an aged low job anchors its batch instead of being given back behind a fresh high one."""
        p: JobParams = delivery.job.params
        key = BatchKey(delivery.job.model, batch_key(p))
        rank = float(PRIORITY_ORDER.index(delivery.job.priority))
        if priority_aging_s > 0:
            rank -= max(0.0, time.time() - delivery.job.created_at) / priority_aging_s
        # A release (drain, give-back) does not count as a delivery: only a lease that lapsed does.
        return cls(delivery, key, p.n, rank, runs_alone=delivery.delivery_count > 1)

    @property
    def job_id(self) -> str:
        return self.delivery.job.id


class _Abandoned(Exception):  # noqa: N818
    """The runner thread did not return within the drain deadline."""


class _StepHandoff:
    """What the pool thread and a batch's progress task share.

    The pool thread (the step callback) writes `latest` - one tuple assignment, atomic - and wakes the task with
    `call_soon_threadsafe`, a write to the event loop's self-pipe that never blocks; it reads `active` (the batch's
    jobs still computed: the event loop removes them) and `closed`. Nothing it does waits on the event loop, on a
    lock held across I/O, or on the network."""

    def __init__(self, loop: asyncio.AbstractEventLoop, active: dict[str, Work]):
        self.loop, self.active = loop, active
        self.latest: tuple[int, int] | None = None  # (step, total) of the newest step, from the pool thread
        self.wake = asyncio.Event()  # set (on the loop) after each step, and by close
        self.closed = False
        self.model = ""
        # Live previews (docs/previews.md): the newest per (job, output) until the task publishes it. The lock
        # guards two dict operations, never anything slow.
        self.previews: dict[tuple[str, int], tuple[int, int, object]] = {}
        self.skipped_previews = 0
        self._previews_lock = threading.Lock()

    def add_preview(self, job_id: str, index: int, step: int, total: int, pixels) -> None:
        """From the pool thread: keep the newest preview of an output (an older unpublished one is skipped)."""
        with self._previews_lock:
            if (job_id, index) in self.previews:
                self.skipped_previews += 1
            self.previews[(job_id, index)] = (step, total, pixels)
        with contextlib.suppress(RuntimeError):  # the loop is closed: the worker exited past its deadline
            self.loop.call_soon_threadsafe(self.wake.set)

    def take_previews(self) -> tuple[dict[tuple[str, int], tuple[int, int, object]], int]:
        with self._previews_lock:
            taken, skipped = self.previews, self.skipped_previews
            self.previews, self.skipped_previews = {}, 0
        return taken, skipped

    def close(self) -> None:
        """The batch is over (on the event loop): the task ends after the round in flight."""
        self.closed = True
        self.wake.set()


class JobLoop:
    def __init__(
        self,
        *,
        pool: str,
        consumer: str,
        runners: dict[str, Runner],
        store: Store,
        settings: Settings,
        thread: PoolThread,
        max_batch: int,
        batch_wait_ms: float,
        idle_block_ms: int = 1000,
        encode_threads: int = ENCODE_THREADS,
        max_encoding: int = MAX_ENCODING,
    ):
        """encode_threads 0: the pool thread encodes and the loop stores the outputs before the next batch (the
        old path, kept for comparison: bench/encode_gap.py)."""
        self.pool, self.consumer, self.runners = pool, consumer, runners
        self.store, self.settings, self.thread = store, settings, thread
        self.max_batch, self.batch_wait_ms, self.idle_block_ms = max_batch, batch_wait_ms, idle_block_ms
        self.models = list(runners)
        self._held: dict[str, Work] = {}  # every claimed, unfinished job: its lease is ours to renew
        self._active: dict[str, Work] = {}  # the jobs of the running batch still being computed
        self._stop_deadline: float | None = None  # monotonic; set by request_stop
        self._last_step = 0.0
        self.encoder = EncoderThreads(pool, encode_threads) if encode_threads > 0 else None
        self._encode_slots = asyncio.Semaphore(max(1, max_encoding))
        self._finishing: set[asyncio.Task] = set()  # one per batch handed to the encoder
        self._encoding: set[str] = set()  # the jobs of those batches

    # -- control ---------------------------------------------------------------------------------------------

    def request_stop(self, drain_seconds: float) -> None:
        """Take no new job; a running batch may go on for `drain_seconds` more."""
        if self._stop_deadline is None:
            self._stop_deadline = time.monotonic() + drain_seconds

    @property
    def stopping(self) -> bool:
        return self._stop_deadline is not None

    def _drain_expired(self) -> bool:
        return self._stop_deadline is not None and time.monotonic() >= self._stop_deadline

    # -- the loop --------------------------------------------------------------------------------------------

    async def run(self) -> None:
        heartbeats = asyncio.create_task(self._heartbeat_loop(), name=f"{self.pool}-leases")
        backoff = 0.1
        try:
            while not self.stopping:
                try:
                    batch, rest = await gather_batch(
                        self._claim,
                        max_batch=self.max_batch,
                        batch_wait_ms=self.batch_wait_ms,
                        idle_block_ms=self.idle_block_ms,
                        stopping=lambda: self.stopping,
                    )
                    backoff = 0.1
                except RedisError as e:
                    log.warning("pool %s: claim failed (%s); retrying in %.1f s", self.pool, e, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                # Claimed but not fitting: back to the queue at once, for any pool (workers/batching.py).
                for w in rest:
                    await self._release(w, "given_back")
                await self._release_strays(batch)
                # A job whose heartbeat was refused meanwhile belongs to another delivery now.
                batch = [w for w in batch if w.job_id in self._held]
                if batch:
                    await self._run_batch(batch)
        finally:
            await self._drain_encoding()  # the leases of jobs being encoded are renewed until they end
            await self._release_strays([])
            heartbeats.cancel()
            if self.encoder is not None:
                self.encoder.close()

    async def _release_strays(self, batch: list[Work]) -> None:
        """Give back every held job that is neither in `batch` nor being encoded. There should be none: such a
        job's lease would be renewed by the heartbeats for as long as the pool lives while nothing runs it, as
        happened to jobs claimed before a failed claim (tests/workers/test_claim_failures.py)."""
        placed = {w.job_id for w in batch} | self._encoding
        for w in [w for job_id, w in self._held.items() if job_id not in placed]:
            log.error("pool %s: job %s was held but not run; giving it back", self.pool, w.job_id)
            await self._release(w, "given_back")

    async def _claim(self, max_jobs: int, block_ms: int) -> list[Work]:
        deliveries = await self.store.claim(self.models, self.consumer, max_jobs=max_jobs, block_ms=block_ms)
        aging = self.settings.priority_aging_s
        works = [Work.of(d, self.runners[d.job.model].batch_key, aging) for d in deliveries]
        for w in works:
            self._held[w.job_id] = w
            if w.delivery.taken_over:
                metrics.RECLAIMED.labels(w.key.model).inc()
        return works

    async def _heartbeat_loop(self) -> None:
        interval = self.settings.lease_s / 3
        delay = interval
        while True:
            await asyncio.sleep(delay)
            delay = interval
            for w in list(self._held.values()):
                try:
                    ok = await self.store.heartbeat(w.delivery)
                except RedisError as e:
                    # Again soon, on a fresh connection (a silent one was dropped at its deadline), not a whole
                    # interval later: two intervals plus a deadline could outlast the lease.
                    log.warning("pool %s: lease heartbeat failed: %s", self.pool, e)
                    delay = min(interval, _RETRY_S)
                    break
                if not ok:
                    self._drop(w)

    # -- one batch -------------------------------------------------------------------------------------------

    async def _run_batch(self, batch: list[Work]) -> None:
        model = batch[0].key.model
        started = []
        for w in batch:
            if await self._call(lambda w=w: self.store.start(w.delivery, self.consumer)):
                started.append(w)
                metrics.QUEUE_WAIT_SECONDS.labels(model).observe(
                    max(0.0, time.time() - w.delivery.job.created_at)
                )
            else:  # canceled while queued (the store acked it) or fenced
                self._held.pop(w.job_id, None)
        if not started:
            return
        metrics.POOL_BUSY.labels(self.pool).set(1)
        try:
            await self._execute(self.runners[model], started)
        finally:
            metrics.POOL_BUSY.labels(self.pool).set(0)

    async def _execute(self, runner: Runner, batch: list[Work]) -> None:
        model = batch[0].key.model
        self._active = {w.job_id: w for w in batch}
        images = sum(w.images for w in batch)
        metrics.BATCH_IMAGES.labels(model).observe(images)
        metrics.BATCH_JOBS.labels(model).observe(len(batch))
        requests = [RunRequest(w.job_id, w.delivery.job.params, tenant=w.delivery.tenant) for w in batch]
        compiled_before = runner.compilations
        t0 = self._last_step = time.perf_counter()
        handoff = _StepHandoff(asyncio.get_running_loop(), self._active)
        handoff.model = model
        progress = asyncio.create_task(self._progress_task(handoff), name=f"{self.pool}-progress")
        run = runner.run if self.encoder is None else runner.generate
        if runner.takes_previews and any(w.delivery.job.params.preview_every for w in batch):
            run = functools.partial(run, previews=handoff.add_preview)
        try:
            try:
                # Image inputs from the store (a job whose input is gone fails; a store error: redelivery)
                requests = await read_inputs(requests, self.store, self.settings)
                results = await self._in_thread(run, requests, self._step_callback(model, handoff))
            finally:
                # Before any job of the batch is ended here: the task's last round (a cancel it saw) completes.
                handoff.close()
                (outcome,) = await asyncio.gather(progress, return_exceptions=True)
                if isinstance(outcome, Exception):
                    log.error("pool %s: the progress task failed", self.pool, exc_info=outcome)
        except _Abandoned:
            for w in list(self._active.values()):
                await self._release(w)
            return
        except Cancelled:
            # Every job was canceled (ended by the progress task) or dropped, or the drain deadline passed: give
            # back the rest.
            for w in list(self._active.values()):
                await self._release(w)
            return
        except InvalidRequest as e:
            if len(batch) > 1:
                await self._one_by_one(runner, batch)
                return
            message = str(e)
            await self._end(
                batch[0], "failed", lambda: self.store.fail(batch[0].delivery, "invalid_request", message)
            )
            return
        except GroupFailed as e:
            # A multi-host pool's group is gone (workers/multihost.py): no retry here. The batch is abandoned,
            # not released, so its deliveries count: a job that kills its group is dead-lettered in the end.
            log.error("pool %s: %s; leaving %d jobs to their leases", self.pool, e, len(batch))
            for w in batch:
                self._abandon(w)
            self.request_stop(0.0)
            return
        except Exception as e:
            if len(batch) > 1:
                log.warning(
                    "pool %s: batch of %d failed (%r); running its jobs one by one", self.pool, len(batch), e
                )
                await self._one_by_one(runner, batch)
                return
            log.exception("pool %s: job %s failed; leaving it for redelivery", self.pool, batch[0].job_id)
            with contextlib.suppress(RedisError):  # one try: a dead letter then says why (none: it says less)
                await self.store.note_error(batch[0].delivery, f"{type(e).__name__}: {e}")
            self._abandon(batch[0])
            return
        finally:
            self._active = {}
            self._count_compilations(runner, compiled_before, batch, time.perf_counter() - t0)
        metrics.INFERENCE_SECONDS.labels(model).observe(time.perf_counter() - t0)
        self._observe_batch(model, batch, results)
        if self.encoder is not None:
            await self._hand_off(batch, requests, results)
            return
        for r in results:  # encoded in `run` (a runner without an encoder): each job's own encoding time
            if "encode" in r.timings:
                metrics.STAGE_SECONDS.labels(model, "encode").observe(r.timings["encode"])
        by_id = {w.job_id: w for w in batch}
        for result in results:
            w = by_id[result.job_id]
            if w.job_id not in self._held:  # canceled or fenced while running
                continue
            ok = await self._complete(w, result)
            if ok:
                metrics.END_TO_END_SECONDS.labels(model).observe(
                    max(0.0, time.time() - w.delivery.job.created_at)
                )

    # -- encoding, off the pool thread -----------------------------------------------------------------------

    async def _hand_off(
        self, batch: list[Work], requests: list[RunRequest], generated: list[Generated | RunResult]
    ) -> None:
        """Give a batch's outputs to the encoder and return (the pool thread is free for the next batch); waits
        only while `max_encoding` batches are already there."""
        await self._encode_slots.acquire()
        self._encoding |= {w.job_id for w in batch}
        task = asyncio.create_task(self._finish(batch, requests, generated), name=f"{self.pool}-finish")
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _finish(
        self, batch: list[Work], requests: list[RunRequest], generated: list[Generated | RunResult]
    ) -> None:
        try:
            by_id = {w.job_id: w for w in batch}
            await asyncio.gather(
                *(
                    self._finish_job(by_id[req.job_id], req, g)
                    for req, g in zip(requests, generated, strict=True)
                )
            )
        finally:
            self._encoding -= {w.job_id for w in batch}
            self._encode_slots.release()

    async def _finish_job(self, w: Work, req: RunRequest, generated: Generated | RunResult) -> None:
        """Encode one job's outputs on an encoder thread, then store them and end the job (`_complete`). Cancelled
        (the drain deadline passed): the job is released for another delivery."""
        if w.job_id not in self._held:  # canceled or fenced while running
            return
        try:
            try:
                result = await self.encoder.submit(encode_job, req, generated)
            except Exception as e:
                log.exception("pool %s: job %s: its outputs could not be encoded", self.pool, w.job_id)
                message = f"the job's outputs could not be encoded: {e!r}"
                await self._end(w, "failed", lambda: self.store.fail(w.delivery, "encode_error", message))
                return
            metrics.STAGE_SECONDS.labels(w.key.model, "encode").observe(result.timings.get("encode", 0.0))
            if w.job_id in self._held and await self._complete(w, result):
                metrics.END_TO_END_SECONDS.labels(w.key.model).observe(
                    max(0.0, time.time() - w.delivery.job.created_at)
                )
        except Exception:  # a store error past its retries: left for redelivery, as a crashed batch is
            log.exception(
                "pool %s: job %s could not be ended; leaving it for redelivery", self.pool, w.job_id
            )
            self._abandon(w)
        except asyncio.CancelledError:
            if w.job_id in self._held:  # stored or not, a release of an ended job is fenced: nothing is lost
                await self._release(w)
            raise

    async def _drain_encoding(self) -> None:
        """At stop: let the batches being encoded finish until the drain deadline (plus the grace), then cancel
        what is left (its jobs are released)."""
        while self._finishing:
            timeout = None
            if self._stop_deadline is not None:
                timeout = max(0.0, self._stop_deadline + _GRACE_S - time.monotonic())
            done, pending = await asyncio.wait(set(self._finishing), timeout=timeout)
            if pending and timeout is not None and time.monotonic() >= self._stop_deadline + _GRACE_S:
                log.warning(
                    "pool %s: %d batches still encoding at the deadline; releasing their jobs",
                    self.pool,
                    len(pending),
                )
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                return

    async def _one_by_one(self, runner: Runner, batch: list[Work]) -> None:
        for w in batch:
            if w.job_id in self._held:
                await self._execute(runner, [w])

    def _observe_batch(self, model: str, batch: list[Work], results: list[Generated | RunResult]) -> None:
        """A batch's stage timings (once per batch; encoding is per job, observed where it happens) and the
        steps its step cache skipped (one count for the batch: its jobs share each step's decision)."""
        if not results:
            return
        first = results[0]
        for stage, seconds in first.timings.items():
            if stage != "encode":
                metrics.STAGE_SECONDS.labels(model, stage).observe(seconds)
        cache = batch[0].delivery.job.params.cache
        if cache is not None and first.cached_steps is not None:
            metrics.CACHED_STEPS.labels(model, cache.method).inc(first.cached_steps)

    def _count_compilations(self, runner: Runner, before: int, batch: list[Work], seconds: float) -> None:
        """Programs the batch compiled on the request path (a shape the pool did not warm up), counted and logged
        with the shape: only any_size pools should ever do this (the API admits only warmed-up sizes)."""
        compiled = runner.compilations - before
        if compiled <= 0:
            return
        metrics.COMPILATIONS.labels(self.pool, "request").inc(compiled)
        p = batch[0].delivery.job.params
        log.warning(
            "pool %s: compiled %d programs on the request path for %s %dx%d%s, %d images, %d steps; the batch "
            "took %.2f s with them",
            self.pool,
            compiled,
            batch[0].key.model,
            p.width,
            p.height,
            f"x{p.num_frames} frames" if p.num_frames else "",
            sum(w.images for w in batch),
            p.num_inference_steps,
            seconds,
        )

    # -- per step (called from the pool thread) --------------------------------------------------------------

    def _step_callback(self, model: str, handoff: _StepHandoff) -> Callable[[int, int], bool]:
        def callback(step: int, total: int) -> bool:
            now = time.perf_counter()
            metrics.DENOISE_STEP_SECONDS.labels(model).observe(now - self._last_step)
            self._last_step = now
            handoff.latest = (step, total)
            try:
                handoff.loop.call_soon_threadsafe(handoff.wake.set)
            except RuntimeError:  # the loop is closed: the worker exited past its drain deadline
                return False
            return not handoff.closed and bool(handoff.active) and not self._drain_expired()

        return callback

    # -- the progress task (on the event loop, one per running batch) ----------------------------------------

    async def _progress_task(self, handoff: _StepHandoff) -> None:
        """Until the batch ends: at every new step, and every `_POLL_S` when steps are slower, one round trip reads
        the cancel flags of the batch's jobs and records the newest step for them (`Store.poll_running`; steps that
        came meanwhile are skipped). Canceled jobs end here at once, fenced ones are dropped; the step callback
        stops the loop when none is left. A failed round is logged once per outage and tried again."""
        sent: tuple[int, int] | None = None
        failing = False
        while not handoff.closed:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_POLL_S):
                    await handoff.wake.wait()
            handoff.wake.clear()
            active = list(handoff.active.values())
            if handoff.closed or not active:
                continue
            latest = handoff.latest
            new = latest if latest != sent else None
            try:
                states = await self.store.poll_running([w.delivery for w in active], *(new or (None, 0)))
            except RedisError as e:
                if not failing:
                    log.warning("pool %s: progress/cancel check failed (%s); retrying", self.pool, e)
                failing = True
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_RETRY_S):
                        while not handoff.closed:
                            await handoff.wake.wait()
                            handoff.wake.clear()
                continue
            if failing:
                log.info("pool %s: progress/cancel checks work again", self.pool)
                failing = False
            sent = new or sent
            for w, (canceled, recorded) in zip(active, states, strict=True):
                if w.job_id not in handoff.active:  # ended or dropped meanwhile (a refused heartbeat)
                    continue
                if canceled:
                    handoff.active.pop(w.job_id, None)
                    if await self._end(w, "canceled", lambda w=w: self.store.mark_canceled(w.delivery)):
                        metrics.CANCELLED.labels(w.key.model).inc()
                elif not recorded:
                    self._drop(w)
            await self._publish_previews(handoff)

    async def _publish_previews(self, handoff: _StepHandoff) -> None:
        """The newest preview of each output still computed: encoded to a WebP data URL off the event loop (and
        off the pool thread), then written in one round trip. Best effort: a failure drops them (the next ones
        come a few steps later)."""
        taken, skipped = handoff.take_previews()
        model = handoff.model
        if skipped:
            metrics.PREVIEWS.labels(model, "superseded").inc(skipped)
        due = [(handoff.active[job], index, *v) for (job, index), v in taken.items() if job in handoff.active]
        if not due:
            return

        def encode() -> list[str]:
            # Imported here: only a pipeline runner (JAX loaded) makes previews.
            from meshserve.models.engine.previews import encode_preview

            urls = []
            for *_, pixels in due:
                t0 = time.perf_counter()
                urls.append(encode_preview(pixels))
                metrics.PREVIEW_ENCODE_SECONDS.labels(model).observe(time.perf_counter() - t0)
            return urls

        urls = await asyncio.to_thread(encode)
        items = []
        for (w, index, step, total, _), url in zip(due, urls, strict=True):
            if len(url) > MAX_PREVIEW_CHARS:
                metrics.PREVIEWS.labels(model, "too_large").inc()
                continue
            items.append((w.delivery, index, step, total, url))
        try:
            written = await publish_previews(self.store, items)
        except RedisError as e:
            log.warning("pool %s: previews not published: %s", self.pool, e)
            return
        metrics.PREVIEWS.labels(model, "published").inc(sum(written))

    # -- helpers ---------------------------------------------------------------------------------------------

    async def _in_thread(self, fn, *args):
        """Run fn on the pool thread. Past the drain deadline (plus a grace for the next step callback) raise
        `_Abandoned` (the caller releases the batch's jobs) and leave the thread behind: it is a daemon and the
        process exits."""
        fut = self.thread.submit(fn, *args)
        while True:
            done, _ = await asyncio.wait({fut}, timeout=0.5)
            if done:
                return fut.result()
            if self._stop_deadline is not None and time.monotonic() > self._stop_deadline + _GRACE_S:
                raise _Abandoned

    async def _end(
        self,
        w: Work,
        outcome: str,
        write: Callable[[], Awaitable[bool]],
        retry_on: tuple[type[Exception], ...] = (RedisError,),
    ) -> bool:
        """Finish a job with one fenced store write; False (fenced) is counted, not raised. A non-Redis error
        still failing after `_call`'s retries is raised, and the job stays held."""
        ok = await self._call(write, retry_on)
        self._held.pop(w.job_id, None)
        metrics.JOBS.labels(w.key.model, outcome if ok else "fenced").inc()
        return ok

    async def _complete(self, w: Work, result: RunResult) -> bool:
        """`complete` with storage errors retried for one lease; past that the job is abandoned (its lease lapses
        and another delivery runs it again), or, on its last delivery, failed with "output_store_error"."""
        try:
            return await self._end(
                w,
                "succeeded",
                lambda: self.store.complete(
                    w.delivery, result.outputs, result.timings, cached_steps=result.cached_steps
                ),
                retry_on=(RedisError, OutputStoreError),
            )
        except OutputStoreError as e:
            job_id, count = w.job_id, w.delivery.delivery_count
            if count < self.settings.max_deliveries:
                log.error(
                    "pool %s: job %s: outputs not stored (%s); leaving it for redelivery (delivery %d of %d)",
                    self.pool,
                    job_id,
                    e,
                    count,
                    self.settings.max_deliveries,
                )
                self._abandon(w)
                return False
            message = f"the job's outputs could not be stored after {count} deliveries: {e}"
            log.error("pool %s: job %s failed: %s", self.pool, job_id, message)
            failed = await self._end(
                w, "failed", lambda: self.store.fail(w.delivery, "output_store_error", message)
            )
            if failed:  # ours to clean: no other delivery can commit the job any more
                try:
                    await self.store.delete_outputs(job_id)
                except OutputStoreError as cleanup:
                    log.warning(
                        "pool %s: job %s: partial outputs left behind: %s", self.pool, job_id, cleanup
                    )
            return False

    async def _release(self, w: Work, outcome: str = "released") -> None:
        self._active.pop(w.job_id, None)
        await self._end(w, outcome, lambda: self.store.release(w.delivery))

    def _drop(self, w: Work) -> None:
        """A write was refused: another delivery owns the job (our lease lapsed), or it ended elsewhere."""
        self._active.pop(w.job_id, None)
        if self._held.pop(w.job_id, None) is not None:
            metrics.JOBS.labels(w.key.model, "fenced").inc()
            log.warning("pool %s: job %s is owned by another delivery; dropping it", self.pool, w.job_id)

    def _abandon(self, w: Work) -> None:
        self._held.pop(w.job_id, None)  # no more heartbeats: the lease lapses and a later claim retries it
        metrics.JOBS.labels(w.key.model, "abandoned").inc()

    async def _call(
        self, write: Callable[[], Awaitable[bool]], retry_on: tuple[type[Exception], ...] = (RedisError,)
    ) -> bool:
        """A fenced store write, retried while Redis (or, with `retry_on`, the output store) fails, for up to one
        lease (after that the job belongs to another delivery anyway, and the fence refuses the write). A Redis
        error past that is False; any other is raised."""
        deadline = time.monotonic() + self.settings.lease_s
        delay = 0.05
        while True:
            try:
                return bool(await write())
            except retry_on as e:
                if time.monotonic() + delay > deadline:
                    if not isinstance(e, RedisError):
                        raise
                    log.error("pool %s: store write failed for good: %s", self.pool, e)
                    return False
                log.warning("pool %s: store write failed (%s); retrying", self.pool, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

"""A worker whose Redis connections go half-open mid-job: a TCP proxy between the worker's store and Redis stops
forwarding in both directions without closing anything (a NAT or load balancer that forgot the flow; or a partition
that also swallows new connections for 2 s). The denoise loop must not notice (its step callback never waits on
Redis), the silent connections must be given up at their deadline and replaced, and the job must succeed, in its
first attempt. The worker runs in-process (fake runner, no JAX) so the test can read the step times."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from urllib.parse import urlparse

import pytest

from meshserve.service.contract import JobStatus
from meshserve.service.store import Store
from meshserve.workers.config import WorkerConfig
from meshserve.workers.fake_runner import FakeRunner
from meshserve.workers.main import Worker
from tests.service.tcp_proxy import BlackHoleProxy
from tests.workers.helpers import cleanup, make_settings, params, submit_many, wait_ended, wait_status

STEP_S = 0.05
STEPS = 80  # 4 s of denoising: the stall comes at step 5 and recovery well before the end


class TimedRunner(FakeRunner):
    """The fake runner, recording when each step's callback was called and how long it took to answer."""

    steps: dict[str, list[tuple[int, float, float]]] = defaultdict(list)  # job id -> (step, start, seconds)

    def run(self, batch, callback=None):
        job_id = batch[0].job_id

        def timed(step: int, total: int) -> bool:
            t0 = time.monotonic()
            go_on = callback(step, total)
            TimedRunner.steps[job_id].append((step, t0, time.monotonic() - t0))
            return go_on

        return super().run(batch, timed if callback is not None else None)


async def _progress_steps(store: Store, job_id: str) -> list[int]:
    out, last = [], "0-0"
    while batch := await store.events(job_id, last):
        out += [e.data["step"] for e in batch if e.type.value == "progress"]
        last = batch[-1].id
    return out


@pytest.mark.parametrize("partition_s", [0.0, 2.0], ids=["half-open", "half-open-and-2s-partition"])
def test_a_half_open_redis_connection_mid_job_neither_stalls_the_steps_nor_fails_the_job(partition_s):
    # A 1 s command deadline (the default is 5 s) keeps the test short; the lease outlasts the outage.
    settings = make_settings(lease_s=6.0, redis_command_timeout_s=1.0)
    cfg = WorkerConfig.model_validate(
        {
            "models": {
                "fake": {
                    "runner": "tests.workers.test_half_open:TimedRunner",
                    "options": {"step_seconds": STEP_S},
                }
            },
            "pools": [{"name": "h", "devices": "0", "models": ["fake"]}],
            "metrics_port": None,
        }
    )

    async def main():
        target = urlparse(settings.redis_url)
        proxy = await BlackHoleProxy.start(target.hostname or "127.0.0.1", target.port or 6379)
        observer = Store(settings)  # straight to Redis
        worker = Worker(cfg, settings.model_copy(update={"redis_url": proxy.url}))
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.ready.wait(), 30)
            (job_id,) = await submit_many(observer, [params("half-open", steps=STEPS)])
            await wait_status(observer, job_id, JobStatus.RUNNING, timeout=10, step=5)
            stalled_step = len(TimedRunner.steps[job_id])
            connections = proxy.connections
            if partition_s:
                proxy.partition()
                await asyncio.sleep(partition_s)
                t_heal = time.monotonic()
                proxy.heal()
            else:
                proxy.stall()
            t_stall = proxy.stalled_at
            job = (await wait_ended(observer, [job_id], timeout=30))[job_id]
            t_done = time.monotonic()
            assert job.status == JobStatus.SUCCEEDED and job.attempt == 1, job
            assert job.progress.step == STEPS and len(job.outputs) == 1

            # Noticed and replaced: a new connection answered the worker after the stall.
            assert proxy.first_reply_after_stall is not None and proxy.connections > connections
            first_reply = proxy.first_reply_after_stall - t_stall
            # Progress published again after the outage (coalesced: only the newest step each round).
            published = await _progress_steps(observer, job_id)
            assert any(s > stalled_step + 5 for s in published), published

            # The denoise loop went on throughout: every callback answered at once, no gap between steps.
            steps = TimedRunner.steps[job_id]
            assert [s for s, _, _ in steps] == list(range(1, STEPS + 1))
            slowest_callback = max(seconds for _, _, seconds in steps)
            starts = [t for _, t, _ in steps]
            widest_gap = max(b - a for a, b in zip(starts, starts[1:], strict=False))
            steps_in_outage = sum(t_stall <= t <= t_stall + partition_s + 1.0 for t in starts)
            label = f"half-open + {partition_s:.0f} s partition" if partition_s else "half-open"
            print(
                f"\n[{label}] stall at step "
                f"{stalled_step}: first Redis reply to the worker {first_reply:.2f} s after the stall"
                + (f" ({proxy.first_reply_after_stall - t_heal:.2f} s after the heal)" if partition_s else "")
                + f"; job succeeded {t_done - t_stall:.2f} s after the stall; {steps_in_outage} steps ran in the "
                f"outage's first {partition_s + 1.0:.0f} s; slowest step callback {slowest_callback * 1000:.2f} ms, "
                f"widest gap between steps {widest_gap * 1000:.0f} ms (step {STEP_S * 1000:.0f} ms)"
            )
            assert slowest_callback < 0.05
            assert widest_gap < STEP_S + 0.5  # a loaded 2-core machine; a waiting callback would take >= 1 s
            assert steps_in_outage >= (partition_s + 1.0) / STEP_S / 3
            # Recovery: the deadline (1 s), a retry pause (0.5 s) and slack for a loaded machine.
            assert first_reply < partition_s + 1.0 + 0.5 + 1.5
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)
            await observer.close()
            await proxy.close()
            TimedRunner.steps.clear()

    try:
        asyncio.run(main())
    finally:
        cleanup(settings)

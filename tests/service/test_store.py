"""The store's queue semantics against the real Redis: priority order, the attempt fence, lease takeover,
dead-lettering, release, cancel, the pool registry and exactly-once completion under concurrency."""

from __future__ import annotations

import asyncio
import time

import pytest

from meshserve.service.contract import JobParams, JobStatus, OutputBlob, Priority, QueueFull
from meshserve.service.store import Store
from tests.service.conftest import TOY, FakeWorker, drop_keys

pytestmark = pytest.mark.anyio


def params(**kw) -> JobParams:
    base = dict(
        model="toy",
        prompt="a red square",
        width=64,
        height=48,
        num_inference_steps=2,
        guidance_scale=5.0,
        seed=7,
    )
    return JobParams(**{**base, **kw})


def blob(i: int = 0) -> OutputBlob:
    return OutputBlob(index=i, data=b"img%d" % i, content_type="image/png", width=64, height=48, seed=7)


async def test_claim_reads_priorities_in_order(store: Store):
    low = await store.submit(params(), Priority.LOW)
    normal = await store.submit(params(), Priority.NORMAL)
    high = await store.submit(params(), Priority.HIGH)
    # Positions count the jobs ahead: high is next, low waits behind both.
    assert [await store.queue_position(j) for j in (high, normal, low)] == [0, 1, 2]
    got = await store.claim(["toy"], "c1", max_jobs=2)
    assert [d.job.id for d in got] == [high.id, normal.id]
    assert all(d.attempt == 1 and d.delivery_count == 1 for d in got)
    assert [d.job.id for d in await store.claim(["toy"], "c1", max_jobs=5)] == [low.id]
    assert await store.claim(["toy"], "c1", max_jobs=5, block_ms=20) == []
    # A delivery names the job's tenant (the pool scopes its prompt cache by it); none given: the default.
    assert {d.tenant for d in got} == {store.settings.default_owner}
    await store.submit(params(), owner="alice")
    assert [d.tenant for d in await store.claim(["toy"], "c1", max_jobs=5)] == ["alice"]


async def test_blocking_claim_wakes_on_submit(store: Store):
    claim = asyncio.create_task(store.claim(["toy"], "c1", max_jobs=1, block_ms=3000))
    await asyncio.sleep(0.1)
    job = await store.submit(params())
    t0 = time.monotonic()
    got = await claim
    assert [d.job.id for d in got] == [job.id] and time.monotonic() - t0 < 1.0


async def test_full_lifecycle_and_events(store: Store):
    job = await store.submit(params(n=2))
    (d,) = await store.claim(["toy"], "c1")
    assert await store.start(d)
    assert (await store.get(job.id)).status == JobStatus.RUNNING
    assert await store.progress(d, 1, 2) and await store.progress(d, 2, 2)
    assert await store.complete(d, [blob(0), blob(1)], stages={"denoise": 0.5})
    done = await store.get(job.id)
    assert done.status == JobStatus.SUCCEEDED and done.finished_at >= done.started_at >= done.created_at
    assert [o.url for o in done.outputs] == [f"/v1/jobs/{job.id}/outputs/0", f"/v1/jobs/{job.id}/outputs/1"]
    assert done.timings.total_s >= done.timings.inference_s > 0 and done.timings.stages == {"denoise": 0.5}
    assert await store.output(job.id, 1) == b"img1"
    types = [e.type.value for e in await store.events(job.id)]
    assert types == ["queued", "started", "progress", "progress", "succeeded"]
    # Ended: a job hash and its events expire; nothing is left pending in the stream.
    assert 0 < await store.redis.ttl(store.job_key(job.id)) <= store.settings.job_ttl_s
    assert (await store.redis.xpending(store.stream_key("toy", "normal"), "pools"))["pending"] == 0


async def test_a_job_ends_on_the_step_count_its_progress_reported(store: Store):
    """A run's steps need not be the job's num_inference_steps (a strength runs fewer; Heun's loop calls the
    model 2N - 1 times): the succeeded job's progress is the count its progress events gave, else its steps."""
    reported, silent = await store.submit(params()), await store.submit(params())
    first, second = await store.claim(["toy"], "c1", max_jobs=2)
    assert await store.start(first) and await store.start(second)
    calls = 2 * reported.params.num_inference_steps - 1
    for step in range(1, calls + 1):
        assert await store.progress(first, step, calls)
    assert await store.complete(first, [blob(0)]) and await store.complete(second, [blob(0)])
    done = await store.get(reported.id)
    assert (done.progress.step, done.progress.total_steps) == (calls, calls)
    steps = silent.params.num_inference_steps
    done = await store.get(silent.id)
    assert (done.progress.step, done.progress.total_steps) == (steps, steps)


async def test_stale_attempt_write_is_refused(store: Store):
    job = await store.submit(params())
    (old,) = await store.claim(["toy"], "c1")
    assert await store.start(old)
    await asyncio.sleep(0.4)  # lease (0.3 s) expires without a heartbeat: c1 is presumed dead
    (new,) = await store.claim(["toy"], "c2")
    assert new.job.id == job.id and new.attempt == old.attempt + 1 and new.delivery_count == 2
    assert await store.start(new)
    # Every write of the old attempt is refused and changes nothing.
    assert not await store.heartbeat(old)
    assert not await store.progress(old, 1, 2)
    assert not await store.complete(old, [blob()])
    assert not await store.fail(old, "boom", "stale")
    assert not await store.mark_canceled(old)
    assert not await store.release(old)
    assert await store.output(job.id, 0) is None
    assert (await store.get(job.id)).status == JobStatus.RUNNING
    assert await store.complete(new, [blob()])
    assert not await store.complete(new, [blob()])  # and a job completes once
    done = await store.get(job.id)
    assert done.status == JobStatus.SUCCEEDED and done.worker == "c2" and done.attempt == 2


async def test_takeover_after_lease_expiry_only(store: Store):
    job = await store.submit(params())
    (d,) = await store.claim(["toy"], "c1")
    assert await store.start(d)
    # While c1 heartbeats, the entry is idle longer than the lease but its lease lives: no takeover.
    for _ in range(4):
        await asyncio.sleep(0.15)
        assert await store.heartbeat(d)
        assert await store.claim(["toy"], "c2") == []
    await asyncio.sleep(0.4)
    (taken,) = await store.claim(["toy"], "c2")
    assert taken.job.id == job.id and taken.consumer == "c2" and taken.delivery_count == 2
    assert (await store.stats())[("toy", "reclaimed")] == 1
    # Its client hears that the job went back to the queue before it starts again (it heard `started` twice).
    assert (await store.get(job.id)).status == JobStatus.QUEUED
    assert await store.start(taken)
    events = await store.events(job.id)
    assert [e.type.value for e in events] == ["queued", "started", "queued", "started"]
    assert events[2].data["reason"] == "worker_lost"


async def test_dead_letter_after_max_deliveries(store: Store):
    assert store.settings.max_deliveries == 3
    job = await store.submit(params())
    for n in range(1, 4):  # a poison job: each worker dies with it
        (d,) = await store.claim(["toy"], f"c{n}")
        assert d.delivery_count == n
        assert await store.start(d)
        await asyncio.sleep(0.35)
    assert await store.claim(["toy"], "c4") == []
    failed = await store.get(job.id)
    assert failed.status == JobStatus.FAILED and failed.error.code == "too_many_deliveries"
    assert "4 times (limit 3)" in failed.error.message
    dlq = await store.redis.xrange(store.dlq_key("toy"))
    assert len(dlq) == 1 and dlq[0][1]["job"] == job.id and dlq[0][1]["deliveries"] == "4"
    assert (await store.redis.xpending(store.stream_key("toy", "normal"), "pools"))["pending"] == 0
    assert (await store.events(job.id))[-1].type.value == "failed"
    assert (await store.stats())[("toy", "dead_lettered")] == 1


async def test_release_keeps_place_and_delivery_budget(store: Store):
    first = await store.submit(params())
    second = await store.submit(params())
    (d,) = await store.claim(["toy"], "c1")
    assert d.job.id == first.id and await store.start(d)
    assert await store.release(d)
    assert (await store.get(first.id)).status == JobStatus.QUEUED
    got = await store.claim(["toy"], "c2", max_jobs=2)
    # The released job comes back first, as a first delivery again, with a new attempt.
    assert [x.job.id for x in got] == [first.id, second.id]
    assert got[0].delivery_count == 1 and got[0].attempt == d.attempt + 2
    assert not await store.complete(d, [blob()])


async def test_a_job_given_back_keeps_its_priority_place(store: Store):
    """Claims go stream by stream in priority order, takeovers then new entries: a low job a pool gave back is not
    taken before a newer high one (an audit's high job waited behind two given-back low ones)."""
    low = await store.submit(params(), Priority.LOW)
    (d,) = await store.claim(["toy"], "c1")
    assert await store.release(d)
    events = [e["type"] for _, e in await store.redis.xrange(f"{store.prefix}:events:{low.id}")]
    assert events == ["queued"]  # given back before it started: nothing new for its client
    assert (await store.queue_depths())[("toy", Priority.LOW)]["depth"] == 1  # waiting again: it counts
    high = await store.submit(params(), Priority.HIGH)
    normal = await store.submit(params())
    assert [await store.queue_position(await store.get(j.id)) for j in (high, normal, low)] == [0, 1, 2]
    got = await store.claim(["toy"], "c2", max_jobs=2)
    assert [x.job.id for x in got] == [high.id, normal.id]
    (again,) = await store.claim(["toy"], "c2")
    assert again.job.id == low.id and again.delivery_count == 1  # a give-back spends no delivery
    assert not again.taken_over and ("toy", "reclaimed") not in await store.stats()  # nor is it a takeover


@pytest.mark.parametrize("aging_s", [0.0, 0.1])
async def test_a_waiting_job_counts_one_priority_higher_per_aging_period(make_settings, aging_s):
    """Strict priorities starved low jobs under steady high load (an audit's waited 28 s, behind every high job
    that arrived meanwhile). With `priority_aging_s`, a low job that waited 2.5 periods goes before a fresh high
    one; with 0, priorities are strict (the pool's batch order: tests/workers/test_batching.py)."""
    store = Store(make_settings(priority_aging_s=aging_s))
    try:
        for _ in range(20):  # ended entries ahead of it do not hide its age
            await store.cancel((await store.submit(params(), Priority.LOW)).id)
        low = await store.submit(params(), Priority.LOW)
        await asyncio.sleep(0.25)
        high = await store.submit(params(), Priority.HIGH)
        got = await store.claim(["toy"], "c1", max_jobs=2)
        assert [d.job.id for d in got] == ([low.id, high.id] if aging_s else [high.id, low.id])
        # Given back (a pool that could not fit them), they keep their age.
        for d in got:
            assert await store.release(d)
        fresh = await store.submit(params(), Priority.HIGH)
        got = await store.claim(["toy"], "c2", max_jobs=1)
        assert [d.job.id for d in got] == ([low.id] if aging_s else [high.id]), (low.id, high.id, fresh.id)
    finally:
        await drop_keys(store)
        await store.close()


async def test_cancel_queued_and_claimed(store: Store):
    queued = await store.submit(params())
    canceled = await store.cancel(queued.id)
    assert canceled.status == JobStatus.CANCELED and canceled.finished_at
    # A pool meeting the canceled entry acks and skips it.
    assert await store.claim(["toy"], "c1") == []
    assert (await store.redis.xpending(store.stream_key("toy", "normal"), "pools"))["pending"] == 0
    # Canceled between claim and start: start refuses and acks.
    job = await store.submit(params())
    (d,) = await store.claim(["toy"], "c1")
    await store.cancel(job.id)
    assert not await store.start(d)
    assert (await store.redis.xpending(store.stream_key("toy", "normal"), "pools"))["pending"] == 0


async def test_cancel_running_is_a_request(store: Store):
    job = await store.submit(params())
    (d,) = await store.claim(["toy"], "c1")
    await store.start(d)
    assert not await store.cancel_requested(job.id)
    after = await store.cancel(job.id)
    assert after.status == JobStatus.RUNNING and after.cancel_requested
    assert await store.cancel_requested(job.id)
    assert await store.mark_canceled(d)
    assert (await store.get(job.id)).status == JobStatus.CANCELED
    assert (await store.cancel(job.id)).status == JobStatus.CANCELED  # ended: unchanged


async def test_queue_limit_counts_undelivered_only(make_settings):
    store = Store(make_settings(queue_max_length=2))
    try:
        await store.submit(params(), Priority.HIGH)
        await store.submit(params(), Priority.LOW)
        with pytest.raises(QueueFull):
            await store.submit(params())
        await store.claim(["toy"], "c1")  # one delivered: room for one more
        await store.submit(params())
        depths = await store.queue_depths()
        assert depths[("toy", Priority.LOW)]["depth"] == 1 and depths[("toy", Priority.NORMAL)]["depth"] == 1
        assert (
            depths[("toy", Priority.HIGH)]["pending"] == 1
            and depths[("toy", Priority.LOW)]["oldest_age_s"] >= 0
        )
    finally:
        await drop_keys(store)
        await store.close()


async def test_canceled_and_expired_queued_jobs_free_their_queue_room_at_once(make_settings):
    """Submit-and-cancel in a loop (or deadlines that pass in the queue) must not fill the model's queue for every
    tenant until a pool reads past the ended entries: no pool reads here at all."""
    store = Store(make_settings(queue_max_length=3))
    try:
        # A group that has read an entry: Redis 7.0 then counts deleted entries in its lag once the stream is
        # empty (an XDEL on cancel left an audit's queue "full" for good).
        await store.submit(params())
        (first,) = await store.claim(["toy"], "c0")
        for _ in range(5):
            jobs = [await store.submit(params()) for _ in range(3)]
            for job in jobs:
                assert (await store.cancel(job.id)).status == JobStatus.CANCELED
            assert (await store.queue_depths())[("toy", Priority.NORMAL)]["depth"] == 0
        kept = await store.submit(params())
        late = await store.submit(params(), deadline_at=time.time() - 1)
        assert (await store.queue_depths())[("toy", Priority.NORMAL)]["depth"] == 2
        assert await store.expire_due() == [late.id]
        assert (await store.queue_depths())[("toy", Priority.NORMAL)]["depth"] == 1
        # Room for two more; the one kept is the one a pool reads, ahead of them.
        later = [await store.submit(params()), await store.submit(params())]
        with pytest.raises(QueueFull):
            await store.submit(params())
        # Positions leave out ended entries: the kept job is next, the two after it follow.
        assert [await store.queue_position(await store.get(j.id)) for j in (kept, *later)] == [0, 1, 2]
        got = await store.claim(["toy"], "c1", max_jobs=1)
        assert [d.job.id for d in got] == [kept.id]  # read past the 15 ended entries in one claim
        assert first.job.status == JobStatus.QUEUED
    finally:
        await drop_keys(store)
        await store.close()


async def test_idempotent_submit(store: Store):
    from meshserve.service.contract import IdempotencyConflict

    a = await store.submit(params(), idempotency_key="k1", request_digest="h1")
    b = await store.submit(params(), idempotency_key="k1", request_digest="h1")
    assert a.id == b.id and not a.replayed and b.replayed  # (the API counts created jobs only)
    with pytest.raises(IdempotencyConflict):
        await store.submit(params(), idempotency_key="k1", request_digest="h2")
    c = await store.submit(params(), idempotency_key="k2", request_digest="h1")
    assert c.id != a.id


async def test_pool_registry(store: Store):
    worker = FakeWorker(store, name="p1")
    await worker.register(ready=False)
    (pool,) = await store.list_pools()
    assert pool.name == "p1" and not pool.ready and pool.models[0] == TOY and pool.last_seen > 0
    assert await store.heartbeat_pool("p1", ready=True)
    assert (await store.list_pools())[0].ready
    assert not await store.heartbeat_pool("nope")
    # A pool not seen for pool_stale_s is left out.
    raw = (await store.list_pools())[0].model_copy(update={"last_seen": time.time() - 1000})
    await store.redis.hset(store.pools_key, "p1", raw.model_dump_json())
    assert await store.list_pools() == [] and len(await store.list_pools(include_stale=True)) == 1
    await store.unregister_pool("p1")
    assert await store.list_pools(include_stale=True) == []


async def test_what_gone_pools_leave_is_forgotten(store: Store):
    """Crashed pools never remove their registry entries, and every consumer that ever read a stream stays in its
    group: the registry sweep drops entries not seen for a while and idle consumers with nothing pending."""
    from meshserve.service.registry_sweep import FORGET_AFTER_STALE, RegistrySweep

    await FakeWorker(store, name="alive").register()
    await FakeWorker(store, name="crashed").register()
    raw = (await store.list_pools(include_stale=True))[0].model_copy(update={"last_seen": time.time() - 1000})
    await store.redis.hset(store.pools_key, "crashed", raw.model_dump_json())
    job = await store.submit(params())
    (holder,) = await store.claim(["toy"], "holder")  # a consumer with a pending entry
    stream = store.stream_key("toy", "normal")
    await store.redis.xgroup_createconsumer(stream, "pools", "idle")  # one with none
    await asyncio.sleep(0.1)
    assert await store.heartbeat_pool("alive")
    assert {c["name"] for c in await store.redis.xinfo_consumers(stream, "pools")} == {"holder", "idle"}
    sweep = RegistrySweep(
        store, store.settings.model_copy(update={"pool_stale_s": 0.05 / FORGET_AFTER_STALE})
    )
    assert await sweep.tick() == (["crashed"], 1)
    assert [p.name for p in await store.list_pools(include_stale=True)] == ["alive"]
    assert [c["name"] for c in await store.redis.xinfo_consumers(stream, "pools")] == ["holder"]
    assert await sweep.tick() == ([], 0)  # not due again yet
    assert holder.job.id == job.id and await store.start(holder) and await store.complete(holder, [blob()])


async def test_two_consumers_finish_each_job_exactly_once(store: Store):
    jobs = [await store.submit(params(num_inference_steps=1)) for _ in range(100)]
    workers = [FakeWorker(store, name=f"w{i}", step_s=0, max_jobs=4) for i in range(2)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 30
    while sum(len(w.finished) for w in workers) < len(jobs) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for w in workers:
        await w.stop()
    finished = [j for w in workers for j in w.finished]
    assert sorted(finished) == sorted(j.id for j in jobs)  # each once, none twice
    assert all(len(w.finished) > 10 for w in workers)  # both pools got work
    statuses = {(await store.get(j.id)).status for j in jobs}
    assert statuses == {JobStatus.SUCCEEDED}


async def test_trim_drops_only_finished_entries(store: Store):
    stream = store.stream_key("toy", "normal")
    done = await store.submit(params())
    (d,) = await store.claim(["toy"], "c1")
    await store.start(d)
    await store.complete(d, [blob()])
    waiting = await store.submit(params())
    store._trimmed.clear()
    await store.claim(["other"], "c1")  # trims only the streams it reads
    assert await store.redis.xlen(stream) == 2
    await store._run("TRIM", [stream], [])
    entries = await store.redis.xrange(stream)
    assert [f["job"] for _, f in entries] == [waiting.id] and done.id != waiting.id
    assert (await store.queue_depths())[("toy", Priority.NORMAL)]["depth"] == 1


@pytest.mark.parametrize("url_base", [None, "https://cdn.example/outputs"])
async def test_outputs_in_a_directory(make_settings, tmp_path, url_base):
    store = Store(make_settings(output_dir=str(tmp_path), output_url_base=url_base))
    try:
        job = await store.submit(params(n=2))
        (d,) = await store.claim(["toy"], "c1")
        assert await store.start(d) and await store.complete(d, [blob(0), blob(1)])
        done = await store.get(job.id)
        # Under a per-job random token (128 bits): an output URL is unguessable even knowing the job id; and
        # under the attempt that committed it (a stale attempt writes elsewhere).
        token = await store.redis.hget(store.job_key(job.id), "out_token")
        assert len(token) == 22 and token != job.id
        assert (tmp_path / job.id / f"{token}-1" / "1.png").read_bytes() == b"img1"
        assert await store.output(job.id, 1) == b"img1" and await store.output(job.id, 2) is None
        assert not await store.redis.exists(store.output_key(job.id, 1))  # not in Redis as well
        expected = f"{url_base}/{job.id}/{token}-1/0.png" if url_base else f"/v1/jobs/{job.id}/outputs/0"
        assert done.outputs[0].url == expected
    finally:
        await drop_keys(store)
        await store.close()


async def test_output_bytes_are_written_with_plain_commands_not_in_the_commit_script(store: Store):
    """A script blocks Redis for as long as it runs: the fenced commit must carry keys, never the bytes. Before:
    the END script got every output's bytes as arguments (here 2 MiB) and SET them itself."""
    big = OutputBlob(index=0, data=b"x" * (2 << 20), content_type="image/png", width=64, height=48, seed=7)
    job = await store.submit(params())
    (d,) = await store.claim(["toy"], "c1")
    assert await store.start(d)
    script = store._scripts["END"]
    sent: list[int] = []

    async def recording(keys, args):
        sent.append(sum(len(a) if isinstance(a, bytes | str) else 8 for a in args))
        return await script(keys=keys, args=args)

    store._scripts["END"] = recording
    try:
        assert await store.complete(d, [big])
    finally:
        store._scripts["END"] = script
    assert len(sent) == 1 and sent[0] < 16 << 10, sent
    assert await store.output(job.id, 0) == big.data
    ttl = await store.redis.ttl(store.output_key(job.id, 0))
    assert 0 < ttl <= store.settings.output_ttl_s  # the staged key's TTL moved with the rename
    assert not [k async for k in store.redis.scan_iter(f"{store.prefix}:staged:*")]


async def test_a_stale_attempts_bytes_never_become_visible(store: Store):
    job = await store.submit(params())
    (old,) = await store.claim(["toy"], "c1")
    assert await store.start(old)
    await asyncio.sleep(0.4)  # the lease lapses: c2 takes the job over
    (new,) = await store.claim(["toy"], "c2")
    assert await store.start(new) and await store.complete(new, [blob(0)])
    stale = OutputBlob(index=0, data=b"stale", content_type="image/png", width=64, height=48, seed=7)
    assert not await store.complete(old, [stale])  # fenced: its staged bytes are not renamed into place...
    assert await store.output(job.id, 0) == b"img0"
    assert not [k async for k in store.redis.scan_iter(f"{store.prefix}:staged:*")]  # ...and are deleted


async def test_a_lost_staged_output_does_not_commit_the_job(store: Store):
    """If Redis loses a staged output between the SET and the commit (a restart without persistence), the job
    must not succeed pointing at missing bytes: it stays running under its lease and is redelivered."""
    job = await store.submit(params())
    (d,) = await store.claim(["toy"], "c1")
    assert await store.start(d)
    stage = store._stage_outputs

    async def stage_then_lose(delivery, outputs):
        pairs = await stage(delivery, outputs)
        await store.redis.delete(*(staged for staged, _ in pairs))
        return pairs

    store._stage_outputs = stage_then_lose
    assert not await store.complete(d, [blob(0)])
    assert (await store.get(job.id)).status == JobStatus.RUNNING


async def test_a_job_whose_worker_is_gone_ends_on_cancel_and_at_its_deadline(store: Store):
    """A running job whose lease expired (its worker killed, no pool left to reclaim it) used to stay running
    for ever: a cancel only set the flag, the deadline sweep skipped it. (The fixture's lease is 0.3 s.)"""
    gone = await store.submit(params())
    (d,) = await store.claim(["toy"], "c1")
    await store.start(d)
    await asyncio.sleep(0.4)  # no heartbeat: the lease expires
    assert (await store.cancel(gone.id)).status == JobStatus.CANCELED
    assert (await store.redis.xpending(store.stream_key("toy", "normal"), "pools"))["pending"] == 0
    assert not await store.complete(d, [blob()])  # had the worker lived, its writes are fenced
    # The deadline: while the pool holds the job (heartbeats) the sweep leaves it, and looks again a lease later.
    late = await store.submit(params(), deadline_at=time.time() + 0.1)
    (d,) = await store.claim(["toy"], "c1")
    await store.start(d)
    await asyncio.sleep(0.15)
    assert await store.heartbeat(d)
    assert await store.expire_due() == [] and (await store.get(late.id)).status == JobStatus.RUNNING
    await asyncio.sleep(0.45)  # the worker is gone: lease expired, and the recheck is due
    assert await store.expire_due() == [late.id]
    job = await store.get(late.id)
    assert job.status == JobStatus.CANCELED and job.error.code == "deadline_exceeded"
    assert "still running at its deadline" in job.error.message


async def test_the_jobs_of_a_model_no_pool_serves_fail_after_the_timeout(store: Store):
    from meshserve.service.unserved_sweep import CHECK_EVERY_S, UnservedSweep

    orphan, held = await store.submit(params()), await store.submit(params())
    deliveries = await store.claim(["toy"], "c1", max_jobs=2)
    for d in deliveries:
        await store.start(d)
    waiting = await store.submit(params())  # never delivered
    await asyncio.sleep(0.4)
    assert await store.heartbeat(deliveries[1])  # `held`'s worker is alive; `orphan`'s was killed
    settings = store.settings.model_copy(update={"unserved_timeout_s": 12.0})
    sweep = UnservedSweep(store, settings)
    await FakeWorker(store).register()  # a pool serves toy: nothing fails, however long
    assert await sweep.tick(now=0.0) == [] and await sweep.tick(now=100.0) == []
    await store.unregister_pool("pool-a")
    assert await sweep.tick(now=100.0 + CHECK_EVERY_S / 2) == []  # not due: one check per CHECK_EVERY_S
    assert await sweep.tick(now=105.0) == []  # unserved since the check at 100: 5 s < 12
    assert sorted(await sweep.tick(now=120.0)) == sorted([orphan.id, waiting.id])
    for job_id in (orphan.id, waiting.id):
        job = await store.get(job_id)
        assert job.status == JobStatus.FAILED and job.error.code == "no_pool", job
        assert "no pool served model 'toy' for 20 s" in job.error.message
    assert (await store.get(held.id)).status == JobStatus.RUNNING  # a pool holds it: left alone
    stream = store.stream_key("toy", "normal")
    assert (await store.redis.xpending(stream, "pools"))["pending"] == 1  # only held's entry
    assert (await store.queue_depths())[("toy", Priority.NORMAL)]["depth"] == 0  # waiting's entry was read
    assert await store.complete(deliveries[1], [blob()])

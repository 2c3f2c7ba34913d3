"""Batch formation: only compatible jobs share a batch, at most max_batch images, priority first, and the
wait for company is bounded by batch_wait_ms."""

import asyncio
import time
from dataclasses import dataclass

from meshserve.workers.batching import BatchKey, gather_batch, take_batch

K64 = BatchKey("m", (64, 64, None, 4, "euler"))


@dataclass
class W:
    name: str
    key: BatchKey = K64
    images: int = 1
    priority_rank: int = 1
    runs_alone: bool = False


def names(items):
    return [w.name for w in items]


def test_only_compatible_jobs_share_a_batch():
    pending = [
        W("a"),
        W("b", key=BatchKey("m", (64, 128, None, 4, "euler"))),
        W("c", key=BatchKey("m", (64, 64, None, 8, "euler"))),
        W("d", key=BatchKey("m", (64, 64, None, 4, "ddim"))),
        W("e", key=BatchKey("other", (64, 64, None, 4, "euler"))),
        W("f"),
    ]
    batch, rest = take_batch(pending, max_batch=8)
    assert names(batch) == ["a", "f"]
    assert names(rest) == ["b", "c", "d", "e"]


def test_max_batch_counts_images_and_big_jobs_run_alone():
    batch, rest = take_batch([W("a", images=3), W("b", images=2), W("c", images=1)], max_batch=4)
    assert names(batch) == ["a", "c"] and names(rest) == ["b"]
    batch, rest = take_batch([W("big", images=9), W("x")], max_batch=4)
    assert names(batch) == ["big"] and names(rest) == ["x"]


def test_highest_priority_anchors_the_batch():
    pending = [
        W("low", priority_rank=2),
        W("normal"),
        W("high", key=BatchKey("m", (8, 8, None, 1, None)), priority_rank=0),
    ]
    batch, rest = take_batch(pending, max_batch=4)
    assert names(batch) == ["high"] and names(rest) == ["normal", "low"]


def test_gather_waits_for_company_then_stops_at_the_deadline():
    arrivals = [[W("a")], [], [W("b")], [W("c", key=BatchKey("m", (8, 8, None, 4, None)))]]
    calls = []

    async def claim(max_jobs, block_ms):
        calls.append((max_jobs, block_ms))
        assert block_ms >= 1  # XREADGROUP BLOCK 0 would wait forever
        await asyncio.sleep(0.001)
        return arrivals.pop(0) if arrivals else []

    batch, rest = asyncio.run(gather_batch(claim, max_batch=4, batch_wait_ms=200, idle_block_ms=50))
    # "a" then an empty read (block elapsed: stop waiting) - b never joins.
    assert names(batch) == ["a"] and rest == []
    assert calls[0] == (1, 50) and calls[1][0] == 3  # the anchor, then the room it leaves

    arrivals[:] = [[W("a")], [W("b")], [W("c", key=BatchKey("m", (8, 8, None, 4, None)))], [W("d")]]
    batch, rest = asyncio.run(gather_batch(claim, max_batch=4, batch_wait_ms=200, idle_block_ms=50))
    # c is incompatible: it ends the wait and comes back as the rest (the job loop gives it back to the queue).
    assert names(batch) == ["a", "b"] and names(rest) == ["c"]


def test_gather_is_bounded_by_batch_wait():
    async def claim(max_jobs, block_ms):
        await asyncio.sleep(block_ms / 1000)
        return [W("x")]

    t0 = time.monotonic()
    batch, _ = asyncio.run(gather_batch(claim, max_batch=100, batch_wait_ms=50, idle_block_ms=10))
    elapsed = time.monotonic() - t0
    assert 2 <= len(batch) < 100
    assert elapsed < 0.2


def test_a_redelivered_job_runs_alone():
    """A job whose earlier delivery did not finish (its process died, or it raised) takes no company and joins
    none: if it kills its process again, only its own deliveries are spent."""
    suspect = W("s", runs_alone=True)
    batch, rest = take_batch([suspect, W("a"), W("b")], max_batch=4)
    assert names(batch) == ["s"] and names(rest) == ["a", "b"]
    batch, rest = take_batch([W("a"), suspect, W("b")], max_batch=4)
    assert names(batch) == ["a", "b"] and names(rest) == ["s"]
    high = W("h", priority_rank=0, runs_alone=True)
    batch, rest = take_batch([W("a"), high], max_batch=4)
    assert names(batch) == ["h"] and names(rest) == ["a"]

    claims = []

    async def claim(max_jobs, block_ms):
        claims.append(max_jobs)
        if len(claims) > 1:
            raise AssertionError("no company is claimed for a job that runs alone")
        return [suspect]

    batch, rest = asyncio.run(gather_batch(claim, max_batch=4, batch_wait_ms=200, idle_block_ms=10))
    assert names(batch) == ["s"] and rest == []


def _delivery(job_id, **params):
    from meshserve.service.contract import Delivery, Job, JobParams, JobStatus

    fields = dict(
        model="m", prompt="p", width=64, height=64, num_inference_steps=4, guidance_scale=5.0, seed=1
    )
    job = Job(
        id=job_id,
        model="m",
        status=JobStatus.QUEUED,
        params=JobParams(**{**fields, **params}),
        created_at=0.0,
    )
    return Delivery(job=job, stream="s", message_id="0-1", delivery_count=1, attempt=1, consumer="c")


def test_work_takes_its_batch_key_from_the_runner():
    """The batcher knows no field names: a family's static setting (here a text length carried in metadata)
    separates jobs whose size, steps and scheduler all agree; the default key covers frames too."""
    from meshserve.workers.fake_runner import FakeRunner
    from meshserve.workers.job_loop import Work

    def text_length_key(p):
        return (p.width, p.height, p.num_inference_steps, p.metadata.get("max_sequence_length", 512))

    a = Work.of(_delivery("a"), text_length_key)
    b = Work.of(_delivery("b", metadata={"max_sequence_length": 256}), text_length_key)
    c = Work.of(_delivery("c", n=2), text_length_key)
    assert a.key == BatchKey("m", (64, 64, 4, 512)) and c.images == 2
    batch, rest = take_batch([a, b, c], max_batch=8)
    assert names_of(batch) == ["a", "c"] and names_of(rest) == ["b"]

    default = FakeRunner("m").batch_key
    video = Work.of(_delivery("v", num_frames=17), default)
    image = Work.of(_delivery("i"), default)
    assert video.key != image.key


def names_of(works):
    return [w.job_id for w in works]


def test_an_aged_job_anchors_its_batch():
    """In a pool as in the claim (Settings.priority_aging_s): a low job that waited 2.5 aging periods ranks before
    a fresh high one, so it anchors the batch instead of being given back behind it; aging off: strict."""
    import time

    from meshserve.service.contract import Priority
    from meshserve.workers.job_loop import Work

    low, high = _delivery("low"), _delivery("high")
    low.job.priority, low.job.created_at = Priority.LOW, time.time() - 25
    high.job.priority, high.job.created_at = Priority.HIGH, time.time()
    aged = [Work.of(d, lambda p: (), priority_aging_s=10) for d in (high, low)]
    assert aged[1].priority_rank < -0.4 and -0.1 < aged[0].priority_rank <= 0
    assert names_of(take_batch(aged, max_batch=1)[0]) == ["low"]
    strict = [Work.of(d, lambda p: ()) for d in (high, low)]
    assert [w.priority_rank for w in strict] == [0, 2]
    assert names_of(take_batch(strict, max_batch=1)[0]) == ["high"]

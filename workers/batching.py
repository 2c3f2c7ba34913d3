"""Batching of compatible jobs: one device batch runs one compiled program, so its jobs must share the model
and the settings its runner's `batch_key` names (the pipeline's: shape bucket, frames, step count, scheduler,
and any family-specific static setting, e.g. Flux's text length; with image inputs the task - image-to-image,
inpaint - and the strength, which picks the start step of the whole call). Prompts, negative prompts, guidance,
Flux's `true_cfg_scale`, seeds, input images and n may differ (they are per-row data: a Flux batch mixing true-CFG
and plain jobs runs the true-CFG program and selects each row's own prediction). A batch holds at most `max_batch` images (the sum of
the jobs' n); a single job with more images than that runs alone.

A redelivered job (`runs_alone`: an earlier delivery ended without finishing, because its process died or the
run raised) runs in a batch of its own: a job that kills its process would otherwise take the jobs batched with it
down again on every delivery, until all of them were dead-lettered (an audit, 2026-11-28: one tenant's crashing
job failed two of another tenant's jobs with too_many_deliveries). Run alone, it spends only its own deliveries.

`take_batch` is the pure choice; `gather_batch` waits up to `batch_wait_ms` for company after the first job,
claiming more from the queue (a claim that fails then ends the gathering: the jobs in hand are claimed and run),
and returns whatever it claimed but could not fit for the caller to give back to the queue at once: held by this
pool, it would wait behind the batch while other pools sit idle (the audit's pool held three short jobs 5 s behind
a long one with the other pool idle, and ran a held low-priority job before a newer high one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


@dataclass(frozen=True)
class BatchKey:
    model: str
    settings: tuple  # Runner.batch_key(params): what must match within the model


class Batchable(Protocol):
    key: BatchKey
    images: int  # rows this job adds to the device batch
    priority_rank: float  # 0 = high, 1, 2 = low, less the waiting time's aging: lower ranks go first
    runs_alone: bool  # redelivered after a delivery that did not finish: no company


T = TypeVar("T", bound=Batchable)
log = logging.getLogger(__name__)


def take_batch(pending: Sequence[T], max_batch: int) -> tuple[list[T], list[T]]:
    """The first job of the best (lowest) rank present anchors the batch; later jobs with its key join while
    they fit, unless the anchor or the job runs alone. Returns (batch, the rest in their order)."""
    if not pending:
        return [], []
    ordered = sorted(pending, key=lambda w: w.priority_rank)  # stable: arrival order among equal ranks
    anchor = ordered[0]
    batch, rest, images = [anchor], [], anchor.images
    for item in ordered[1:]:
        joins = not anchor.runs_alone and not item.runs_alone and item.key == anchor.key
        if joins and images + item.images <= max_batch:
            batch.append(item)
            images += item.images
        else:
            rest.append(item)
    return batch, rest


async def gather_batch(
    claim: Callable[[int, int], Awaitable[Sequence[T]]],
    *,
    max_batch: int,
    batch_wait_ms: float,
    idle_block_ms: int,
    stopping: Callable[[], bool] = lambda: False,
) -> tuple[list[T], list[T]]:
    """Form the next batch. `claim(max_jobs, block_ms)` reads work (an empty result after block_ms when there is
    none): it blocks up to idle_block_ms for a first job, then keeps claiming until the batch is full or
    batch_wait_ms has passed since the first job was in hand. Returns (batch, the rest: claimed, not fitting).

    The first claim takes one job, the anchor, and later ones only the room its batch has left: a first claim of
    `max_batch` jobs gave back three of every four when each job filled a batch by itself (n = max_batch: an
    audit's 109 give-backs for 46 jobs)."""
    pending = list(await claim(1, idle_block_ms))
    if not pending:
        return [], []
    batch, rest = take_batch(pending, max_batch)
    deadline = time.monotonic() + batch_wait_ms / 1000.0
    while not stopping():
        room = max_batch - sum(w.images for w in batch)
        left_ms = (deadline - time.monotonic()) * 1000.0
        # Stop at a full batch, at the deadline, when the anchor runs alone, or when claims already brought jobs
        # that do not fit (the queue holds other work: run this batch, give the rest back).
        if room <= 0 or left_ms < 1.0 or batch[0].runs_alone or rest:
            break
        try:
            more = await claim(room, int(left_ms))
        except Exception as e:  # noqa: BLE001 - the jobs in hand are claimed: they run, whatever the claim raised
            # Raised out of here, they were lost to the caller but still held by the pool, whose heartbeats then
            # kept their leases alive for ever while nothing ran them (tests/workers/test_claim_failures.py).
            log.warning(
                "claiming company for a batch failed (%s); running the %d job(s) in hand", e, len(batch)
            )
            break
        if not more:
            break
        batch, rest = take_batch([*batch, *more], max_batch)
    return batch, rest

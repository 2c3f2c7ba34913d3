"""The registry sweep: what pools that are gone leave in Redis, dropped. A pool that crashes never removes its
registry entry (`P:pools`), and every process that ever read a model's stream left a consumer in its group; both
only grew (an audit's registry held 12 entries for 2 live pools, its group 17 consumers, 2026-11-28), and every
read of the registry (the API's catalog, /readyz, the queue metrics) reads them all.

Every deliverer runs it, every `CHECK_EVERY_S`, after the unserved sweep (service/webhooks/deliverer.py). Entries
and consumers go once nothing has been heard of them for FORGET_AFTER_STALE times `pool_stale_s` (150 s by default:
a pool heartbeats every few seconds, and an idle one blocks on its streams for at most 10 s at a time). A live pool
whose entry went (a long Redis stall) registers again at its next heartbeat; a consumer is recreated by its next
read; a consumer with pending entries is never deleted (its entries would be lost to the reclaim).
"""

from __future__ import annotations

import logging
import time

from meshserve.service.settings import Settings
from meshserve.service.store import Store

log = logging.getLogger(__name__)

CHECK_EVERY_S = 60.0
FORGET_AFTER_STALE = 10


class RegistrySweep:
    def __init__(self, store: Store, settings: Settings):
        self.store, self.settings = store, settings
        self._next_check = 0.0

    async def tick(self, now: float | None = None) -> tuple[list[str], int]:
        """One sweep when due: (the pool entries dropped, how many consumers were deleted)."""
        now = time.monotonic() if now is None else now
        if now < self._next_check:
            return [], 0
        self._next_check = now + CHECK_EVERY_S
        after = FORGET_AFTER_STALE * self.settings.pool_stale_s
        pools = await self.store.forget_pools(after)
        consumers = await self.store.forget_consumers(await self.store.models_with_jobs(), after)
        if pools:
            log.info(
                "registry sweep: dropped the entries of %d pools not seen for %.0f s: %s",
                len(pools),
                after,
                ", ".join(pools),
            )
        # (Live pools' consumers of streams they have not read lately go too: their next read recreates them.)
        if consumers:
            log.debug("registry sweep: deleted %d idle consumers", consumers)
        return pools, consumers

"""The unserved sweep: the jobs of a model that no pool serves any more end `failed` (code `no_pool`) once it has
gone unserved for `unserved_timeout_s`, instead of waiting for ever.

The API refuses a submit for a model without a ready pool, so what this ends are jobs accepted before the last
pool of their model went away: queued ones nobody will read, and running ones whose worker was killed (their
lease expired; a live pool would have reclaimed them). A pool that restarts within the timeout (its registry
entry back, ready or still warming up) finds them as before. Every deliverer runs the sweep (the API's own task,
or `meshserve webhooks`); the clock of a model starts when a deliverer first sees it unserved, so a restarted
deliverer waits the whole timeout again. The Redis side is one script per stream (`store_lua.FAIL_UNSERVED`),
which leaves alone any job a pool holds (a lease), so two deliverers or a pool coming back never race it.
"""

from __future__ import annotations

import logging
import time

from meshserve.service.settings import Settings
from meshserve.service.store import Store

log = logging.getLogger(__name__)

# How often the registry is compared with the models that have jobs (an HGETALL and an SMEMBERS).
CHECK_EVERY_S = 5.0


class UnservedSweep:
    def __init__(self, store: Store, settings: Settings):
        self.store, self.settings = store, settings
        # model -> when a pool last served it (or when the sweep first saw it without one)
        self._served_at: dict[str, float] = {}
        self._next_check = 0.0

    async def tick(self, now: float | None = None) -> list[str]:
        """One check when due: the ids of the jobs it failed."""
        timeout = self.settings.unserved_timeout_s
        now = time.monotonic() if now is None else now
        if timeout <= 0 or now < self._next_check:
            return []
        self._next_check = now + CHECK_EVERY_S
        served = {m.id for pool in await self.store.list_pools() for m in pool.models}
        failed: list[str] = []
        for model in await self.store.models_with_jobs():
            if model in served:
                self._served_at[model] = now
                continue
            unserved_s = now - self._served_at.setdefault(model, now)
            if unserved_s >= timeout:
                ended = await self.store.fail_unserved(model, unserved_s)
                if ended:
                    log.warning(
                        "model %s: no pool for %.0f s; %d jobs failed (no_pool)",
                        model,
                        unserved_s,
                        len(ended),
                    )
                failed += ended
        return failed

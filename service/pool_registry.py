"""The pool registry (`P:pools`): each pool's `PoolInfo` (models, sizes, mesh, readiness), written by the pool
itself and read by the API (/v1/models, /readyz, the admitted sizes) and the queue metrics."""

from __future__ import annotations

import socket
import time
from typing import Any

from meshserve.service.contract import PoolInfo
from meshserve.service.store_base import StoreBase


class PoolRegistry(StoreBase):
    async def register_pool(self, info: PoolInfo) -> None:
        """Add or replace a pool's registry entry (its `last_seen` is set to now)."""
        info = info.model_copy(update={"last_seen": time.time(), "host": info.host or socket.gethostname()})
        await self.redis.hset(self.pools_key, info.name, info.model_dump_json())

    async def heartbeat_pool(self, name: str, ready: bool | None = None) -> bool:
        """Refresh a pool's `last_seen` (and `ready` when given). False when the pool is not registered (e.g. Redis
        lost its data): the caller should `register_pool` again. Only the pool itself writes its entry."""
        raw = await self.redis.hget(self.pools_key, name)
        if raw is None:
            return False
        update: dict[str, Any] = {"last_seen": time.time()}
        if ready is not None:
            update["ready"] = ready
        info = PoolInfo.model_validate_json(raw).model_copy(update=update)
        await self.redis.hset(self.pools_key, name, info.model_dump_json())
        return True

    async def unregister_pool(self, name: str) -> None:
        """Remove a pool's entry (clean shutdown)."""
        await self.redis.hdel(self.pools_key, name)

    async def forget_pools(self, not_seen_for_s: float) -> list[str]:
        """Drop the entries of pools not seen for `not_seen_for_s` (crashed: a clean stop removes its own)."""
        return list(await self._run("FORGET_POOLS", [self.pools_key], [repr(time.time() - not_seen_for_s)]))

    async def list_pools(self, include_stale: bool = False) -> list[PoolInfo]:
        """Registered pools; those not seen for `pool_stale_s` are left out unless `include_stale`."""
        raw = await self.redis.hgetall(self.pools_key)
        cutoff = time.time() - self.settings.pool_stale_s
        pools = [PoolInfo.model_validate_json(v) for _, v in sorted(raw.items())]
        return [p for p in pools if include_stale or p.last_seen >= cutoff]

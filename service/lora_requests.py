"""The LoRA adapters added at run time (`POST /v1/loras`), per model: what every pool of the model should hold
besides its pools.yaml adapters. The API writes it; each pool reads it every `lora_poll_s` and applies the
difference between two batches (workers/adapters.py), then republishes its registry entry, where the API reads
the outcome (`ModelInfo.adapters`: loaded, or the error).

    P:loras:{model}   hash   adapter name -> {"source": ..., "load_into_transformer_2": bool, "added_at": unix s}
                             (JSON; an entry of an earlier release has no load_into_transformer_2: false)

Desired state rather than a stream of commands: a pool that starts later, or restarts, or missed a poll while
Redis was away, converges to the same adapters.
"""

from __future__ import annotations

import json
import time

from meshserve.service.contract import LoraSpec
from meshserve.service.store import Store


class LoraRequests:
    def __init__(self, store: Store):
        self.redis, self.prefix = store.redis, store.prefix

    def key(self, model: str) -> str:
        return f"{self.prefix}:loras:{model}"

    async def put(self, model: str, name: str, spec: LoraSpec) -> None:
        entry = json.dumps({**spec.model_dump(), "added_at": time.time()})
        await self.redis.hset(self.key(model), name, entry)

    async def delete(self, model: str, name: str) -> bool:
        return bool(await self.redis.hdel(self.key(model), name))

    async def get(self, model: str) -> dict[str, LoraSpec]:
        """Adapter name -> where it comes from and what it adapts, for one model."""
        raw = await self.redis.hgetall(self.key(model))
        return {name: LoraSpec.model_validate(json.loads(v)) for name, v in raw.items()}

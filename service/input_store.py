"""Stored image inputs: the API writes a request's (decoded, re-encoded) image and mask once, the job carries a
reference to them, and the worker that runs the job reads them back.

Megabytes never go into the job hash or the stream: both are read on every claim, list and poll, and a job hash
is copied into every reply. A reference is `redis:<token>` or `store:<token>`:

- `redis:<token>`: the PNG bytes at `P:input:<token>`, with the job's lifetime (`job_ttl_s`) from submission: an
  input never outlives its job's record, and a job still queued when its input expired fails with
  `input_expired` (never silently runs without it).
- `store:<token>`: when outputs go to an object store (`output_dir`), inputs go there too, at
  `<output_dir>/input-<token>/0.png`; their lifetime is the location's (the bucket lifecycle rule that
  docs/security.md asks for, matching `job_ttl_s`).

`<token>` is 128 random bits: knowing a job id does not name its input. Workers delete nothing: a job may be
delivered again (a lost lease) and needs its input each time.
"""

from __future__ import annotations

import re
import secrets

from meshserve.service.output_store import OutputStore

_REF = re.compile(r"^(redis|store):([A-Za-z0-9_-]{22})\Z")


class InputStore:
    def __init__(self, raw_redis, prefix: str, ttl_s: int, outputs: OutputStore | None = None):
        """raw_redis: a redis.asyncio client answering bytes (the store's `_raw`)."""
        self.redis, self.prefix, self.ttl_s, self.outputs = raw_redis, prefix, ttl_s, outputs

    @classmethod
    def of(cls, store) -> InputStore:
        """The inputs beside a `Store`'s jobs and outputs (same Redis, prefix, job lifetime, object store)."""
        return cls(store._raw, store.prefix, store.settings.job_ttl_s, store.outputs)

    def key(self, token: str) -> str:
        return f"{self.prefix}:input:{token}"

    async def put(self, data: bytes) -> str:
        """Store PNG bytes; returns the reference a job carries."""
        token = secrets.token_urlsafe(16)
        if self.outputs is not None:
            await self.outputs.put(f"input-{token}", 0, "png", data)
            return f"store:{token}"
        # In a pipeline, as the outputs are written: the client's deadline wrapper reads a plain command's
        # arguments as text (service/redis_client.py, _block_seconds), which binary bytes are not.
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.key(token), data, ex=self.ttl_s)
            await pipe.execute()
        return f"redis:{token}"

    async def get(self, ref: str) -> bytes | None:
        """The bytes a reference names, or None when they are gone (expired, deleted) or the reference is not
        one of ours."""
        m = _REF.match(ref or "")
        if m is None:
            return None
        backend, token = m.groups()
        if backend == "store":
            if self.outputs is None:
                return None
            return await self.outputs.get(f"input-{token}", 0, "png")
        data = await self.redis.get(self.key(token))
        return bytes(data) if data is not None else None

    async def delete(self, ref: str) -> None:
        m = _REF.match(ref or "")
        if m is None:
            return
        backend, token = m.groups()
        if backend == "store":
            if self.outputs is not None:
                await self.outputs.delete(f"input-{token}")
        else:
            await self.redis.delete(self.key(token))


def is_reference(ref: str | None) -> bool:
    return bool(ref) and _REF.match(ref) is not None

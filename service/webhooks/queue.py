"""The durable delivery queue, in Redis (prefix `P` as in service/store.py).

| key                | type       | holds |
|--------------------|------------|-------|
| `P:webhooks:due`   | sorted set | job id -> when its delivery is due (unix seconds) |
| `P:job:{id}`       | hash       | `webhook` (the `WebhookSpec` JSON) and `webhook_on`, written by SUBMIT; the delivery's state: `wh_status` (pending, delivering, delivered, failed), `wh_attempts`, `wh_error`, `wh_first` (when the job ended), `wh_body` (the JSON sent, fixed at the first attempt), `wh_claim` (the current claim's token) |

A job's end queues its delivery (status pending, due now) in the script that ends it (`finish`,
service/store_lua.py), so no crash can end a job without its webhook. A deliverer `claim`s due deliveries: one
script moves each one's score to now + `webhook_lease_s` (the lease: hidden from other deliverers until then),
counts the attempt and records a fresh claim token. Then it POSTs and `settle`s: delivered (removed), retry (due
again at the backoff's time) or failed (removed, the reason kept). A deliverer that dies mid-POST settles
nothing; its delivery is due again when the lease lapses and the next claim takes it (with a new token: a late
settle by the old claim is refused). Hence at least once, and the same `webhook-id` on every attempt.

The job hash lives `job_ttl_s` after the job ends; a claim extends it to `webhook_max_age_s` after the end (plus an
hour) so retries never outlive the job they describe.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis

# Fairness between tenants: the caller passes how many POSTs each tenant has in flight with it and the most one
# tenant may have; due deliveries of a tenant at that limit are passed over (they stay due), so one tenant's
# slow or failing receivers cannot hold every slot while another's wait (an audit delayed a webhook by a minute
# with 100 jobs whose receiver hung). At most SCAN due entries are looked at per claim.
# ARGV: P, now, lease s, max claims, token prefix, max age s, per-tenant limit, then (tenant, in flight) pairs.
# Returns {job id, token, attempts, spec, first, body, tenant}.
CLAIM = r"""
local P, now, lease = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local want, cap = tonumber(ARGV[4]), tonumber(ARGV[7])
local busy = {}
for i = 8, #ARGV, 2 do busy[ARGV[i]] = tonumber(ARGV[i + 1]) end
local due = P .. ':webhooks:due'
local out = {}
for i, id in ipairs(redis.call('ZRANGEBYSCORE', due, '-inf', now, 'LIMIT', 0, 1024)) do
  if #out >= want then break end
  local jk = P .. ':job:' .. id
  local h = redis.call('HMGET', jk, 'webhook', 'wh_status', 'wh_first', 'wh_body', 'tenant')
  local tenant = h[5] or ''
  if not h[1] or (h[2] ~= 'pending' and h[2] ~= 'delivering') then
    redis.call('ZREM', due, id)
  elseif (busy[tenant] or 0) < cap then
    busy[tenant] = (busy[tenant] or 0) + 1
    local token = ARGV[5] .. '-' .. i
    local attempts = redis.call('HINCRBY', jk, 'wh_attempts', 1)
    redis.call('HSET', jk, 'wh_status', 'delivering', 'wh_claim', token)
    redis.call('ZADD', due, now + lease, id)
    local first = tonumber(h[3]) or now
    redis.call('EXPIRE', jk, math.ceil(first + tonumber(ARGV[6]) - now) + 3600, 'GT')
    table.insert(out, {id, token, attempts, h[1], tostring(first), h[4] or '', tenant})
  end
end
return out
"""

# ARGV: P, job id, token, outcome (delivered | retry | failed), due at (retry), error. 1 settled, 0 not ours.
SETTLE = r"""
local P = ARGV[1]
local jk, due = P .. ':job:' .. ARGV[2], P .. ':webhooks:due'
if redis.call('HGET', jk, 'wh_claim') ~= ARGV[3] then return 0 end
redis.call('HDEL', jk, 'wh_claim')
if ARGV[4] == 'retry' then
  redis.call('HSET', jk, 'wh_status', 'pending', 'wh_error', ARGV[6])
  redis.call('ZADD', due, ARGV[5], ARGV[2])
else
  redis.call('HSET', jk, 'wh_status', ARGV[4], 'wh_error', ARGV[6])
  redis.call('ZREM', due, ARGV[2])
end
return 1
"""

# The body is fixed by the first attempt that gets this far (later ones send the same bytes). ARGV: P, job id,
# body. Returns the body kept, or nil when the job is gone.
KEEP_BODY = r"""
local jk = ARGV[1] .. ':job:' .. ARGV[2]
if redis.call('EXISTS', jk) == 0 then return nil end
redis.call('HSETNX', jk, 'wh_body', ARGV[3])
return redis.call('HGET', jk, 'wh_body')
"""


@dataclass(frozen=True)
class Claim:
    """One claimed delivery: the job, this claim's token, the attempt's number (1: first), the `WebhookSpec` JSON,
    when the job ended, and the body fixed by an earlier attempt ("" on the first)."""

    job_id: str
    token: str
    attempt: int
    spec: str
    first_at: float
    body: str
    tenant: str = ""


class WebhookQueue:
    def __init__(self, redis: aioredis.Redis, prefix: str):
        self.redis, self.prefix = redis, prefix
        self._claim = redis.register_script(CLAIM)
        self._settle = redis.register_script(SETTLE)
        self._keep_body = redis.register_script(KEEP_BODY)

    @property
    def due_key(self) -> str:
        return f"{self.prefix}:webhooks:due"

    async def claim(
        self,
        limit: int,
        lease_s: float,
        max_age_s: float,
        per_tenant: int | None = None,
        in_flight: dict[str, int] | None = None,
    ) -> list[Claim]:
        """Up to `limit` due deliveries, each hidden from other claims for `lease_s`; at most `per_tenant` of one
        tenant counting its `in_flight` ones (None: no such limit)."""
        cap = limit if per_tenant is None else per_tenant
        args = [self.prefix, repr(time.time()), lease_s, limit, secrets.token_hex(8), max_age_s, cap]
        for tenant, count in (in_flight or {}).items() if per_tenant is not None else ():
            args += [tenant, count]
        rows = await self._claim(keys=[], args=args)
        return [Claim(r[0], r[1], int(r[2]), r[3], float(r[4]), r[5], r[6]) for r in rows]

    async def keep_body(self, job_id: str, body: str) -> str | None:
        """Fix the delivery's body (the first caller wins); None when the job is gone."""
        return await self._keep_body(keys=[], args=[self.prefix, job_id, body])

    async def settle(
        self,
        claim: Claim,
        outcome: Literal["delivered", "retry", "failed"],
        error: str = "",
        due_at: float = 0.0,
    ) -> bool:
        """Record the attempt's outcome; False when the claim lapsed and another took the delivery."""
        args = [self.prefix, claim.job_id, claim.token, outcome, repr(due_at), error]
        return bool(int(await self._settle(keys=[], args=args)))

    async def pending(self) -> int:
        """Deliveries queued or being retried (the backlog)."""
        return int(await self.redis.zcard(self.due_key))

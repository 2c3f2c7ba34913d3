"""Per-tenant request rate: a token bucket in Redis, shared by every API replica, and its HTTP headers.

The bucket holds up to `rate_per_minute` tokens and refills at `rate_per_minute / 60` per second; a request takes
one token or is refused (429). It lives in the hash `P:ratelimit:{tenant}` (`tokens`, `ts`), updated by a Lua
function that the authentication script (`service/auth.py`) runs in the same call as the key lookup, so a
request costs one Redis round trip for both, the read-modify-write is atomic across replicas, and the clock is
Redis' own (`TIME`): replicas with skewed clocks still share one bucket correctly.

Headers: the IETF draft "RateLimit header fields for HTTP" (draft-ietf-httpapi-ratelimit-headers-10, structured
fields): `RateLimit-Policy: "per-minute";q=<quota>;w=60` and `RateLimit: "per-minute";r=<remaining>;t=<seconds>`,
where `t` is the seconds until the bucket is full again (until one token is back, on a 429, which is also the
`Retry-After`).
"""

from __future__ import annotations

from dataclasses import dataclass

POLICY = "per-minute"

# Lua: take one token from tenant `tenant`'s bucket of `rate` tokens per minute at time `now` (seconds, float).
# Returns allowed (1/0), tokens remaining (floor), seconds until full (or, refused, until the next token).
# The hash expires once a full refill has surely happened (60 s + 1), so idle tenants cost no memory.
TOKEN_BUCKET_LUA = r"""
local function take_token(bucket_key, rate, now)
  local per_s = rate / 60.0
  local b = redis.call('HMGET', bucket_key, 'tokens', 'ts')
  local tokens = tonumber(b[1])
  local ts = tonumber(b[2])
  if not tokens or not ts then tokens, ts = rate, now end
  tokens = math.min(rate, tokens + math.max(0, now - ts) * per_s)
  local allowed = 0
  if tokens >= 1 then
    tokens = tokens - 1
    allowed = 1
  end
  redis.call('HSET', bucket_key, 'tokens', string.format('%.6f', tokens), 'ts', string.format('%.6f', now))
  redis.call('EXPIRE', bucket_key, 61)
  local wait
  if allowed == 1 then wait = (rate - tokens) / per_s else wait = (1 - tokens) / per_s end
  return {allowed, math.floor(tokens), math.ceil(wait)}
end
"""


@dataclass(frozen=True)
class RateLimitState:
    """One request's view of its tenant's bucket."""

    quota: int  # tokens per minute
    remaining: int
    reset_s: int  # seconds until full (allowed) or until the next token (refused)
    allowed: bool

    def headers(self) -> dict[str, str]:
        out = {
            "RateLimit-Policy": f'"{POLICY}";q={self.quota};w=60',
            "RateLimit": f'"{POLICY}";r={max(0, self.remaining)};t={max(0, self.reset_s)}',
        }
        if not self.allowed:
            out["Retry-After"] = str(max(1, self.reset_s))
        return out

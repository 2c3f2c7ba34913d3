"""API keys and tenants: who is calling, and what they may use (`MESHSERVE_AUTH=keys`).

A key is `msk_` + 43 URL-safe characters (`secrets.token_urlsafe(32)`: 256 random bits). It is shown once, when
created (`meshserve keys create`), and stored only as its SHA-256 digest, in Redis (prefix `P` as in
`service/store.py`):

| key                    | type | holds |
|------------------------|------|-------|
| `P:apikey:{sha256 hex}` | hash | name, tenant, admin (0/1), rate_per_minute, max_active (0: no limit), digest, created_at, last_used_at, webhook_secret, webhook_secret_prev + webhook_secret_prev_until (a rotation's grace) |
| `P:apikeys`            | hash | key name -> digest (for `list` and `revoke`) |
| `P:ratelimit:{tenant}` | hash | the tenant's token bucket (`service/rate_limit.py`) |
| `P:active:{tenant}`    | set  | the tenant's queued and running job ids, pruned on read (`service/store_lua.py` SUBMIT) |

Each key created has its own webhook signing secret (`whsec_...`, service/webhooks/signing.py), shown once with the
key and kept in the record in the clear (an HMAC key must be: it signs, it is not compared). `rotate_webhook_secret`
replaces it and keeps the previous one for `ROTATION_GRACE_S`, during which deliveries carry both signatures
(Standard Webhooks' rotation), so receivers can switch without dropping a retry signed the old way.

Lookup is by digest (a preimage-resistant index: timing tells an attacker nothing about a valid key), and the
stored digest is compared again with `hmac.compare_digest`. Several keys may name one tenant (`--tenant`): that is
how keys are rotated without a gap (create the new key, move clients, revoke the old one). Jobs, idempotency keys,
the rate bucket and the active-job count belong to the tenant; the limits come from the key used.

No lookup is cached: every request runs one script (key lookup, `last_used_at`, the token bucket) in one round
trip, so a revoked key is refused by every replica on its next request. Measured on this 2-core machine with the
shared Redis on loopback: 0.15 ms median per authentication with the rate bucket, 0.05 ms for a bare PING
(docs/security.md), against a submit of about 1 ms; a cache would save 0.1 ms and delay revocation.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from meshserve.service.rate_limit import TOKEN_BUCKET_LUA, RateLimitState
from meshserve.service.settings import Settings
from meshserve.service.webhooks.signing import new_secret

KEY_PREFIX = "msk_"
_KEY_FORMAT = re.compile(r"^msk_[A-Za-z0-9_-]{43}\Z")
# Names end up in Redis keys and in `keys list`: a short, plain alphabet.
NAME_FORMAT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")


class ApiKeyError(Exception):
    """A key operation the caller can fix (unknown name, name taken, bad name)."""


@dataclass(frozen=True)
class Tenant:
    """The caller: `name` owns its jobs; `admin` may read any job."""

    name: str
    admin: bool = False
    rate_per_minute: int = 0  # 0: no rate limit
    max_active: int = 0  # 0: no limit on queued + running jobs
    key_name: str | None = None
    key_digest: str = ""  # the key's SHA-256 (what a job records to find its webhook secret); "": open mode


@dataclass(frozen=True)
class NewKey:
    """A key just created and its webhook secret: the only time either is seen."""

    key: str
    webhook_secret: str


def new_key() -> str:
    """A fresh API key (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str) -> str:
    """What is stored of a key: its SHA-256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def well_formed(key: str) -> bool:
    return bool(_KEY_FORMAT.match(key))


def parse_bearer(header: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header (scheme case-insensitive), or None."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    value = value.strip()
    return value or None


# ARGV: P, digest. Returns {'unknown'} or {'ok', name, tenant, admin, rate, max_active, digest, allowed, remaining,
# reset_s}. `last_used_at` is written at most once a second per key (a write per request would be wasted).
AUTHENTICATE = (
    TOKEN_BUCKET_LUA
    + r"""
local P = ARGV[1]
local rk = P .. ':apikey:' .. ARGV[2]
local rec = redis.call('HMGET', rk, 'name', 'tenant', 'admin', 'rate_per_minute', 'max_active', 'digest',
  'last_used_at')
if not rec[1] then return {'unknown'} end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
if now - (tonumber(rec[7]) or 0) >= 1 then redis.call('HSET', rk, 'last_used_at', string.format('%.3f', now)) end
local rate = tonumber(rec[4]) or 0
local bucket = {1, -1, 0}
if rate > 0 then bucket = take_token(P .. ':ratelimit:' .. rec[2], rate, now) end
return {'ok', rec[1], rec[2], rec[3], tostring(rate), rec[5] or '0', rec[6] or '', bucket[1], bucket[2], bucket[3]}
"""
)

# ARGV: P, name, digest, then the record's field/value pairs. Returns 1, or 0 when the name is taken.
CREATE = r"""
local P = ARGV[1]
if redis.call('HSETNX', P .. ':apikeys', ARGV[2], ARGV[3]) == 0 then return 0 end
local fields = {}
for i = 4, #ARGV do table.insert(fields, ARGV[i]) end
redis.call('HSET', P .. ':apikey:' .. ARGV[3], unpack(fields))
return 1
"""

# ARGV: P, name, digest, then the record's field/value pairs. Sets the key named `name` to this digest, dropping
# the record of a previous digest under that name (rotation). Returns 1 when it changed anything, 0 when it was
# already installed.
INSTALL = r"""
local P = ARGV[1]
local old = redis.call('HGET', P .. ':apikeys', ARGV[2])
if old == ARGV[3] and redis.call('EXISTS', P .. ':apikey:' .. old) == 1 then return 0 end
if old then redis.call('DEL', P .. ':apikey:' .. old) end
redis.call('HSET', P .. ':apikeys', ARGV[2], ARGV[3])
local fields = {}
for i = 4, #ARGV do table.insert(fields, ARGV[i]) end
redis.call('HSET', P .. ':apikey:' .. ARGV[3], unpack(fields))
return 1
"""

# ARGV: P, name. Returns 1 revoked, 0 unknown.
REVOKE = r"""
local P = ARGV[1]
local digest = redis.call('HGET', P .. ':apikeys', ARGV[2])
if not digest then return 0 end
redis.call('DEL', P .. ':apikey:' .. digest)
redis.call('HDEL', P .. ':apikeys', ARGV[2])
return 1
"""


# A rotated-out webhook secret keeps signing (beside the new one) this long: as long as a delivery is retried.
ROTATION_GRACE_S = 24 * 3600

# ARGV: P, name, new secret, now, grace s. Returns 1, or 0 when no key has that name.
ROTATE_WEBHOOK_SECRET = r"""
local P = ARGV[1]
local digest = redis.call('HGET', P .. ':apikeys', ARGV[2])
if not digest then return 0 end
local rk = P .. ':apikey:' .. digest
local old = redis.call('HGET', rk, 'webhook_secret')
if old then
  redis.call('HSET', rk, 'webhook_secret_prev', old, 'webhook_secret_prev_until', tonumber(ARGV[4]) + tonumber(ARGV[5]))
end
redis.call('HSET', rk, 'webhook_secret', ARGV[3])
return 1
"""


async def webhook_secrets(redis: aioredis.Redis, prefix: str, digest: str, settings: Settings) -> list[str]:
    """The secrets that sign a webhook of a job submitted with the key of this digest, the current one first: its
    own (and its previous one during a rotation's grace), else `settings.webhook_secret`; for a job submitted in
    open mode (digest ""), `settings.webhook_secret`. Empty: nothing may sign (the key was revoked, or no secret
    is configured)."""
    fallback = [settings.webhook_secret.get_secret_value()] if settings.webhook_secret is not None else []
    if not digest:
        return fallback
    name, current, prev, until = await redis.hmget(
        f"{prefix}:apikey:{digest}",
        ["name", "webhook_secret", "webhook_secret_prev", "webhook_secret_prev_until"],
    )
    if name is None:
        return []
    if not current:
        return fallback
    if prev and until and time.time() < float(until):
        return [current, prev]
    return [current]


class KeyStore:
    """API keys in Redis: create / list / revoke (the `meshserve keys` command) and `authenticate` (the API)."""

    def __init__(self, redis: aioredis.Redis, prefix: str):
        self.redis, self.prefix = redis, prefix
        self._authenticate = redis.register_script(AUTHENTICATE)
        self._create = redis.register_script(CREATE)
        self._revoke = redis.register_script(REVOKE)
        self._install = redis.register_script(INSTALL)
        self._rotate = redis.register_script(ROTATE_WEBHOOK_SECRET)

    async def create(
        self,
        name: str,
        *,
        tenant: str | None = None,
        rate_per_minute: int,
        max_active: int,
        admin: bool = False,
    ) -> str:
        """Store a new key for `tenant` (default: `name`) and return it: the only time it is ever seen."""
        new = await self.create_key(
            name, tenant=tenant, rate_per_minute=rate_per_minute, max_active=max_active, admin=admin
        )
        return new.key

    async def create_key(
        self,
        name: str,
        *,
        tenant: str | None = None,
        rate_per_minute: int,
        max_active: int,
        admin: bool = False,
    ) -> NewKey:
        """`create`, returning the key's webhook secret too."""
        tenant = tenant or name
        for what, value in (("name", name), ("tenant", tenant)):
            if not NAME_FORMAT.match(value):
                raise ApiKeyError(
                    f"{what} {value!r} must be 1-64 of A-Z a-z 0-9 . _ - (starting alphanumeric)"
                )
        if rate_per_minute < 0 or max_active < 0:
            raise ApiKeyError("--rate-per-minute and --max-active must be >= 0 (0: no limit)")
        key, secret = new_key(), new_secret()
        digest = key_digest(key)
        record = {
            "name": name,
            "tenant": tenant,
            "admin": "1" if admin else "0",
            "rate_per_minute": str(rate_per_minute),
            "max_active": str(max_active),
            "digest": digest,
            "created_at": f"{time.time():.3f}",
            "webhook_secret": secret,
        }
        args = [self.prefix, name, digest, *(x for kv in record.items() for x in kv)]
        if not int(await self._create(keys=[], args=args)):
            raise ApiKeyError(f"a key named {name!r} exists; revoke it first or pick another name")
        return NewKey(key, secret)

    async def rotate_webhook_secret(self, name: str) -> str:
        """Give the key named `name` a new webhook secret and return it (shown this once); the previous one keeps
        signing beside it for `ROTATION_GRACE_S`. Raises ApiKeyError for an unknown name."""
        secret = new_secret()
        args = [self.prefix, name, secret, f"{time.time():.3f}", ROTATION_GRACE_S]
        if not int(await self._rotate(keys=[], args=args)):
            raise ApiKeyError(f"no key named {name!r}")
        return secret

    async def install(self, name: str, key: str, *, tenant: str, admin: bool) -> bool:
        """Make `key` (given, e.g. from a Secret) the key named `name`, without limits, replacing a previous key of
        that name. True when something changed."""
        if not well_formed(key):
            raise ApiKeyError(f"the key for {name!r} is malformed: `msk_` and 43 URL-safe base64 characters")
        digest = key_digest(key)
        record = {
            "name": name,
            "tenant": tenant,
            "admin": "1" if admin else "0",
            "rate_per_minute": "0",
            "max_active": "0",
            "digest": digest,
            "created_at": f"{time.time():.3f}",
        }
        args = [self.prefix, name, digest, *(x for kv in record.items() for x in kv)]
        return bool(int(await self._install(keys=[], args=args)))

    async def revoke(self, name: str) -> bool:
        """Delete the key named `name` (False: no such key). Every replica refuses it from its next request."""
        return bool(int(await self._revoke(keys=[], args=[self.prefix, name])))

    async def list(self) -> list[dict[str, str]]:
        """Every key's record (never the key: only its name, tenant, limits and times), by name."""
        index = await self.redis.hgetall(f"{self.prefix}:apikeys")
        out = []
        for name, digest in sorted(index.items()):
            rec = await self.redis.hgetall(f"{self.prefix}:apikey:{digest}")
            if rec:
                for secret in ("digest", "webhook_secret", "webhook_secret_prev"):
                    rec.pop(secret, None)
                out.append({"name": name, **rec})
        return out

    async def still_valid(self, digest: str) -> bool:
        """Whether the key with this digest still exists (not revoked); takes no token. For requests that last
        (an SSE stream) to notice a revocation."""
        return bool(await self.redis.exists(f"{self.prefix}:apikey:{digest}"))

    async def authenticate(self, key: str) -> tuple[Tenant, RateLimitState | None] | None:
        """The tenant of a well-formed, known key and its rate state (None: no rate limit), or None (unknown,
        revoked or malformed: the caller answers 401). Takes one token from the tenant's bucket."""
        if not well_formed(key):
            return None
        digest = key_digest(key)
        res = await self._authenticate(keys=[], args=[self.prefix, digest])
        if res[0] != "ok" or not hmac.compare_digest(str(res[6]), digest):
            return None
        _, name, tenant, admin, rate, max_active, _, allowed, remaining, reset_s = res
        rate = int(rate)
        who = Tenant(
            name=tenant,
            admin=admin == "1",
            rate_per_minute=rate,
            max_active=int(max_active or 0),
            key_name=name,
            key_digest=digest,
        )
        state = None
        if rate > 0:
            state = RateLimitState(
                quota=rate, remaining=int(remaining), reset_s=int(reset_s), allowed=bool(int(allowed))
            )
        return who, state

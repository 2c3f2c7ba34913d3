"""`meshserve keys create | list | revoke`: API keys in the Redis the API reads (`service/auth.py`).

    meshserve keys create NAME [--tenant T] [--rate-per-minute N] [--max-active N] [--admin] [--redis-url URL]
    meshserve keys list [--redis-url URL]
    meshserve keys revoke NAME [--redis-url URL]
    meshserve keys rotate-webhook-secret NAME [--redis-url URL]

`create` prints the key's webhook signing secret (`webhook secret: whsec_...`) and then the new key alone on its
last stdout line (scripts take `| tail -n 1`): both are shown this once, and the key is stored only as its SHA-256.
`rotate-webhook-secret` prints a new secret alone on its last line; the old one signs beside it for a day
(service/auth.py). `list` shows names, tenants, limits and times, never a key. `revoke` deletes the key;
every API replica refuses it from its next request (nothing caches a lookup). The key prefix (`MESHSERVE_KEY_PREFIX`)
and the default limits (`MESHSERVE_KEY_RATE_PER_MINUTE`, `MESHSERVE_KEY_MAX_ACTIVE`) come from the environment like
the API's. Imports no JAX.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from urllib.parse import urlsplit, urlunsplit

from meshserve.service.settings import Settings


def add_keys_parser(sub: argparse._SubParsersAction, on_error: type[Exception]) -> None:
    """Add `keys` and its subcommands to the `meshserve` parser; user errors are raised as `on_error`."""
    keys = sub.add_parser("keys", help="create, list and revoke API keys (MESHSERVE_AUTH=keys)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--redis-url", default=None, help="default: $MESHSERVE_REDIS_URL or redis://127.0.0.1:6379/0"
        )

    create = keys_sub.add_parser("create", help="create a key; prints it (once) on the last line")
    create.add_argument("name")
    create.add_argument("--tenant", default=None, help="the tenant the key acts for (default: NAME)")
    create.add_argument("--rate-per-minute", type=int, default=None, help="requests per minute, 0: no limit")
    create.add_argument("--max-active", type=int, default=None, help="queued + running jobs, 0: no limit")
    create.add_argument("--admin", action="store_true", help="may read every tenant's jobs")
    common(create)
    listing = keys_sub.add_parser("list", help="names, tenants, limits, created, last used (never the keys)")
    common(listing)
    revoke = keys_sub.add_parser("revoke", help="delete a key: refused everywhere from the next request")
    revoke.add_argument("name")
    common(revoke)
    rotate = keys_sub.add_parser(
        "rotate-webhook-secret",
        help="a new webhook signing secret (printed once); the old one signs for a day more",
    )
    rotate.add_argument("name")
    common(rotate)
    keys.set_defaults(func=lambda args: run_keys(args, on_error))


def _out(line: str) -> None:
    # The command's output is for a person or a script (`| tail -n 1`), not a log.
    sys.stdout.write(line + "\n")


def _settings(args: argparse.Namespace) -> Settings:
    return Settings(redis_url=args.redis_url) if args.redis_url else Settings()


def _when(value: str | None) -> str:
    if not value:
        return "never"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(value)))


async def _run(args: argparse.Namespace, settings: Settings) -> int:
    import redis.asyncio as aioredis

    from meshserve.service.auth import ApiKeyError, KeyStore

    # A short-lived command: redis-py's own socket timeout (the command deadline) is enough here; the
    # long-running processes use service/redis_client.py's deadlines instead (why: its docstring).
    client = aioredis.Redis.from_url(
        settings.redis_url,
        decode_responses=True,
        socket_connect_timeout=settings.redis_connect_timeout_s,
        socket_timeout=settings.redis_command_timeout_s,
    )
    store = KeyStore(client, settings.key_prefix)
    try:
        if args.keys_command == "create":
            rate = settings.key_rate_per_minute if args.rate_per_minute is None else args.rate_per_minute
            active = settings.key_max_active if args.max_active is None else args.max_active
            new = await store.create_key(
                args.name, tenant=args.tenant, rate_per_minute=rate, max_active=active, admin=args.admin
            )
            limits = f"{rate or 'unlimited'} requests/min, {active or 'unlimited'} active jobs"
            _out(
                f"created key {args.name!r} for tenant {args.tenant or args.name!r}"
                f"{' (admin)' if args.admin else ''}: {limits}. It and its webhook secret are shown once; "
                "store them now:"
            )
            _out(f"webhook secret: {new.webhook_secret}")
            _out(new.key)
        elif args.keys_command == "rotate-webhook-secret":
            secret = await store.rotate_webhook_secret(args.name)
            _out(f"new webhook secret for key {args.name!r} (the old one signs beside it for a day):")
            _out(secret)
        elif args.keys_command == "list":
            rows = await store.list()
            header = ("NAME", "TENANT", "ADMIN", "RATE/MIN", "MAX_ACTIVE", "CREATED", "LAST_USED")
            table = [header] + [
                (
                    r["name"],
                    r.get("tenant", ""),
                    "yes" if r.get("admin") == "1" else "no",
                    r.get("rate_per_minute", "0"),
                    r.get("max_active", "0"),
                    _when(r.get("created_at")),
                    _when(r.get("last_used_at")),
                )
                for r in rows
            ]
            widths = [max(len(row[i]) for row in table) for i in range(len(header))]
            for row in table:
                _out("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        else:
            if not await store.revoke(args.name):
                raise ApiKeyError(f"no key named {args.name!r}")
            _out(f"revoked key {args.name!r}")
    finally:
        await client.aclose()
    return 0


def run_keys(args: argparse.Namespace, on_error: type[Exception]) -> int:
    from redis.exceptions import RedisError

    from meshserve.service.auth import ApiKeyError

    settings = _settings(args)
    try:
        return asyncio.run(_run(args, settings))
    except ApiKeyError as e:
        raise on_error(str(e)) from None
    except (RedisError, OSError) as e:
        raise on_error(f"cannot reach Redis at {_without_password(settings.redis_url)}: {e}") from None


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(
        parts._replace(netloc=f"{parts.username or ''}:***@{parts.hostname}:{parts.port or 6379}")
    )

"""The store's Redis clients: every command has a deadline, idle connections are probed, and TCP keepalive is on.

A Redis that stops answering must be an error, never a wait for ever: a half-open connection (a partition, a NAT
or load balancer that forgot the flow, a host gone without a reset) looks exactly like a slow reply. So every
command, script and pipeline runs under a deadline (`Settings.redis_command_timeout_s`; a blocking XREAD /
XREADGROUP gets its BLOCK time on top). When it passes, the connection waited on is dropped (redis-py disconnects
on any exception inside a read or a send), and so are the pool's idle connections (a silent path usually silences
every flow on it, and each would cost a deadline to find out); the caller gets `redis.exceptions.TimeoutError`,
and the next command connects afresh.

The deadline is an `asyncio.timeout` around the whole command, not redis-py's `socket_timeout`: with that one set,
redis-py wraps every send in `asyncio.wait_for`, which on Python 3.11 swallows a task's cancellation when the send
has just finished, so workers and SSE streams could not be stopped (redis-py 8 even sets a 5 s `socket_timeout`
unless told None: with it, 41 to 47 of 60 cancelled GET/SET and XREADGROUP loops kept running here).
`asyncio.timeout` counts the task's cancel requests and lets an outside cancel through: all 60 end
(tests/service/test_redis_client.py).

Below the deadline, two cheaper guards: a pooled connection idle for longer than `health_check_interval` is PINGed
before it is used (so a connection that died while idle is replaced without failing the command), and TCP keepalive
probes an idle connection (a blocking read included) every few seconds, which both keeps NAT mappings alive and
makes the kernel report a peer that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import ConstantBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Blocking reads (XREAD/XREADGROUP BLOCK) last at most this long per call; callers loop.
MAX_BLOCK_MS = 10_000

# Probe a connection idle for 10 s every 5 s, give up after 3 unanswered probes: a dead peer is seen within ~25 s of
# silence even when no command is waiting on it. (Linux names; other platforms keep what they have.)
_KEEPALIVE = {
    getattr(socket, name): value
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
    if hasattr(socket, name)
}


@contextlib.asynccontextmanager
async def deadline(seconds: float | None, what: str) -> AsyncIterator[None]:
    """Run the body within `seconds` (None: no limit); past it, raise redis' TimeoutError (a RedisError, which every
    caller of the store already handles) instead of the builtin one."""
    if seconds is None:
        yield
        return
    timeout = asyncio.timeout(seconds)
    try:
        async with timeout:
            yield
    except TimeoutError:
        if not timeout.expired():  # an OSError subclass from below, not our deadline
            raise
        raise RedisTimeoutError(f"Redis did not answer {what} within {seconds:g} s") from None


def _block_seconds(args: tuple) -> float | None:
    """The BLOCK time of an XREAD/XREADGROUP command, in seconds (0: none); None for BLOCK 0 (for ever)."""
    words = [
        (a.decode() if isinstance(a, bytes) else a).upper() if isinstance(a, str | bytes) else a for a in args
    ]
    options = words[: words.index("STREAMS")] if "STREAMS" in words else words  # not a key named "block"
    if words[0] not in ("XREAD", "XREADGROUP") or "BLOCK" not in options:
        return 0.0
    ms = int(words[options.index("BLOCK") + 1])
    return ms / 1000 if ms > 0 else None


async def _drop_idle_connections(pool: aioredis.ConnectionPool) -> None:
    """After a deadline passed: the pool's idle connections probably share the silent path (a NAT or a partition
    drops every flow at once), and each would cost a whole deadline to find out. Close them; they reconnect on
    their next use, which costs one connect."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(2.0):
            await pool.disconnect(inuse_connections=False)


class _DeadlinePipeline(Pipeline):
    command_timeout_s: float | None = None

    async def execute(self, raise_on_error: bool = True):
        try:
            async with deadline(self.command_timeout_s, f"a pipeline of {len(self.command_stack)} commands"):
                return await super().execute(raise_on_error)
        except RedisTimeoutError:
            await _drop_idle_connections(self.connection_pool)
            raise


class DeadlineRedis(aioredis.Redis):
    """`redis.asyncio.Redis` whose every command (scripts and pipelines included) has a deadline:
    `command_timeout_s`, plus the BLOCK time of a blocking stream read. Build it with `connect`."""

    command_timeout_s: float | None = None

    async def execute_command(self, *args, **options):
        if self.command_timeout_s is None:
            return await super().execute_command(*args, **options)
        block = _block_seconds(args)
        seconds = None if block is None else self.command_timeout_s + block
        try:
            async with deadline(seconds, str(args[0])):
                return await super().execute_command(*args, **options)
        except RedisTimeoutError:
            await _drop_idle_connections(self.connection_pool)
            raise

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        pipe = _DeadlinePipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.command_timeout_s = self.command_timeout_s
        return pipe


# redis-py's plain pool's size, kept; beyond it commands queue (connect's docstring).
DEFAULT_MAX_CONNECTIONS = 100
# How long a command without a deadline waits for a pooled connection.
POOL_WAIT_S = 20.0


def connect(
    url: str,
    *,
    command_timeout_s: float | None,
    connect_timeout_s: float,
    health_check_interval_s: float,
    decode_responses: bool = True,
    max_connections: int | None = None,
) -> DeadlineRedis:
    """A client (with its own connection pool, of at most `max_connections`) for `url`. Connecting is not
    attempted until the first command. A command that finds every connection busy waits for one, its deadline
    bounding the wait: with redis-py's plain pool, which fails at once, an audit's 300 concurrent job reads got
    164 x 503 "Too many connections" from a healthy Redis (and /readyz went unready under load)."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections or DEFAULT_MAX_CONNECTIONS,
        timeout=command_timeout_s or POOL_WAIT_S,
        decode_responses=decode_responses,
        socket_connect_timeout=connect_timeout_s,
        # No socket_timeout (redis-py 8 sets 5 s unless told None): the deadline replaces it (module docstring).
        socket_timeout=None,
        socket_keepalive=True,
        socket_keepalive_options=_KEEPALIVE,
        health_check_interval=health_check_interval_s,
        # One quick retry covers a pooled connection that died with a restarted Redis, or a connect that timed
        # out; more would only delay the error while Redis is really down. (The deadline spans the retry too.)
        retry=Retry(ConstantBackoff(0.05), 1),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    client = DeadlineRedis.from_pool(pool)  # the client owns the pool: closing it closes the connections
    client.command_timeout_s = command_timeout_s
    return client

"""The store's Redis clients (service/redis_client.py) on the real Redis: a connection that goes silent without
closing (a half-open TCP connection, made by a proxy that stops forwarding) is an error at the command's deadline
and is replaced; a blocking read gets its BLOCK time on top; and deadlines never swallow a task's cancellation."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlparse

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from meshserve.service.store import GROUP, Store
from tests.service.conftest import REDIS_URL
from tests.service.tcp_proxy import BlackHoleProxy

pytestmark = pytest.mark.anyio


async def test_a_silent_connection_fails_at_the_deadline_and_is_replaced(make_settings):
    target = urlparse(REDIS_URL)
    proxy = await BlackHoleProxy.start(target.hostname or "127.0.0.1", target.port or 6379)
    store = Store(make_settings(redis_url=proxy.url, redis_command_timeout_s=0.5))
    try:
        assert await store.ping()
        proxy.stall()  # the pooled connection goes silent, and stays open
        t0 = time.monotonic()
        with pytest.raises(RedisTimeoutError):
            await store.ping()
        assert 0.45 < time.monotonic() - t0 < 2.0
        t0 = time.monotonic()
        assert await store.ping()  # a fresh connection
        print(f"replaced in {time.monotonic() - t0:.3f} s after the timeout")
        assert proxy.first_reply_after_stall is not None and proxy.connections >= 2

        # A blocking read is given its BLOCK time on top of the deadline, on a healthy connection and on a silent one.
        t0 = time.monotonic()
        assert await store.events("0" * 32, block_ms=1200) == []
        assert 1.1 < time.monotonic() - t0 < 3.0
        proxy.stall()
        t0 = time.monotonic()
        with pytest.raises(RedisTimeoutError):
            await store.events("0" * 32, block_ms=1200)
        assert 1.6 < time.monotonic() - t0 < 4.0

        # Scripts and pipelines too; and while new connections are black-holed as well (a partition), each command
        # fails at its deadline until the partition heals.
        proxy.partition()
        with pytest.raises(RedisTimeoutError):
            await store.cancel("0" * 32)  # the CANCEL script
        async with store.redis.pipeline(transaction=False) as pipe:
            pipe.get(f"{store.prefix}:a")
            pipe.get(f"{store.prefix}:b")
            t0 = time.monotonic()
            with pytest.raises(RedisTimeoutError):
                await pipe.execute()
            assert 0.45 < time.monotonic() - t0 < 2.0
        proxy.heal()
        assert await store.redis.get(f"{store.prefix}:a") is None
    finally:
        await store.close()
        await proxy.close()


async def test_deadlines_never_swallow_a_cancellation(store: Store):
    """redis-py's own `socket_timeout` wraps sends in `asyncio.wait_for`, which on Python 3.11 can swallow a
    cancellation: with it (5 s, redis-py 8's default) 41 to 47 of these 60 loops kept running in each of 5 runs.
    The store's deadline is an `asyncio.timeout`: every cancelled loop ends (0 of 60, 5 runs)."""
    stream = store.stream_key("toy", "normal")
    await store.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)

    async def get_set(i: int) -> None:
        while True:
            await store.redis.set(f"{store.prefix}:k{i}", i)
            await store.redis.get(f"{store.prefix}:k{i}")

    async def blocking_read(i: int) -> None:
        while True:
            await store.redis.xreadgroup(GROUP, f"c{i}", {stream: ">"}, count=1, block=20)

    tasks = [asyncio.create_task(get_set(i)) for i in range(40)]
    tasks += [asyncio.create_task(blocking_read(i)) for i in range(20)]
    await asyncio.sleep(0.3)
    for t in tasks:  # each at another moment of its loop
        t.cancel()
        await asyncio.sleep(0.002)
    done, pending = await asyncio.wait(tasks, timeout=5)
    assert not pending, f"{len(pending)} of {len(tasks)} cancelled loops kept running"
    assert all(t.cancelled() for t in done)


async def test_more_concurrent_commands_than_connections_wait_for_one():
    """A burst beyond the pool's size queues for a connection (an audit's 300 concurrent job reads got 164 x 503
    "Too many connections" from redis-py's plain pool, which fails at once)."""
    from meshserve.service.redis_client import connect

    client = connect(
        REDIS_URL,
        command_timeout_s=5.0,
        connect_timeout_s=1.0,
        health_check_interval_s=0,
        max_connections=4,
    )
    try:
        answers = await asyncio.gather(*(client.ping() for _ in range(200)))
        assert all(answers)
        assert len(client.connection_pool._in_use_connections) == 0
        assert len(client.connection_pool._available_connections) <= 4
    finally:
        await client.aclose()

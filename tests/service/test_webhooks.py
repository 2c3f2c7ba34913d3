"""Webhooks (issue 23 §1): signed per Standard Webhooks, delivered at least once to a real local HTTP receiver
(failing N times then 2xx; 410; a redirect), the same `webhook-id` on every attempt, given up and recorded on the
job, the address rules at submission and again at delivery, per-key secrets and their rotation, and a deliverer
SIGKILLed mid-POST whose delivery the next deliverer makes. Signatures are checked by `verify` below, written
from the specification and sharing no code with service/webhooks/signing.py."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import redis
from prometheus_client import REGISTRY

from meshserve.service.auth import KeyStore
from meshserve.service.contract import JobParams, JobStatus
from meshserve.service.webhooks import signing
from meshserve.service.webhooks.deliverer import Deliverer, backoff_s
from meshserve.service.webhooks.queue import WebhookQueue
from meshserve.service.webhooks.spec import WebhookSpec
from tests.service.conftest import FakeWorker, api_client

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
SECRET = "whsec_" + base64.b64encode(b"meshserve-webhook-tests-secret!!").decode()  # 32 bytes
FAST = dict(
    webhook_secret=SECRET,
    webhook_allow_private=True,
    webhook_retry_base_s=0.05,
    webhook_retry_max_s=0.2,
    webhook_poll_s=0.05,
    webhook_timeout_s=5.0,
)


def verify(secret: str, headers: dict[str, str], body: bytes, tolerance_s: int = 300) -> bool:
    """A receiver's check, from the Standard Webhooks specification: HMAC-SHA256 keyed with the base64-decoded
    part of `whsec_...` over `{id}.{timestamp}.{body}`, base64; any `v1,` signature of the space-separated list
    may match; the timestamp must be recent."""
    key = base64.b64decode(secret.split("_", 1)[1])
    msg_id, ts = headers["webhook-id"], headers["webhook-timestamp"]
    if abs(time.time() - int(ts)) > tolerance_s:
        return False
    expected = base64.b64encode(hmac.new(key, f"{msg_id}.{ts}.".encode() + body, hashlib.sha256).digest())
    given = [p.split(",", 1)[1] for p in headers["webhook-signature"].split(" ") if p.startswith("v1,")]
    return any(hmac.compare_digest(expected.decode(), g) for g in given)


class Receiver:
    """A real HTTP server on 127.0.0.1 answering each POST with the next of `statuses` (the last one repeats);
    `hold`: the 1-based request numbers it keeps open (answering nothing) until `release()`. `body`: what follows
    the status and headers: "ok" (2 bytes), "huge" (declares 50 MiB and writes until the reader hangs up) or
    "trickle" (declares 100 bytes and sends one every 0.5 s)."""

    def __init__(
        self,
        statuses: list[int],
        hold: tuple[int, ...] = (),
        location: str | None = None,
        body: str = "ok",
    ):
        self.statuses, self.hold, self.location, self.body = statuses, hold, location, body
        self.requests: list[dict] = []
        self.released = threading.Event()
        self.arrived = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver.requests.append(
                    {
                        "path": self.path,
                        "headers": {k.lower(): v for k, v in self.headers.items()},
                        "body": body,
                    }
                )
                n = len(receiver.requests)
                receiver.arrived.set()
                if n in receiver.hold:
                    receiver.released.wait(30)
                    return
                status = receiver.statuses[min(n, len(receiver.statuses)) - 1]
                self.send_response(status)
                if receiver.location:
                    self.send_header("Location", receiver.location)
                try:
                    if receiver.body == "huge":
                        self.send_header("Content-Length", str(50 << 20))
                        self.end_headers()
                        for _ in range(50):
                            self.wfile.write(b"y" * (1 << 20))
                    elif receiver.body == "trickle":
                        self.send_header("Content-Length", "100")
                        self.end_headers()
                        for _ in range(100):
                            self.wfile.write(b"x")
                            self.wfile.flush()
                            time.sleep(0.5)
                    else:
                        self.send_header("Content-Length", "2")
                        self.end_headers()
                        self.wfile.write(b"ok")
                except OSError:  # the deliverer hung up: it had what it needed
                    pass

            def log_message(self, *args):  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def release(self):
        self.released.set()

    def close(self):
        self.release()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver_factory():
    made: list[Receiver] = []

    def make(*args, **kw) -> Receiver:
        made.append(Receiver(*args, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _metric(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


async def _until(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"no {what} within {timeout} s")


async def _webhook_settled(store, job_id: str, timeout: float = 10.0):
    async def settled():
        job = await store.get(job_id)
        return job if job and job.webhook and job.webhook.status != "pending" else None

    return await _until(settled, timeout, f"settled webhook for {job_id}")


def _params(**kw) -> JobParams:
    base = dict(
        model="toy", prompt="a cat", width=64, height=48, num_inference_steps=2, guidance_scale=5.0, seed=1
    )
    return JobParams(**{**base, **kw})


# -- signing ------------------------------------------------------------------------------------------------


def test_signature_matches_the_standard_webhooks_test_vector():
    # The vector the Standard Webhooks reference libraries test against.
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = b'{"test": 2432232314}'
    sig = signing.signature(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body)
    assert sig == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    headers = signing.headers(
        [signing.new_secret(), secret], "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body
    )
    assert verify(secret, headers, body, tolerance_s=10**10)  # the second signature of two verifies
    assert not verify(secret, headers, body + b" ", tolerance_s=10**10)
    new = signing.new_secret()
    assert new.startswith("whsec_") and len(signing.secret_key(new)) == 24
    with pytest.raises(signing.BadSecret):
        signing.secret_key("whsec_c2hvcnQ=")  # 5 bytes


def test_backoff_is_exponential_with_jitter_and_capped(make_settings):
    s = make_settings(webhook_retry_base_s=2.0, webhook_retry_max_s=3600.0)
    firsts = [backoff_s(1, s) for _ in range(200)]
    assert 1.0 <= min(firsts) and max(firsts) < 3.0 and len(set(firsts)) > 100  # within seconds, jittered
    assert 4.0 <= backoff_s(3, s) < 12.0  # 2 s doubled twice, times [0.5, 1.5)
    assert 1800.0 <= backoff_s(30, s) < 5400.0  # capped at an hour (times the jitter)


# -- delivery through the API -------------------------------------------------------------------------------


async def test_delivered_after_failures_with_the_same_id_and_valid_signatures(
    make_settings, receiver_factory
):
    rx = receiver_factory([500, 503, 204])
    delivered0 = _metric("meshserve_webhook_deliveries_total", {"outcome": "delivered"})
    retries0 = _metric("meshserve_webhook_retries_total")
    async with api_client(make_settings(**FAST)) as (client, store):
        worker = FakeWorker(store)
        await worker.register()
        worker.start()
        r = await client.post(
            "/v1/generate", json={"prompt": "a cat", "webhook": {"url": rx.url}, "metadata": {"order": "42"}}
        )
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        job = await _webhook_settled(store, job_id)
        await worker.stop()
        assert job.status == JobStatus.SUCCEEDED
        assert job.webhook.status == "delivered" and job.webhook.attempts == 3
        assert len(rx.requests) == 3
        ids = {req["headers"]["webhook-id"] for req in rx.requests}
        assert ids == {f"msg_{job_id}"}  # the same id on every retry
        bodies = {req["body"] for req in rx.requests}
        assert len(bodies) == 1  # the same bytes too
        for req in rx.requests:
            assert verify(SECRET, req["headers"], req["body"])
            assert req["headers"]["content-type"] == "application/json"
        payload = json.loads(rx.requests[0]["body"])
        assert payload["type"] == "job.succeeded"
        assert payload["timestamp"].endswith("Z")
        data = payload["data"]
        assert data["id"] == job_id and data["status"] == "succeeded" and data["object"] == "job"
        assert data["params"]["metadata"] == {"order": "42"}
        assert data["outputs"][0]["url"] == f"/v1/jobs/{job_id}/outputs/0"
        # The job as the API shows it records the delivery.
        shown = (await client.get(f"/v1/jobs/{job_id}")).json()
        assert shown["webhook"] == {"status": "delivered", "attempts": 3, "last_error": None}
        metrics = (await client.get("/metrics")).text
        assert "meshserve_webhook_attempt_duration_seconds_bucket" in metrics
        assert "meshserve_webhooks_pending 0.0" in metrics
    assert _metric("meshserve_webhook_deliveries_total", {"outcome": "delivered"}) == delivered0 + 1
    assert _metric("meshserve_webhook_retries_total") == retries0 + 2


async def test_410_stops_and_giving_up_is_recorded_on_the_job(make_settings, receiver_factory):
    gone, down = receiver_factory([410]), receiver_factory([500])
    failed0 = _metric("meshserve_webhook_deliveries_total", {"outcome": "failed"})
    async with api_client(make_settings(**FAST, webhook_max_attempts=3)) as (client, store):
        worker = FakeWorker(store)
        await worker.register()
        worker.start()
        ids = []
        for url in (gone.url, down.url):
            r = await client.post("/v1/generate", json={"prompt": "a cat", "webhook": {"url": url}})
            ids.append(r.json()["id"])
        first, second = [await _webhook_settled(store, i) for i in ids]
        await worker.stop()
    assert (
        first.webhook.status == "failed" and first.webhook.attempts == 1 and "410" in first.webhook.last_error
    )
    assert len(gone.requests) == 1
    assert second.webhook.status == "failed" and second.webhook.attempts == 3
    assert second.webhook.last_error.startswith("gave up after 3 attempts; last: HTTP 500")
    assert len(down.requests) == 3
    assert _metric("meshserve_webhook_deliveries_total", {"outcome": "failed"}) == failed0 + 2


async def test_an_unexpected_error_in_the_deliverer_ends_the_webhook_failed(
    make_settings, receiver_factory, monkeypatch
):
    """A bug on our side (an audit's: a port httpx parses and the socket layer cannot take) is no reason to
    claim the delivery again every lease for a day: it ends failed, naming the error."""
    from meshserve.service import ssrf

    async def broken(*args, **kw):
        raise OverflowError("connect(): port must be 0-65535")

    receiver = receiver_factory([200])
    monkeypatch.setattr(ssrf, "fetch", broken)
    async with api_client(make_settings(**FAST)) as (client, store):
        worker = FakeWorker(store)
        await worker.register()
        worker.start()
        r = await client.post("/v1/generate", json={"prompt": "a cat", "webhook": {"url": receiver.url}})
        job = await _webhook_settled(store, r.json()["id"])
        await worker.stop()
    assert job.webhook.status == "failed" and job.webhook.attempts == 1
    assert "internal error in the deliverer (OverflowError)" in job.webhook.last_error
    assert not receiver.requests


async def test_events_filter_and_expired_and_canceled_events(make_settings, receiver_factory):
    rx = receiver_factory([200])
    async with api_client(make_settings(**FAST)) as (client, store):
        # No pool runs: the first job expires (sweep), the second is canceled while queued; the third only
        # wants job.failed, so its cancel sends nothing.
        await FakeWorker(store).register()
        expiring = await client.post(
            "/v1/generate",
            json={"prompt": "a", "webhook": {"url": rx.url + "?e"}},
            headers={"Cancel-After": "0.2s"},
        )
        canceled = await client.post("/v1/generate", json={"prompt": "b", "webhook": {"url": rx.url + "?c"}})
        quiet = await client.post(
            "/v1/generate", json={"prompt": "c", "webhook": {"url": rx.url + "?q", "events": ["job.failed"]}}
        )
        for r in (canceled, quiet):
            assert (await client.post(f"/v1/jobs/{r.json()['id']}/cancel")).json()["status"] == "canceled"
        e = await _webhook_settled(store, expiring.json()["id"])
        c = await _webhook_settled(store, canceled.json()["id"])
        await asyncio.sleep(0.3)
        q = await store.get(quiet.json()["id"])
    types = {req["path"].split("?")[1]: json.loads(req["body"])["type"] for req in rx.requests}
    assert types == {"e": "job.expired", "c": "job.cancelled"}
    assert e.status == JobStatus.EXPIRED and e.webhook.status == "delivered"
    assert c.status == JobStatus.CANCELED and c.webhook.status == "delivered"
    assert q.webhook is None


# -- the address rules --------------------------------------------------------------------------------------


async def test_targets_are_checked_at_submission_and_again_at_delivery(make_settings, receiver_factory):
    rx = receiver_factory([302], location="/elsewhere")
    async with api_client(make_settings(webhook_secret=SECRET, webhook_poll_s=0.05)) as (client, store):
        await FakeWorker(store).register()
        for url, reason in (
            (rx.url, "address_not_allowed"),  # loopback
            ("http://10.1.2.3/hook", "address_not_allowed"),
            ("http://169.254.169.254/latest/meta-data", "address_not_allowed"),
            ("http://2130706433/hook", "numeric_host_form"),
            ("ftp://example.com/hook", "scheme_not_allowed"),
        ):
            r = await client.post("/v1/generate", json={"prompt": "a", "webhook": {"url": url}})
            assert r.status_code == 422, (url, r.text)
            assert r.json()["error"]["field"] == "webhook.url" and r.json()["error"]["code"] == reason
        r = await client.post(
            "/v1/generate",
            json={"prompt": "a", "webhook": {"url": "https://example.com/h", "events": ["job.x"]}},
        )
        assert r.status_code == 422 and r.json()["error"]["field"] == "webhook.events"
    # Allowed at submission (private targets allowed), refused at delivery (a deliverer that does not allow
    # them): the rules run again at delivery. Cloud metadata stays refused even with private targets allowed.
    settings = make_settings(**FAST)
    async with api_client(settings.model_copy(update={"webhook_deliver_in_api": False})) as (client, store):
        await FakeWorker(store).register()
        r = await client.post("/v1/generate", json={"prompt": "a", "webhook": {"url": rx.url}})
        assert r.status_code == 202
        r2 = await client.post(
            "/v1/generate", json={"prompt": "a", "webhook": {"url": "http://169.254.169.254/x"}}
        )
        assert r2.status_code == 422
        job_id = r.json()["id"]
        await store.cancel(job_id)
        strict = Deliverer(store, settings.model_copy(update={"webhook_allow_private": False}))
        await strict.tick()
        await strict.drain()
        job = await store.get(job_id)
        assert job.webhook.status == "failed" and job.webhook.last_error.startswith("refused:")
        assert "loopback" in job.webhook.last_error and rx.requests == []
        # A redirect is not followed: the 3xx is an answer that failed, retried at the same URL.
        job_id = (await client.post("/v1/generate", json={"prompt": "a", "webhook": {"url": rx.url}})).json()[
            "id"
        ]
        await store.cancel(job_id)
        lax = Deliverer(store, settings.model_copy(update={"webhook_max_attempts": 1}))
        await lax.tick()
        await lax.drain()
        job = await store.get(job_id)
        assert job.webhook.status == "failed" and "HTTP 302" in job.webhook.last_error
        assert [req["path"] for req in rx.requests] == ["/hook"]


async def test_a_2xx_is_success_whatever_its_body(make_settings, receiver_factory):
    """Found by an audit: a receiver that answered 200 with a 50 MiB Content-Length, or a body trickling a byte at
    a time, had its delivery recorded as failed (too_large, timeout) and retried for a day. The status line is
    the answer: the deliverer settles on it once the headers arrive and hangs up without reading the body."""
    huge, trickle = receiver_factory([200], body="huge"), receiver_factory([202], body="trickle")
    refused = receiver_factory([500], body="huge")
    settings = make_settings(**FAST, webhook_max_attempts=1, webhook_deliver_in_api=False)
    async with api_client(settings) as (client, store):
        await FakeWorker(store).register()
        ids = []
        for rx in (huge, trickle, refused):
            r = await client.post("/v1/generate", json={"prompt": "a", "webhook": {"url": rx.url}})
            ids.append(r.json()["id"])
            await store.cancel(ids[-1])
        deliverer = Deliverer(store, settings)
        t0 = time.perf_counter()
        assert await deliverer.tick() == 3
        await deliverer.drain()
        elapsed = time.perf_counter() - t0
        jobs = [await store.get(i) for i in ids]
    assert [j.webhook.status for j in jobs] == ["delivered", "delivered", "failed"], [j.webhook for j in jobs]
    assert jobs[0].webhook.attempts == jobs[1].webhook.attempts == 1
    assert "HTTP 500" in jobs[2].webhook.last_error  # a non-2xx fails as before, whatever its body
    assert len(huge.requests) == len(trickle.requests) == len(refused.requests) == 1
    # Well within the 5 s POST timeout that the trickle (50 s of body) would otherwise run into.
    assert elapsed < 2.5, elapsed


# -- secrets ------------------------------------------------------------------------------------------------


async def test_open_mode_needs_the_secret_setting(make_settings):
    async with api_client(make_settings(webhook_allow_private=True)) as (client, store):
        await FakeWorker(store).register()
        r = await client.post(
            "/v1/generate", json={"prompt": "a", "webhook": {"url": "http://127.0.0.1:9/h"}}
        )
        assert r.status_code == 422
        assert (
            r.json()["error"]["code"] == "webhook_secret_missing" and r.json()["error"]["field"] == "webhook"
        )
        # Refused before the URL's name is looked up (it said dns_error for a name that does not resolve).
        r = await client.post(
            "/v1/generate", json={"prompt": "a", "webhook": {"url": "http://no-such-host.invalid/h"}}
        )
        assert r.json()["error"]["code"] == "webhook_secret_missing", r.json()


async def test_each_key_signs_with_its_own_secret_and_rotation_signs_with_both(
    make_settings, receiver_factory
):
    rx = receiver_factory([200])
    settings = make_settings(**{**FAST, "webhook_secret": None}, auth="keys")
    async with api_client(settings) as (client, store):
        worker = FakeWorker(store)
        await worker.register()
        worker.start()
        keys = KeyStore(store.redis, store.prefix)
        a = await keys.create_key("a", rate_per_minute=0, max_active=0)
        b = await keys.create_key("b", rate_per_minute=0, max_active=0)
        assert a.webhook_secret != b.webhook_secret
        assert all("webhook_secret" not in k and "whsec" not in str(k) for k in await keys.list())

        async def submit(key: str) -> str:
            r = await client.post(
                "/v1/generate",
                json={"prompt": "a", "webhook": {"url": rx.url}},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert r.status_code == 202, r.text
            return r.json()["id"]

        for key in (a.key, b.key):
            await _webhook_settled(store, await submit(key))
        rotated = await keys.rotate_webhook_secret("a")
        await _webhook_settled(store, await submit(a.key))
        await worker.stop()
    first_a, first_b, after = (req["headers"] for req in rx.requests)
    bodies = [req["body"] for req in rx.requests]
    assert verify(a.webhook_secret, first_a, bodies[0]) and not verify(b.webhook_secret, first_a, bodies[0])
    assert verify(b.webhook_secret, first_b, bodies[1]) and not verify(a.webhook_secret, first_b, bodies[1])
    # During the rotation's grace both secrets sign: a receiver holding either one accepts.
    assert len(after["webhook-signature"].split(" ")) == 2
    assert verify(rotated, after, bodies[2]) and verify(a.webhook_secret, after, bodies[2])


def test_keys_cli_shows_the_secret_once_and_rotates_it(make_settings, monkeypatch, capsys):
    from meshserve.cli import main

    s = make_settings()
    monkeypatch.setenv("MESHSERVE_KEY_PREFIX", s.key_prefix)
    monkeypatch.setenv("MESHSERVE_REDIS_URL", s.redis_url)

    def keys(*args: str) -> list[str]:
        assert main(["keys", *args]) == 0
        return capsys.readouterr().out.strip().splitlines()

    try:
        created = keys("create", "hooks")
        assert created[-1].startswith("msk_") and created[-2].startswith("webhook secret: whsec_")
        rotated = keys("rotate-webhook-secret", "hooks")
        assert rotated[-1].startswith("whsec_") and rotated[-1] != created[-2].split(": ")[1]
        assert not any("whsec_" in line for line in keys("list"))
    finally:
        r = redis.Redis.from_url(s.redis_url)
        for k in r.scan_iter(f"{s.key_prefix}:*"):
            r.delete(k)
        r.close()


# -- durability ---------------------------------------------------------------------------------------------


async def test_a_deliverer_killed_mid_post_loses_nothing(make_settings, receiver_factory):
    """A `python -m meshserve.service.webhooks` process is SIGKILLed while the receiver holds its POST open; the
    delivery is due again once its lease (2 s) lapses, and another deliverer makes it: the same webhook-id, the same
    body, a valid signature, recorded on the job as delivered on the second attempt."""
    rx = receiver_factory([200], hold=(1,))
    lease = dict(webhook_lease_s=2.0, webhook_timeout_s=1.5)
    settings = make_settings(**{**FAST, **lease}, webhook_deliver_in_api=False)
    async with api_client(settings) as (client, store):
        worker = FakeWorker(store)
        await worker.register()
        worker.start()
        r = await client.post("/v1/generate", json={"prompt": "a cat", "webhook": {"url": rx.url}})
        job_id = r.json()["id"]
        await _until(lambda: _status(store, job_id, "pending"), what="a queued webhook")
        await worker.stop()
        env = {
            **os.environ,
            "MESHSERVE_REDIS_URL": settings.redis_url,
            "MESHSERVE_KEY_PREFIX": settings.key_prefix,
            "MESHSERVE_WEBHOOK_SECRET": SECRET,
            "MESHSERVE_WEBHOOK_ALLOW_PRIVATE": "true",
            "MESHSERVE_WEBHOOK_LEASE_S": "2.0",
            "MESHSERVE_WEBHOOK_TIMEOUT_S": "1.5",
            "MESHSERVE_WEBHOOK_POLL_S": "0.05",
        }
        child = subprocess.Popen(
            [sys.executable, "-m", "meshserve.service.webhooks"],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            assert await asyncio.to_thread(rx.arrived.wait, 30), "the child never POSTed"
            child.send_signal(signal.SIGKILL)
            child.wait(10)
        finally:
            if child.poll() is None:
                child.kill()
        killed_at = time.monotonic()
        job = await store.get(job_id)
        assert job.webhook.status == "pending" and job.webhook.attempts == 1  # claimed, never settled
        rx.release()  # the held connection's handler ends (its client is gone)
        deliverer = Deliverer(store, settings)
        task = asyncio.create_task(deliverer.run())
        try:
            job = await _webhook_settled(store, job_id)
        finally:
            deliverer.stop()
            await task
        assert time.monotonic() - killed_at < 6  # due again after the 2 s lease
    assert job.webhook.status == "delivered" and job.webhook.attempts == 2
    assert len(rx.requests) == 2
    held, retried = rx.requests
    assert held["headers"]["webhook-id"] == retried["headers"]["webhook-id"] == f"msg_{job_id}"
    assert held["body"] == retried["body"]
    assert verify(SECRET, retried["headers"], retried["body"])


async def _status(store, job_id: str, status: str) -> bool:
    job = await store.get(job_id)
    return bool(job and job.webhook and job.webhook.status == status)


async def test_the_job_end_and_its_webhook_are_one_write(make_settings):
    """No window between a job's end and its queued delivery: the script that ends the job queues it, so a
    store that ended the job always holds the delivery (checked straight after each kind of end)."""
    settings = make_settings(webhook_secret=SECRET, webhook_allow_private=True)
    async with api_client(settings.model_copy(update={"webhook_deliver_in_api": False})) as (_, store):
        spec = WebhookSpec(url="http://127.0.0.1:9/h", statuses=list(JobStatus)[2:])
        worker = FakeWorker(store)
        ids = []
        for prompt in ("done", "fail", "cancel"):
            job = await store.submit(_params(prompt=prompt), webhook=spec)
            ids.append(job.id)
            (d,) = await store.claim(["toy"], "c", 1)
            await store.start(d)
            if prompt == "done":
                await worker.run_one(d)
            elif prompt == "fail":
                await store.fail(d, "pipeline_error", "boom")
            else:
                await store.cancel(job.id)
                await store.mark_canceled(d)
            assert await store.redis.zscore(f"{store.prefix}:webhooks:due", job.id) is not None
        statuses = [(await store.get(i)).status for i in ids]
        assert statuses == [JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELED]
        for i in ids:
            assert (await store.get(i)).webhook.status == "pending"


async def test_slow_receivers_do_not_hold_up_the_api(make_settings, receiver_factory):
    """The API process's deliverer POSTs beside the request handlers: with every POST of its concurrency held open
    by the receiver, reads and submits answer as fast as ever."""
    rx = receiver_factory([200], hold=tuple(range(1, 5)))
    settings = make_settings(**FAST, webhook_concurrency=4)
    async with api_client(settings) as (client, store):
        await FakeWorker(store).register()
        ids = []
        for _ in range(4):
            r = await client.post("/v1/generate", json={"prompt": "a", "webhook": {"url": rx.url}})
            ids.append(r.json()["id"])
            await client.post(f"/v1/jobs/{ids[-1]}/cancel")
        await _until(lambda: asyncio.sleep(0, len(rx.requests) == 4), what="four held POSTs")
        t0 = time.perf_counter()
        for i in ids:
            assert (await client.get(f"/v1/jobs/{i}")).json()["webhook"]["status"] == "pending"
        r = await client.post("/v1/generate", json={"prompt": "b"})
        elapsed = time.perf_counter() - t0
        # Five requests: 30-55 ms here, while each held POST lasts until released (up to 5 s).
        assert r.status_code == 202 and elapsed < 0.5, elapsed
        rx.release()  # the held POSTs end without an answer: each is retried, and delivered
        for i in ids:
            job = await _webhook_settled(store, i)
            assert job.webhook.status == "delivered" and job.webhook.attempts == 2


async def test_one_tenants_deliveries_cannot_take_every_slot(make_settings):
    """Found by an audit: 100 jobs of one tenant whose receiver hung held every POST slot, and another tenant's
    webhook waited a minute. A claim passes over the due deliveries of a tenant at `per_tenant` POSTs in flight."""
    settings = make_settings(webhook_secret=SECRET, webhook_allow_private=True, webhook_deliver_in_api=False)
    async with api_client(settings) as (_, store):
        spec = WebhookSpec(url="http://127.0.0.1:9/h", statuses=list(JobStatus)[2:])
        ids = {}
        for owner in ["hog"] * 6 + ["other"]:  # the hog's deliveries are due first
            job = await store.submit(_params(prompt=owner), owner=owner, webhook=spec)
            await store.cancel(job.id)  # ends queued: its delivery is due now
            ids.setdefault(owner, []).append(job.id)
        queue = WebhookQueue(store.redis, store.prefix)
        claims = await queue.claim(4, 30.0, 3600.0, per_tenant=2, in_flight={"hog": 1})
        assert [c.tenant for c in claims] == ["hog", "other"]
        assert claims[1].job_id == ids["other"][0]
        claims = await queue.claim(4, 30.0, 3600.0)  # no per-tenant limit: the oldest due first
        assert [c.tenant for c in claims] == ["hog"] * 4
        # Without a per-tenant limit what is in flight does not count (open mode: one tenant for every job).
        assert [c.tenant for c in await queue.claim(4, 30.0, 3600.0, in_flight={"hog": 9})] == ["hog"]


async def test_a_retry_claimed_before_its_job_was_deleted_is_not_sent(make_settings, receiver_factory):
    """Found by an audit: a retry (its body kept by the first attempt) claimed before `DELETE /v1/jobs/{id}` was
    still POSTed after it. A first attempt already checked: its body is built from the job."""
    rx = receiver_factory([500, 200])
    settings = make_settings(**FAST).model_copy(update={"webhook_deliver_in_api": False})
    async with api_client(settings) as (client, store):
        worker = FakeWorker(store)
        await worker.register()
        worker.start()
        try:
            job_id = (
                await client.post("/v1/generate", json={"prompt": "a", "webhook": {"url": rx.url}})
            ).json()["id"]
            await _until(lambda: _ended(store, job_id), what="the job's end")
            deliverer, queue = Deliverer(store, settings), WebhookQueue(store.redis, store.prefix)
            (first,) = await queue.claim(10, 30, 3600)
            await deliverer._attempt(first)  # answered 500: a retry is due, its body kept
            await asyncio.sleep(0.1)
            (retry,) = await _until(lambda: queue.claim(10, 30, 3600), what="the retry's claim")
            assert retry.body and len(rx.requests) == 1
            assert (await client.delete(f"/v1/jobs/{job_id}")).status_code == 204
            await deliverer._attempt(retry)
            assert len(rx.requests) == 1
            assert [k async for k in store.redis.scan_iter(f"{store.prefix}:*{job_id}*")] == []
        finally:
            await worker.stop()


async def _ended(store, job_id: str) -> bool:
    job = await store.get(job_id)
    return job is not None and job.status.terminal

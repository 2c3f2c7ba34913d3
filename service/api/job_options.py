"""What a submit asks of a job's end, checked at admission: a deadline and a webhook.

Deadline: the `Cancel-After` header (Replicate's: a duration, `30`, `45s`, `5m`, `1h30m`, `1.5h`, `250ms`; a bare
number is seconds) or the body's `deadline_s`; the header wins when both are given. It counts from submission and
may be at most `max_deadline_s`. Past it a queued job ends `expired`, a running one is canceled between steps.

Webhook: its URL must pass service/ssrf.py's rules now (they are checked again at every delivery), and something
must be able to sign it: the caller's API key's own secret, or `MESHSERVE_WEBHOOK_SECRET` (open mode, or a key
made before keys had secrets). Each failure is a 422 naming `webhook.url` or `webhook`.
"""

from __future__ import annotations

import re
import time

from redis.asyncio import Redis

from meshserve.service import ssrf
from meshserve.service.api.errors import FieldError
from meshserve.service.auth import Tenant, webhook_secrets
from meshserve.service.settings import Settings
from meshserve.service.webhooks.spec import WebhookRequest, WebhookSpec

_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_DURATION = re.compile(r"^(?:\d+(?:\.\d+)?(?:ms|s|m|h))+\Z")
_SECONDS = re.compile(r"^\d+(?:\.\d+)?\Z")
MAX_HEADER_CHARS = 64


def parse_duration(value: str) -> float:
    """Seconds of a `Cancel-After` value; ValueError when it is not one."""
    text = value.strip().lower()
    if len(text) > MAX_HEADER_CHARS:
        raise ValueError(f"at most {MAX_HEADER_CHARS} characters")
    if _SECONDS.match(text):
        return float(text)
    if not _DURATION.match(text):
        raise ValueError("a duration: seconds (`90`) or number-unit pairs with ms, s, m, h (`5m`, `1h30m`)")
    return sum(float(n) * _UNIT_S[unit] for n, unit in _PART.findall(text))


def deadline_at(header: str | None, deadline_s: float | None, settings: Settings) -> float | None:
    """Unix seconds of the job's deadline (None: none asked), or a 422 naming `Cancel-After` or `deadline_s`."""
    field, seconds = "deadline_s", deadline_s
    if header is not None:
        field = "Cancel-After"
        try:
            seconds = parse_duration(header)
        except ValueError as e:
            raise FieldError(
                field, "invalid_duration", f"Cancel-After must be {e}, got {header[:80]!r}"
            ) from None
    if seconds is None:
        return None
    if not 0 < seconds <= settings.max_deadline_s:
        raise FieldError(
            field,
            "out_of_range",
            f"{field} must be > 0 and at most {settings.max_deadline_s:g} s, got {seconds:g}",
        )
    return time.time() + seconds


async def webhook_spec(
    request: WebhookRequest | None, tenant: Tenant, settings: Settings, redis: Redis, prefix: str
) -> WebhookSpec | None:
    """What the job keeps of the request's webhook, or a 422: a refused URL, or nothing to sign with."""
    if request is None:
        return None
    # The secret first: a request that cannot be signed is refused without resolving its URL's name.
    if not await webhook_secrets(redis, prefix, tenant.key_digest, settings):
        raise FieldError(
            "webhook",
            "webhook_secret_missing",
            "no secret to sign webhooks with: the API key has none (rotate it: `meshserve keys "
            "rotate-webhook-secret NAME`) and MESHSERVE_WEBHOOK_SECRET is not set",
        )
    try:
        await ssrf.check_url(request.url, allow_private=settings.webhook_allow_private)
    except ssrf.FetchError as e:  # BlockedURL (the rules) or a name that does not resolve
        raise FieldError("webhook.url", e.reason, f"webhook.url: {e.message}") from None
    return WebhookSpec(url=request.url, statuses=request.statuses(), key=tenant.key_digest)

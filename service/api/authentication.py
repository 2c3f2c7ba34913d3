"""Who is calling: every request but the open ones carries `Authorization: Bearer <key>` (`MESHSERVE_AUTH=keys`).

A pure ASGI middleware, so the rule is default-deny: a route added later is covered without remembering a
dependency, an unknown path answers 401 to a caller without a key (no route discovery), and the check runs
before the body is read or parsed (an unauthenticated caller cannot make the API buffer or validate anything).

- Open: `/livez`, `/readyz`, `/metrics` (no tenant data; restrict them at the ingress, docs/security.md), the
  API's own schema and docs pages, and the playground's static page (`/`, `/playground`: it holds no data, and a
  browser's navigation cannot send a key; the page sends the one a person types with each API call).
- Missing, malformed, unknown or revoked key: 401 with `WWW-Authenticate: Bearer` and the one error shape.
- Past the key's requests-per-minute: 429 with `Retry-After` and the IETF draft's `RateLimit` headers
  (`service/rate_limit.py`); every authenticated answer carries them.
- The caller's `Tenant` is put in the request state (`request.state.tenant`), read by `deps.current_tenant`.
With `MESHSERVE_AUTH=none` every request is the tenant `Settings.default_owner`, without a Redis call.

The key itself is never logged, put in an error message or sent to Redis (only its SHA-256).
"""

from __future__ import annotations

import logging

from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshserve.service import metrics
from meshserve.service.api.errors import error_response
from meshserve.service.api.routes.playground import PATHS as PLAYGROUND_PATHS
from meshserve.service.auth import Tenant, parse_bearer, well_formed

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset(
    {"/livez", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    | PLAYGROUND_PATHS
)
_CHALLENGE = 'Bearer realm="meshserve"'
_SUBMIT_PATHS = ("/v1/generate", "/v1/images")


class Authentication:
    """The ASGI middleware described in the module docstring. Reads the settings and the `KeyStore` from
    `app.state` (`settings`, `keys`) at each request: the key store exists only once the lifespan opened Redis."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        settings = state.settings
        if settings.auth == "none":
            scope.setdefault("state", {})["tenant"] = Tenant(name=settings.default_owner)
            await self.app(scope, receive, send)
            return

        given = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(given) > 1:
            # Which one counts differs between a gateway (often the first) and a dict (the last): refuse both.
            await self._refuse(
                scope,
                receive,
                send,
                "invalid_api_key",
                "send one Authorization header, not several",
                bad=True,
            )
            return
        key = parse_bearer(given[0].decode("latin-1")) if given else None
        if key is None:
            await self._refuse(
                scope, receive, send, "missing_api_key", "send Authorization: Bearer <API key>"
            )
            return
        if not well_formed(key):
            await self._refuse(scope, receive, send, "invalid_api_key", "the API key is malformed", bad=True)
            return
        try:
            found = await state.keys.authenticate(key)
        except (RedisError, OSError) as e:
            log.warning("authentication: the key store is unavailable: %s", e)
            retry = {"Retry-After": str(settings.retry_after_s)}
            response = error_response(503, "store_unavailable", "the key store is unavailable", None, retry)
            await response(scope, receive, send)
            return
        if found is None:
            await self._refuse(
                scope, receive, send, "invalid_api_key", "unknown or revoked API key", bad=True
            )
            return
        tenant, rate = found
        if rate is not None and not rate.allowed:
            metrics.AUTH_REFUSED.labels("rate_limited").inc()
            if scope["path"].startswith(_SUBMIT_PATHS):
                metrics.JOBS_REJECTED.labels("rate_limited").inc()
            response = error_response(
                429,
                "rate_limited",
                f"more than {rate.quota} requests per minute; retry after {rate.headers()['Retry-After']} s",
                None,
                rate.headers(),
            )
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        if rate is None:
            await self.app(scope, receive, send)
            return
        extra = [(k.lower().encode(), v.encode()) for k, v in rate.headers().items()]

        async def send_with_rate(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_rate)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, code: str, message: str, bad: bool = False):
        metrics.AUTH_REFUSED.labels(code).inc()
        challenge = _CHALLENGE + (', error="invalid_token"' if bad else "")
        response = error_response(401, code, message, "Authorization", {"WWW-Authenticate": challenge})
        await response(scope, receive, send)

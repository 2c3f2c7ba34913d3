"""Standard Webhooks signatures (https://www.standardwebhooks.com, spec/standard-webhooks.md).

Headers: `webhook-id` (the same on every retry of a message), `webhook-timestamp` (unix seconds of this attempt)
and `webhook-signature`: `v1,<base64 of HMAC-SHA256(secret, "<id>.<timestamp>.<body>")>`, several separated by
spaces while a secret is being rotated (the receiver accepts any one that verifies). A secret is `whsec_` +
base64 of its random bytes (24 here, inside the spec's 24-64); the HMAC key is those bytes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 24


class BadSecret(ValueError):
    """Not `whsec_` + base64 of 24 to 64 bytes."""


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def secret_key(secret: str) -> bytes:
    """The HMAC key of a `whsec_` secret."""
    if not secret.startswith(SECRET_PREFIX):
        raise BadSecret("a webhook secret starts with whsec_")
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
    except ValueError:
        raise BadSecret("a webhook secret is whsec_ and base64") from None
    if not 24 <= len(key) <= 64:
        raise BadSecret(f"a webhook secret holds 24 to 64 bytes, this one {len(key)}")
    return key


def signature(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """One `v1,<base64>` signature."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret_key(secret), signed, hashlib.sha256).digest()).decode()


def headers(secrets_: list[str], msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three headers, signed with every secret given (the current one first)."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(signature(s, msg_id, timestamp, body) for s in secrets_),
    }

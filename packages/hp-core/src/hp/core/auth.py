"""Control-plane authentication: every request body is signed with the job's shared token.

The token never crosses the wire: requests carry ``HMAC-SHA256(token, body)`` and a timestamp in
the body bounds replays. Bodies are JSON, never pickles.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time

TOKEN_ENV = "HP_JOB_TOKEN"
SIGNATURE_HEADER = "X-HP-Signature"
MAX_CLOCK_SKEW_S = 300.0


def new_token() -> str:
    """A fresh random job token (256 bits, hex)."""
    return secrets.token_hex(32)


def token_from_env() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


def sign(token: str, body: bytes) -> str:
    return hmac.new(token.encode(), body, hashlib.sha256).hexdigest()


def encode_request(token: str, payload: dict) -> tuple[bytes, str]:
    """Serialise ``payload`` (adding a timestamp) and sign it; returns (body, signature)."""
    body = json.dumps({**payload, "ts": time.time()}, sort_keys=True).encode()
    return body, sign(token, body)


class AuthError(Exception):
    """The request is not signed with the job token, or is too old to trust."""


def verify_request(token: str, body: bytes, signature: str | None, now: float | None = None) -> dict:
    """Check the signature and freshness of a request; returns the decoded JSON object."""
    if not signature or not hmac.compare_digest(sign(token, body), signature):
        raise AuthError("bad or missing signature (wrong job token?)")
    try:
        payload = json.loads(body)
    except ValueError as e:
        raise AuthError(f"body is not JSON: {e}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("ts"), (int, float)):
        raise AuthError("body must be a JSON object with a numeric 'ts'")
    if abs((now if now is not None else time.time()) - payload["ts"]) > MAX_CLOCK_SKEW_S:
        raise AuthError("request timestamp outside the allowed clock skew (replayed?)")
    return payload

"""Control-plane authentication: every request body is signed with the job's shared token.

The token never crosses the wire: requests carry ``HMAC-SHA256(token, body)`` and a timestamp in
the body bounds replays; a receiver that also keeps a :class:`ReplayWindow` of the bodies' nonces
accepts each message once. Bodies are JSON, never pickles.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import json
import os
import secrets
import threading
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
    if not abs((now if now is not None else time.time()) - payload["ts"]) <= MAX_CLOCK_SKEW_S:  # NaN too
        raise AuthError("request timestamp outside the allowed clock skew (replayed?)")
    return payload


class ReplayWindow:
    """The nonces of the messages accepted while they are fresh: each signed message is accepted once.

    A message is fresh for ``window_s`` (at least :data:`MAX_CLOCK_SKEW_S`, what :func:`verify_request`
    allows) around its ``ts``; its ``nonce`` is kept until then and forgotten after, when the timestamp
    check alone refuses a replay. At most ``cap`` nonces are kept: past that a message is refused, the
    table does not grow (only correctly signed messages get here, so only a key holder can fill it).
    Thread-safe.
    """

    def __init__(self, cap: int = 100_000, window_s: float = MAX_CLOCK_SKEW_S) -> None:
        self.cap, self.window_s = cap, window_s
        self._seen: set[str] = set()
        self._expiry: list[tuple[float, str]] = []  # heap of (forget after, nonce)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, payload: dict, now: float | None = None) -> None:
        """Accept the verified ``payload``'s nonce once; AuthError for a repeat, a missing nonce or a full table."""
        nonce, ts = payload.get("nonce"), payload.get("ts")
        if not isinstance(nonce, str) or not 16 <= len(nonce) <= 128:
            raise AuthError("message needs a 'nonce' of 16 to 128 characters")
        if not isinstance(ts, (int, float)) or ts != ts:
            raise AuthError("message needs a numeric 'ts'")
        now = time.time() if now is None else now
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                self._seen.discard(heapq.heappop(self._expiry)[1])
            if nonce in self._seen:
                raise AuthError("nonce already seen: a replayed message")
            if len(self._seen) >= self.cap:
                raise AuthError(f"replay window full: {self.cap} messages within {self.window_s:.0f} s")
            self._seen.add(nonce)
            heapq.heappush(self._expiry, (ts + self.window_s, nonce))

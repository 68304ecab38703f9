"""Control-plane authentication: every message is signed with a key derived from the job's token.

The token never crosses the wire: a message carries ``HMAC-SHA256(key, ...)`` and a timestamp ("ts")
and a random "nonce" in its JSON body bound replays; a receiver that also keeps a
:class:`ReplayWindow` of the nonces accepts each message once. Bodies are JSON, never pickles.

- Checkpoint-daemon frames (``hp.tiered_ckpt.wire``) sign their body with the job token.
- The controller's HTTP requests (:mod:`hp.core.control_plane`) sign ``method``, ``path`` and body with
  the sending node's key, :func:`node_key` = HMAC-SHA256(job token, ``"hp-node:" + node id``); the
  answer is signed with the same key over its status, its body and the request's nonce
  (:func:`sign_response`), so it cannot be forged, replayed or given to another request.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import hmac
import json
import os
import re
import secrets
import threading
import time

from hp.core.errors import UsageError
from hp.core.worker_env import TOKEN_ENV  # noqa: F401  (its one definition)

SIGNATURE_HEADER = "X-HP-Signature"
NODE_HEADER = "X-HP-Node"  # the identity whose key signed the request (see node_key)
RESPONSE_SIGNATURE_HEADER = "X-HP-Response-Signature"
MAX_CLOCK_SKEW_S = 300.0
MIN_TOKEN_CHARS = 32
OPERATOR = "operator"  # the identity of operator tools (`hp scale`): speaks for no node
_IDENTITY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")


def new_token() -> str:
    """A fresh random job token (256 bits, hex)."""
    return secrets.token_hex(32)


def token_from_env() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


def check_token(token: str, where: str = "the job token") -> str:
    """``token``, if long enough to be a key; else a one-line :class:`UsageError` (never showing it)."""
    if len(token) < MIN_TOKEN_CHARS:
        raise UsageError(f"{where} has {len(token)} characters, fewer than the {MIN_TOKEN_CHARS} a key needs "
                         "(`hp token` prints a new one)")
    return token


def sign(token: str, body: bytes) -> str:
    return hmac.new(token.encode(), body, hashlib.sha256).hexdigest()


def _same(expected: str, given: str | None) -> bool:
    """Constant-time comparison of a signature with one that came from the peer (any characters)."""
    return bool(given) and hmac.compare_digest(expected.encode(), given.encode("utf-8", "surrogateescape"))


def node_key(token: str, node: str) -> str:
    """The key identity ``node`` signs its control-plane requests with (a node's id is its node rank,
    in decimal; :data:`OPERATOR` for operator tools). AuthError for a malformed id."""
    if not isinstance(node, str) or not _IDENTITY.fullmatch(node):
        raise AuthError(f"bad or missing {NODE_HEADER} identity")
    return sign(token, b"hp-node:" + node.encode())


def _signed_part(body: bytes, method: str | None, path: str | None) -> bytes:
    if (method is None) != (path is None):
        raise ValueError("sign both the method and the path of a request, or neither")
    if method is None:
        return body
    return b"hp-request\n" + method.upper().encode() + b"\n" + path.encode("utf-8", "surrogateescape") + b"\n" + body


def encode_request(token: str, payload: dict, method: str | None = None, path: str | None = None) -> tuple[bytes, str]:
    """Serialise ``payload`` (adding a timestamp, and a random nonce unless it has one) and sign it;
    returns (body, signature). With ``method`` and ``path`` (HTTP) the signature covers them too."""
    body = json.dumps({"nonce": secrets.token_hex(16), **payload, "ts": time.time()}, sort_keys=True).encode()
    return body, sign(token, _signed_part(body, method, path))


class AuthError(Exception):
    """The request is not signed with the job token, or is too old to trust."""


def verify_request(token: str, body: bytes, signature: str | None, now: float | None = None,
                   method: str | None = None, path: str | None = None) -> dict:
    """Check the signature (of ``method`` and ``path`` too, when given) and freshness of a request;
    returns the decoded JSON object."""
    if not _same(sign(token, _signed_part(body, method, path)), signature):
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


def sign_response(key: str, status: int, body: bytes, nonce: str) -> str:
    """The signature of an answer: its status and body, bound to the request by that request's nonce."""
    return sign(key, b"hp-response\n%d\n" % status + nonce.encode("utf-8", "surrogateescape") + b"\n" + body)


def verify_response(key: str, status: int, body: bytes, nonce: str, signature: str | None) -> None:
    """AuthError unless ``signature`` signs this answer to the request that carried ``nonce``."""
    if not _same(sign_response(key, status, body, nonce), signature):
        raise AuthError("bad or missing response signature")


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


def read_token(args: argparse.Namespace, required: bool) -> str:
    """The job token a command was given: ``--token-file`` (``args.token_file``), else ``$HP_JOB_TOKEN``; else a
    new one, unless ``required`` (a job of several nodes, an operator command): then a one-line error."""
    if getattr(args, "token_file", None):
        try:
            with open(args.token_file) as f:
                token = f.read().strip()
        except OSError as e:
            raise UsageError(f"--token-file: {e.strerror}: {args.token_file}") from None
        except UnicodeDecodeError:
            raise UsageError(f"--token-file {args.token_file}: not UTF-8 text") from None
        if not token:
            raise UsageError(f"--token-file {args.token_file} is empty")
        return check_token(token, f"the job token in --token-file {args.token_file}")
    token = token_from_env()
    if token:
        return check_token(token, f"the job token in ${TOKEN_ENV}")
    if required:
        raise UsageError(f"a shared job token is required: set {TOKEN_ENV} or --token-file "
                         "(`hp token` prints a new one)")
    return new_token()

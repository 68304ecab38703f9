"""Sealed store values: what the controller and the ranks publish in the job's store, signed with the job token.

The coordination store (torch's ``TCPStore``) authenticates nobody: anyone who reaches its port can
write any key. So every value a process acts on (:func:`hp.core.protocol.is_sealed_key`) is *sealed*:
stored as the JSON object ``{"v": value, "sig": HMAC-SHA256(token, DOMAIN + key + "\\n" + value)}``
(:func:`hp.core.auth.sign`, the one signing primitive). The key is signed with the value, so a genuine
value moved to another key (generation 3's plan to generation 5's key) is refused; :data:`DOMAIN` keeps a
sealed value's signature from ever passing for a signed control-plane request (a JSON object) or a signed
checkpoint document (``hp-ckpt-doc``), or the reverse. A value that is not sealed with the job token
raises :class:`hp.core.protocol.ProtocolError` naming its key; what a reader then does is its own
decision (:mod:`hp.checkpointless.membership`): it never acts on the value.

Sealing does not stop a replay of an older genuine value into the same key: readers of the generation
never go back below one they have seen. Stdlib only: workers read this before importing torch.
"""

from __future__ import annotations

import hmac
import json
import sys
import time
from collections.abc import Callable

from hp.core.auth import sign
from hp.core.protocol import ProtocolError

DOMAIN = b"hp-store-value\n"  # neither JSON (a request body) nor hex (the wire trailer), nor "hp-ckpt-doc\n"


def _signature(token: str, key: str, value: str) -> str:
    if not token:
        raise ValueError("sealing a store value needs the job token (HP_JOB_TOKEN)")
    if "\n" in key:  # the key ends at the first newline: no key and value can shift into each other
        raise ValueError(f"a sealed store key has no newline: {key!r}")
    return sign(token, DOMAIN + key.encode() + b"\n" + value.encode())


def seal(token: str, key: str, value: str) -> str:
    """``value`` as it is stored at ``key``: with its signature, bound to ``key``."""
    return json.dumps({"v": value, "sig": _signature(token, key, value)}, separators=(",", ":"))


def unseal(token: str, key: str, sealed: str | bytes) -> str:
    """The value sealed at ``key``; :class:`ProtocolError` (one line naming ``key``) for a value that is
    not sealed with ``token`` for ``key``: unsealed, altered, moved from another key, of another job."""
    try:
        doc = json.loads(sealed)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("v"), str) or not isinstance(doc.get("sig"), str):
        raise ProtocolError(f"store value at {key!r} is not sealed (written by a process without the job token?)")
    if "\n" in key or not hmac.compare_digest(_signature(token, key, doc["v"]).encode(), doc["sig"].encode()):
        raise ProtocolError(f"store value at {key!r} has a bad signature (forged, moved from another key, "
                            f"or sealed with another job token)")
    return doc["v"]


def sealing(set_value: Callable[[str, str], object], token: str) -> Callable[[str, str], None]:
    """A ``publish(key, value)`` that stores ``value`` sealed: the controller's (``Controller(publish=...)``)
    is ``sealing(store.set, token)``."""
    if not token:
        raise ValueError("sealing store values needs the job token (HP_JOB_TOKEN)")

    def publish(key: str, value: str) -> None:
        set_value(key, seal(token, key, value))

    return publish


class Refusals:
    """Says that a forged value was refused: ``report(key, error)`` calls ``on_refused(key, message)``
    at most once per key every ``every_s`` seconds (a forger rewriting a key must not flood the logs);
    by default a line on stderr. Thread-safe enough: a lost or doubled warning is harmless."""

    def __init__(self, on_refused: Callable[[str, str], None] | None = None, every_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._on_refused = on_refused or _warn
        self._every, self._clock = every_s, clock
        self._last: dict[str, float] = {}
        self.count = 0  # every refusal, reported or not

    def report(self, key: str, error: Exception | str) -> None:
        self.count += 1
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._every:
            return
        self._last[key] = now
        self._on_refused(key, str(error))


def _warn(key: str, message: str) -> None:
    print(f"hp: warning: refused a store value: {message}; ignored", file=sys.stderr, flush=True)

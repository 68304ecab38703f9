"""Save ids and the signed JSON documents of the persistent tier.

Every ``dcp.save`` gets a *save id* from its coordinator (:func:`new_save_id`, handed to every rank
through the global plan). A rank manifest (``hp_rank<r>.json``), the metadata JSON and the commit
marker all carry it, and each is signed with the job token (HMAC-SHA256 over its canonical JSON, see
:mod:`hp.core.auth`). The commit marker also holds the SHA-256 of every manifest's and of the
metadata's exact bytes, so it pins one save: a manifest of another attempt, or one rewritten by
anyone without the token (say, with recomputed CRCs), no longer matches and the step is refused.

Save ids sort by creation time (a nanosecond clock prefix), so a daemon can tell a retried save of
a step from a late message of an earlier attempt.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid

from hp.core.auth import sign
from hp.core.errors import HpError

SIG = "sig"
_DOMAIN = b"hp-ckpt-doc\n"  # a signed document can never pass for a signed wire header, nor the reverse


class SignatureError(HpError):
    """A checkpoint document that is unsigned, signed with another token, altered, or of another save."""


def new_save_id() -> str:
    """A unique id for one save, ordered by creation time: 16 hex digits of ns clock + 16 random."""
    return f"{time.time_ns():016x}{uuid.uuid4().hex[:16]}"


def is_save_id(value: object) -> bool:
    return isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)


def _canonical(body: dict) -> bytes:
    return _DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def dumps(token: str, doc: dict) -> bytes:
    """``doc`` as JSON bytes with its signature in ``"sig"``."""
    body = {k: v for k, v in doc.items() if k != SIG}
    return json.dumps({**body, SIG: sign(token, _canonical(body))}).encode()


def loads(token: str, data: bytes, what: str) -> dict:
    """The document in ``data`` once its signature checks out (without ``"sig"``); else
    :class:`SignatureError` naming ``what``."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise SignatureError(f"{what}: not JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get(SIG), str):
        raise SignatureError(f"{what}: unsigned")
    body = {k: v for k, v in doc.items() if k != SIG}
    if not hmac.compare_digest(sign(token, _canonical(body)), doc[SIG]):
        raise SignatureError(f"{what}: bad signature (altered, or written with another job token)")
    return body


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()

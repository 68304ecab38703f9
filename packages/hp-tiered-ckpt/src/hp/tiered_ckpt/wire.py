"""Framed, authenticated messages between workers, node daemons and peer daemons.

One frame::

    4-byte big-endian header length n | 64-byte hex HMAC-SHA256 of the header (its signature)
    | n bytes of JSON header | header["nbytes"] payload bytes | 32-byte trailer

The header is signed with ``hp.core.auth`` (the job token, or a daemon's admin key for
:data:`ADMIN_OPS`) and carries a timestamp ("ts") and a random "nonce". The trailer is
HMAC-SHA256(key, signature || payload) with the same key: computed while the payload streams (one
pass, no second read of a large file), and checked before anything of the payload is accepted
(:func:`recv_payload_into`'s caller writes into a temporary file and discards it on error). A daemon
keeps a :class:`hp.core.auth.ReplayWindow`, so a captured frame is accepted once; a response carries
its request's nonce as "re" and :func:`exchange` checks it, so an old response cannot answer a new
request. Headers are JSON and payloads raw bytes: nothing that crosses the wire is unpickled. Lengths
are capped so a hostile or broken peer cannot make a daemon allocate without bound, and
:func:`recv_header` takes an idle timeout (before a frame starts) and a frame timeout (for the rest
of its header), so a silent or slow connection cannot hold a daemon's slot forever.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import time
from pathlib import Path
from typing import BinaryIO, Sequence

from hp.core.auth import AuthError, ReplayWindow, encode_request, sign, verify_request
from hp.core.privfs import open_private
from hp.tiered_ckpt import fmt

MAX_HEADER = 4 << 20  # metadata JSON of a large model fits; anything bigger is an attack or a bug
MAX_PAYLOAD = 64 << 30
_CHUNK = 8 << 20
_SIG_LEN = 64
_MAC_LEN = 32
_INLINE = 1 << 20  # payloads up to this size go out in one sendall with their header
ADMIN_OPS = frozenset({"peers", "gc"})  # need the daemon's admin key, not only the job token
ADMIN_KEY_FILE = "admin.key"            # in the daemon's private root dir, 0600
ADMIN_KEY_ENV = "HP_CKPT_ADMIN_KEY"     # or given to the daemon by whoever starts it


class WireError(Exception):
    """The peer closed the connection mid-frame, sent a bad frame, or failed authentication."""


class RefusedError(WireError):
    """The daemon understood the request and refused it (its reason is the message)."""


class IdleError(WireError):
    """No frame started: the peer closed the connection between frames, or stayed silent past the idle timeout."""


class Header(dict):
    """An authenticated frame header (its fields), with what checking the rest of its frame needs:
    ``key`` and ``key_index`` (which of the receiver's keys signed it), ``sig``, and ``pending``
    (payload and trailer still on the socket)."""

    key: str
    key_index: int
    sig: bytes
    pending: bool


def _mac(key: str, sig: bytes):
    return hmac.new(key.encode(), sig, hashlib.sha256)


def _recv_growing(sock: socket.socket, n: int, deadline: float | None = None, start: bytes = b"") -> bytes:
    """``n`` bytes, the buffer growing with what arrived: an unauthenticated header may announce up
    to MAX_HEADER bytes, and a connection that announces them and sends nothing must not hold them.
    With ``deadline`` (monotonic), all of them must arrive by then."""
    buf = bytearray(start)
    late = "incomplete after the frame timeout" if deadline is not None else "timed out"
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WireError(f"frame header {late} ({len(buf)} of {n} bytes)")
            sock.settimeout(left)
        try:
            chunk = sock.recv(min(n - len(buf), 64 << 10))
        except TimeoutError:
            raise WireError(f"frame header {late} ({len(buf)} of {n} bytes)") from None
        if not chunk:
            raise WireError(f"peer closed the connection after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _recv_exact(sock: socket.socket, n: int, mac=None) -> bytes:
    """``n`` bytes; ``mac`` is fed each piece as it arrives (still in the CPU's cache)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, _CHUNK))
        if k == 0:
            raise WireError(f"peer closed the connection after {got} of {n} bytes")
        if mac is not None:
            mac.update(view[got:got + k])
        got += k
    return bytes(buf)


def _start(token: str, header: dict, nbytes: int) -> tuple[bytes, object, str]:
    """A frame's length, signature and header bytes, its trailer MAC (fed the payload next) and its nonce."""
    nonce = secrets.token_hex(16)
    body, sig = encode_request(token, {**header, "nbytes": nbytes, "nonce": nonce})
    return struct.pack(">I", len(body)) + sig.encode() + body, _mac(token, sig.encode()), nonce


def frame(token: str, header: dict, payload: bytes = b"") -> bytes:
    """One whole frame with a small payload, as bytes: what :func:`send` writes (tests send such
    frames by hand: truncated, altered, replayed)."""
    head, mac, _ = _start(token, header, len(payload))
    mac.update(payload)
    return b"".join((head, payload, mac.digest()))


def send(sock: socket.socket, token: str, header: dict, payload: bytes | BinaryIO | None = None,
         nbytes: int | None = None) -> str:
    """Send one signed frame (``token``: the key to sign with); returns its nonce. ``payload`` is
    bytes, or a file streamed in chunks (then ``nbytes`` must be given); the trailer MAC is computed
    on the way, in the same pass."""
    data = None
    if payload is None or isinstance(payload, (bytes, bytearray, memoryview)):
        data = memoryview(payload or b"").cast("B")
        nbytes = len(data)
    elif nbytes is None:
        raise ValueError("streaming a file needs nbytes")
    head, mac, nonce = _start(token, header, nbytes)
    if data is not None and nbytes <= _INLINE:
        mac.update(data)
        sock.sendall(b"".join((head, data, mac.digest())))
        return nonce
    sock.sendall(head)
    if data is not None:  # in chunks: a socket timeout bounds each of them, not the whole payload
        for i in range(0, nbytes, _CHUNK):
            mac.update(data[i:i + _CHUNK])
            sock.sendall(data[i:i + _CHUNK])
    else:
        for chunk in fmt.chunks(payload, nbytes, _CHUNK):
            mac.update(chunk)
            sock.sendall(chunk)
    sock.sendall(mac.digest())
    return nonce


def reply(sock: socket.socket, request: Header, header: dict, payload: bytes | BinaryIO | None = None,
          nbytes: int | None = None) -> None:
    """Answer ``request``: signed with the key that signed it, bound to it by its nonce ("re")."""
    send(sock, request.key, {**header, "re": request["nonce"]}, payload, nbytes)


def recv_header(sock: socket.socket, token: str | Sequence[str], replay: ReplayWindow | None = None,
                idle_timeout: float | None = None, frame_timeout: float | None = None) -> Header:
    """Receive and authenticate a frame's header; its payload (``nbytes``) and trailer are still on
    the socket unless ``nbytes`` is 0 (then the trailer is read and checked here).

    ``token``: the key, or the keys tried in order (``key_index`` says which one matched).
    ``replay``: refuse a nonce seen before. ``idle_timeout``: wait at most this long for a frame to
    start (else :class:`IdleError`); ``frame_timeout``: once it started, the rest of the header must
    arrive within this many seconds, and each later read of the frame waits at most this long."""
    keys = (token,) if isinstance(token, str) else tuple(token)
    if idle_timeout is not None:
        sock.settimeout(idle_timeout)
    try:
        start = sock.recv(4)
    except TimeoutError:
        if idle_timeout is None:  # a client waiting for its response: the socket's own timeout
            raise
        raise IdleError(f"no frame within the {idle_timeout} s idle timeout") from None
    if not start:
        raise IdleError("peer closed the connection before a frame")
    deadline = None if frame_timeout is None else time.monotonic() + frame_timeout
    (n,) = struct.unpack(">I", _recv_growing(sock, 4, deadline, start))
    if n > MAX_HEADER:
        raise WireError(f"header of {n} bytes exceeds the {MAX_HEADER}-byte cap")
    sig = _recv_growing(sock, _SIG_LEN, deadline)
    body = _recv_growing(sock, n, deadline)  # not yet authenticated: memory only for what the peer really sent
    # bytes, not str: compare_digest refuses non-ASCII strings, and the signature is still the peer's
    index = next((i for i, k in enumerate(keys) if hmac.compare_digest(sign(k, body).encode(), sig)), None)
    try:
        if index is None:
            raise AuthError("bad or missing signature (wrong job token or admin key?)")
        fields = verify_request(keys[index], body, sig.decode("ascii"))
        if replay is not None:
            replay.check(fields)
    except AuthError as e:
        raise WireError(f"authentication failed: {e}") from None
    head = Header(fields)
    head.key, head.key_index, head.sig, head.pending = keys[index], index, sig, True
    nbytes = head.get("nbytes")
    if type(nbytes) is not int or not 0 <= nbytes <= MAX_PAYLOAD or not isinstance(head.get("nonce"), str):
        raise WireError("header needs an integer 'nbytes' within the payload cap and a 'nonce'")
    if nbytes == 0:
        _check_trailer(sock, head, _mac(head.key, sig), deadline)
    if frame_timeout is not None:
        sock.settimeout(frame_timeout)
    return head


def _check_trailer(sock: socket.socket, head: Header, mac, deadline: float | None = None) -> None:
    trailer = _recv_growing(sock, _MAC_LEN, deadline)
    head.pending = False
    if not hmac.compare_digest(mac.digest(), trailer):
        raise WireError("payload MAC mismatch: the frame was altered in transit")


def recv_payload(sock: socket.socket, head: Header, limit: int) -> bytes:
    """Read a frame's payload into memory (small payloads only: ``limit`` bytes at most) and check its MAC."""
    if not head.pending:
        return b""
    if head["nbytes"] > limit:
        raise WireError(f"payload of {head['nbytes']} bytes exceeds the {limit}-byte limit")
    mac = _mac(head.key, head.sig)
    data = _recv_exact(sock, head["nbytes"], mac)
    _check_trailer(sock, head, mac)
    return data


def recv_payload_into(sock: socket.socket, head: Header, out: BinaryIO) -> None:
    """Stream a (large) payload into a file, computing its MAC on the way; WireError once the
    trailer does not match, and the caller discards ``out`` on error (nothing of it is to be trusted before)."""
    if not head.pending:
        return
    left, mac = head["nbytes"], _mac(head.key, head.sig)
    buf = bytearray(min(_CHUNK, max(left, 1)))
    view = memoryview(buf)
    while left:
        k = sock.recv_into(view[:min(left, len(buf))])
        if k == 0:
            raise WireError(f"peer closed the connection with {left} of {head['nbytes']} payload bytes unsent")
        out.write(view[:k])
        mac.update(view[:k])
        left -= k
    _check_trailer(sock, head, mac)


def exchange(sock: socket.socket, token: str, header: dict, payload: bytes | BinaryIO | None = None,
             limit: int = MAX_HEADER, nbytes: int | None = None) -> tuple[dict, bytes]:
    """One request/response on an open connection; raises :class:`WireError` on refusal, and on a
    response that does not answer this request (its "re" is not our nonce: a replayed response)."""
    nonce = send(sock, token, header, payload, nbytes=nbytes)
    head = recv_header(sock, token)
    if head.get("re") != nonce:
        raise WireError("the response does not answer this request (a replayed or misdirected frame)")
    body = recv_payload(sock, head, limit)
    if not head.get("ok"):
        raise RefusedError(head.get("error") or "request refused")
    return head, body


def connect(addr: tuple[str, int], timeout: float) -> socket.socket:
    sock = socket.create_connection(addr, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def request(addr: tuple[str, int], token: str, header: dict, payload: bytes | BinaryIO | None = None,
            limit: int = MAX_HEADER, timeout: float = 30.0, nbytes: int | None = None) -> tuple[dict, bytes]:
    """One request/response exchange on a fresh connection."""
    with connect(addr, timeout) as sock:
        return exchange(sock, token, header, payload, limit, nbytes)


def write_admin_key(root: str | os.PathLike, key: str) -> Path:
    """Store a daemon's admin key as ``<root>/admin.key`` (0600, never through a symlink; ``root`` is
    the daemon's private 0700 directory), replaced atomically: a reader never sees half a key."""
    path = Path(root) / ADMIN_KEY_FILE
    tmp = path.with_name(f".{ADMIN_KEY_FILE}.{os.getpid()}")
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.replace(tmp, path)
    return path


def read_admin_key(path: str | os.PathLike) -> str:
    """A daemon's admin key from its key file (this user's, not a symlink); OSError or ValueError."""
    with os.fdopen(open_private(path, os.O_RDONLY)) as f:
        key = f.read().strip()
    if len(key) < 32:
        raise ValueError(f"{path}: not an admin key (expected at least 32 characters)")
    return key


def parse_addr(text: str, any_port: bool = False) -> tuple[str, int]:
    """``HOST:PORT`` → (host, port); ValueError with a clear message otherwise. ``any_port``
    accepts port 0 (a listener's "pick a free one")."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if any_port else 1) <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)

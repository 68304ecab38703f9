"""Framed, signed messages between workers, node daemons and peer daemons.

One frame = 4-byte big-endian header length, 64-byte hex HMAC-SHA256 signature of the header
(``hp.core.auth`` with the job token), the JSON header, then ``header["nbytes"]`` raw payload bytes
whose CRC32 is ``header["crc"]``. Headers are JSON and payloads are raw bytes: nothing that crosses
the wire is ever unpickled. Lengths are capped so a hostile or broken peer cannot make a daemon
allocate without bound.
"""

from __future__ import annotations

import socket
import struct
import zlib
from typing import BinaryIO

from hp.core.auth import AuthError, encode_request, verify_request
from hp.tiered_ckpt import fmt

MAX_HEADER = 4 << 20  # metadata JSON of a large model fits; anything bigger is an attack or a bug
MAX_PAYLOAD = 64 << 30
_CHUNK = 8 << 20
_SIG_LEN = 64


class WireError(Exception):
    """The peer closed the connection mid-frame, sent a bad frame, or failed authentication."""


class RefusedError(WireError):
    """The daemon understood the request and refused it (its reason is the message)."""


def _recv_growing(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes, the buffer growing with what arrived: an unauthenticated header may announce up
    to MAX_HEADER bytes, and a connection that announces them and sends nothing must not hold them."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 64 << 10))
        if not chunk:
            raise WireError(f"peer closed the connection after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def send(sock: socket.socket, token: str, header: dict, payload: bytes | BinaryIO | None = None,
         crc: int | None = None, nbytes: int | None = None) -> None:
    """Send one signed frame. ``payload`` is bytes, or a file streamed in chunks (then ``nbytes``
    and ``crc`` — already known from the seal — must be given)."""
    if payload is None or isinstance(payload, (bytes, bytearray, memoryview)):
        data = bytes(payload or b"")
        nbytes, crc = len(data), zlib.crc32(data) if crc is None else crc
        payload = None
    elif nbytes is None or crc is None:
        raise ValueError("streaming a file needs nbytes and crc")
    head = {**header, "nbytes": nbytes, "crc": crc}
    body, sig = encode_request(token, head)
    sock.sendall(struct.pack(">I", len(body)) + sig.encode() + body)
    if payload is None:
        sock.sendall(data)
        return
    for chunk in fmt.chunks(payload, nbytes, _CHUNK):
        sock.sendall(chunk)


def recv_header(sock: socket.socket, token: str) -> dict:
    """Receive and authenticate a frame's header; the payload (``nbytes``) is still on the socket."""
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > MAX_HEADER:
        raise WireError(f"header of {n} bytes exceeds the {MAX_HEADER}-byte cap")
    sig = _recv_exact(sock, _SIG_LEN).decode("ascii", "replace")
    body = _recv_growing(sock, n)  # not yet authenticated: memory only for what the peer really sent
    try:
        head = verify_request(token, body, sig)
    except AuthError as e:
        raise WireError(f"authentication failed: {e}") from None
    nbytes = head.get("nbytes")
    if not isinstance(nbytes, int) or not 0 <= nbytes <= MAX_PAYLOAD or not isinstance(head.get("crc"), int):
        raise WireError("header needs an integer 'nbytes' within the payload cap and an integer 'crc'")
    return head


def recv_payload(sock: socket.socket, head: dict, limit: int) -> bytes:
    """Read a frame's payload into memory (small payloads only: ``limit`` bytes at most)."""
    if head["nbytes"] > limit:
        raise WireError(f"payload of {head['nbytes']} bytes exceeds the {limit}-byte limit")
    data = _recv_exact(sock, head["nbytes"])
    if zlib.crc32(data) != head["crc"]:
        raise WireError("payload CRC mismatch")
    return data


def recv_payload_into(sock: socket.socket, head: dict, out: BinaryIO) -> None:
    """Stream a (large) payload into a file, checking its CRC; the caller discards ``out`` on error."""
    left, crc = head["nbytes"], 0
    buf = bytearray(min(_CHUNK, max(left, 1)))
    view = memoryview(buf)
    while left:
        k = sock.recv_into(view[:min(left, len(buf))])
        if k == 0:
            raise WireError(f"peer closed the connection with {left} of {head['nbytes']} payload bytes unsent")
        out.write(view[:k])
        crc = zlib.crc32(view[:k], crc)
        left -= k
    if crc != head["crc"]:
        raise WireError("payload CRC mismatch")


def exchange(sock: socket.socket, token: str, header: dict, payload: bytes | BinaryIO | None = None,
             limit: int = MAX_HEADER, crc: int | None = None, nbytes: int | None = None) -> tuple[dict, bytes]:
    """One request/response on an open connection; raises :class:`WireError` on refusal."""
    send(sock, token, header, payload, crc=crc, nbytes=nbytes)
    head = recv_header(sock, token)
    body = recv_payload(sock, head, limit)
    if not head.get("ok"):
        raise RefusedError(head.get("error") or "request refused")
    return head, body


def connect(addr: tuple[str, int], timeout: float) -> socket.socket:
    sock = socket.create_connection(addr, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def request(addr: tuple[str, int], token: str, header: dict, payload: bytes | BinaryIO | None = None,
            limit: int = MAX_HEADER, timeout: float = 30.0, crc: int | None = None,
            nbytes: int | None = None) -> tuple[dict, bytes]:
    """One request/response exchange on a fresh connection."""
    with connect(addr, timeout) as sock:
        return exchange(sock, token, header, payload, limit, crc, nbytes)


def parse_addr(text: str, any_port: bool = False) -> tuple[str, int]:
    """``HOST:PORT`` → (host, port); ValueError with a clear message otherwise. ``any_port``
    accepts port 0 (a listener's "pick a free one")."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if any_port else 1) <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)

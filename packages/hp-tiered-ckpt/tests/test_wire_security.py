"""#13 finding 5: what the daemon wire authenticates, against real ``hp ckpt daemon`` processes.

A payload altered in transit, a frame replayed verbatim, an old response, `peers`/`gc` with only the
job token, a silent or slow-loris connection: each is refused or closed, and nothing is stored."""

from __future__ import annotations

import os
import secrets
import socket
import stat
import threading
import time
import zlib

import pytest

from hp.core.auth import new_token
from hp.tiered_ckpt import wire
from hp.tiered_ckpt.client import DaemonClient


def _save_id() -> str:
    return f"{time.time_ns():016x}{secrets.token_hex(8)}"


def _put_head(step: int, payload: bytes) -> dict:
    return {"op": "put", "ns": "job", "step": step, "world": 1, "rank": 0, "save_id": _save_id(),
            "items": [[0, len(payload), zlib.crc32(payload)]]}


def _closed(s: socket.socket, within: float = 10.0) -> bool:
    """The daemon closed ``s`` (without a reply) within ``within`` seconds."""
    s.settimeout(within)
    try:
        return s.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def _wait_log(node, text: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in node.output():
        assert time.monotonic() < deadline, f"{text!r} not in the daemon's log:\n{node.output()[-2000:]}"
        time.sleep(0.05)


def test_a_payload_altered_in_transit_is_refused_and_nothing_is_stored(daemons, token):
    node = daemons("node0", replicas=0)
    payload = os.urandom(3 << 20)
    frame = bytearray(wire.frame(token, _put_head(1, payload), payload))
    frame[len(frame) - 32 - 1000] ^= 0x01  # one payload bit; the header and its signature are intact
    with socket.create_connection(("127.0.0.1", node.port)) as s:
        s.sendall(frame)
        assert _closed(s)
    _wait_log(node, "payload MAC mismatch")
    assert [s for s in node.client.steps("job") if s["files"] or s["complete"]] == []
    assert not [p for p in node.root.rglob("*") if p.is_file() and p.name != wire.ADMIN_KEY_FILE]

    with socket.create_connection(("127.0.0.1", node.port)) as s:  # the same frame unaltered is stored
        s.sendall(wire.frame(token, _put_head(1, payload), payload))
        assert wire.recv_header(s, token)["ok"]
    assert node.client.fetch("job", 1, 0, 0, len(payload)) == payload


class _Proxy:
    """One TCP connection forwarded to ``port``; flips the byte at offset ``flip`` of what the daemon sends."""

    def __init__(self, port: int, flip: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port, self.flip, self.target = self.listener.getsockname()[1], flip, port
        threading.Thread(target=self._run, daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, flip: int | None) -> None:
        seen = 0
        try:
            while chunk := src.recv(1 << 16):
                if flip is not None and seen <= flip < seen + len(chunk):
                    chunk = bytearray(chunk)
                    chunk[flip - seen] ^= 0x80
                seen += len(chunk)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _run(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
        self._pump(upstream, client, self.flip)

    def close(self) -> None:
        self.listener.close()


def test_a_fetched_payload_altered_on_path_is_refused_by_the_client(daemons, token):
    node = daemons("node0", replicas=0)
    payload = os.urandom(1 << 20)
    with socket.create_connection(("127.0.0.1", node.port)) as s:
        s.sendall(wire.frame(token, _put_head(1, payload), payload))
        assert wire.recv_header(s, token)["ok"]
    proxy = _Proxy(node.port, flip=100_000)  # well inside the 1 MiB payload of the fetch's response
    try:
        c = DaemonClient(("127.0.0.1", proxy.port), token, timeout=10)
        with pytest.raises(wire.WireError, match="payload MAC mismatch"):
            c.fetch("job", 1, 0, 0, len(payload))
        c.close()
    finally:
        proxy.close()


def test_a_captured_frame_replayed_verbatim_is_refused(daemons, token):
    """The old finding: a captured `gc` was accepted again on a new connection within the clock skew."""
    node = daemons("node0", replicas=0)
    for captured in (wire.frame(node.admin_key, {"op": "gc", "ns": "job", "keep": 1}),
                     wire.frame(token, {"op": "list", "ns": "job"})):
        with socket.create_connection(("127.0.0.1", node.port)) as s:
            s.sendall(captured)
            head = wire.recv_header(s, [token, node.admin_key])
            assert head["ok"]
        with socket.create_connection(("127.0.0.1", node.port)) as s:  # verbatim, on a new connection
            s.sendall(captured)
            assert _closed(s)
        with socket.create_connection(("127.0.0.1", node.port)) as s:  # or on the same one, after a good frame
            s.sendall(wire.frame(token, {"op": "ping"}) + captured)
            assert wire.recv_header(s, token)["ok"]
            assert _closed(s)
    _wait_log(node, "nonce already seen")
    assert node.client.ping()["ok"]


def _fake_daemon(answer) -> tuple[socket.socket, int]:
    """A server answering each request with ``answer(request_header)``'s header, signed with the token."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                try:
                    while True:
                        head = wire.recv_header(conn, answer.token)
                        wire.send(conn, answer.token, answer(head))
                except (OSError, wire.WireError):
                    pass

    threading.Thread(target=serve, daemon=True).start()
    return listener, listener.getsockname()[1]


@pytest.mark.parametrize("re", ["0" * 32, None, "request"])
def test_a_response_not_bound_to_its_request_is_refused_by_the_client(re):
    token = new_token()
    seen: list[str] = []

    def answer(head: dict) -> dict:
        seen.append(head["nonce"])
        if re == "request":  # the response to an earlier request, replayed to this one
            return {"ok": True, "re": seen[0], "address": ["x", 1]}
        return {"ok": True, "address": ["x", 1], **({"re": re} if re else {})}

    answer.token = token
    listener, port = _fake_daemon(answer)
    try:
        if re == "request":
            with socket.create_connection(("127.0.0.1", port)) as s:
                assert wire.exchange(s, token, {"op": "ping"})[0]["ok"]  # the first one is answered right
        c = DaemonClient(("127.0.0.1", port), token, timeout=5)
        with pytest.raises(wire.WireError, match="does not answer this request"):
            c.ping()
        c.close()
    finally:
        listener.close()


def test_peers_and_gc_need_the_admin_key(daemons, token):
    node = daemons("node0", replicas=0)
    worker = DaemonClient(("127.0.0.1", node.port), token, timeout=10)  # every worker and peer holds the token
    with pytest.raises(wire.RefusedError, match="admin key"):
        worker.set_peers(["10.0.0.66:1"])  # would redirect replication to an attacker's node
    with pytest.raises(wire.RefusedError, match="admin key"):
        worker.gc("job", 1)
    assert worker.status()["peers"] == []
    worker.close()

    stranger = DaemonClient(("127.0.0.1", node.port), new_token(), timeout=10, admin_key=new_token())
    with pytest.raises(wire.WireError, match="closed"):
        stranger.gc("job", 1)  # neither the job token nor this daemon's admin key: not even answered

    assert node.client.set_peers(["127.0.0.1:1"]) == [["127.0.0.1", 1]]  # the admin key (the conftest reads it)
    assert node.client.gc("job", 1) == []
    operator = DaemonClient(("127.0.0.1", node.port), None, timeout=10, admin_key=node.admin_key)
    assert operator.status()["peers"] == [["127.0.0.1", 1]]  # any op may be signed with the admin key
    operator.close()


def test_the_admin_key_file_is_0600_in_a_0700_directory(daemons):
    node = daemons("node0", replicas=0)
    key_file = node.root / wire.ADMIN_KEY_FILE
    st, dst = os.lstat(key_file), os.lstat(node.root)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    assert stat.S_IMODE(dst.st_mode) == 0o700
    assert key_file.read_text().strip() == node.admin_key and len(node.admin_key) == 64


def test_an_idle_connection_is_closed_and_the_client_reconnects(daemons, token):
    node = daemons("node0", replicas=0, args=["--idle-timeout", "1"])
    with socket.create_connection(("127.0.0.1", node.port)) as s:
        t0 = time.monotonic()
        assert _closed(s, within=30)
        assert 0.5 < time.monotonic() - t0 < 20
    c = DaemonClient(("127.0.0.1", node.port), token, timeout=10)
    assert c.ping()["ok"]
    first = c._sock
    time.sleep(2.0)  # the daemon closes it meanwhile
    assert c.steps("job") == []  # transparently on a new connection
    assert c._sock is not first
    c.close()


def test_a_header_that_stalls_is_closed_after_the_frame_timeout(daemons, token):
    node = daemons("node0", replicas=0, args=["--frame-timeout", "1", "--idle-timeout", "120"])
    frame = wire.frame(token, {"op": "ping"})
    for sent in (frame[:2], frame[:40], frame[:-10]):  # in the length, the signature, the header
        with socket.create_connection(("127.0.0.1", node.port)) as s:
            s.sendall(sent)
            t0 = time.monotonic()
            assert _closed(s, within=30)
            assert time.monotonic() - t0 < 20  # the frame timeout, not the idle one
    _wait_log(node, "frame timeout")
    assert node.client.ping()["ok"]


def test_a_non_ascii_signature_is_refused_not_a_crash(daemons, token):
    node = daemons("node0", replicas=0)
    body = b'{"op": "ping"}'
    with socket.create_connection(("127.0.0.1", node.port)) as s:
        s.sendall(len(body).to_bytes(4, "big") + b"\xff" * 64 + body + b"\0" * 32)
        assert _closed(s)
    _wait_log(node, "authentication failed")
    assert "Traceback" not in node.output() and node.client.ping()["ok"]

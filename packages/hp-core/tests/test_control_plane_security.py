"""Attacks on the controller's HTTP wire, each reproduced against a real ControlServer over loopback and
refused: verb swap, replayed request, forged answer, one node speaking for another, a short token, a
slowloris client, a connection flood and a log flood."""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hp.core import auth
from hp.core.control_plane import ControlClient, ControlServer
from hp.core.controller import Controller, ControllerConfig
from hp.core.errors import ControlPlaneError
from hp.core.protocol import JobState
from hp.core.services import NodeContext
from hp.testing import HP, free_port

TOKEN = "k" * 64


def serve(nnodes: int = 1, **limits) -> ControlServer:
    controller = Controller(ControllerConfig(nnodes=nnodes, max_restarts=3))
    return ControlServer(controller, TOKEN, "127.0.0.1", free_port(), **limits).start()


@pytest.fixture
def server():
    srv = serve()
    yield srv
    srv.stop()


def running(srv: ControlServer) -> None:
    """Every node of ``srv``'s job joins, each signing as itself: the job runs (generation 1)."""
    for n in range(srv.controller.config.nnodes):
        ControlClient(srv.endpoint, TOKEN, node=n).call("join", {"node_rank": n, "nproc": 1, "host": f"h{n}"})
    assert srv.controller.state is JobState.RUNNING and srv.controller.generation == 1


class _Recorder(BaseHTTPRequestHandler):
    """Stands where an attacker on the job's network is: records the request it is sent."""

    def do_POST(self) -> None:  # noqa: N802
        self.server.captured = (self.path, dict(self.headers), self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args) -> None:
        pass


def capture(verb: str, payload: dict, node: int | str) -> tuple[str, dict, bytes]:
    """The exact request a genuine client sends for ``verb`` (path, headers, body), as captured on the wire."""
    recorder = ThreadingHTTPServer(("127.0.0.1", free_port()), _Recorder)
    threading.Thread(target=recorder.handle_request, daemon=True).start()
    try:
        ControlClient(f"127.0.0.1:{recorder.server_address[1]}", TOKEN, timeout_s=5, node=node).call(verb, payload)
    except ControlPlaneError:
        pass  # the recorder's answer is not signed: the client refuses it
    finally:
        recorder.server_close()
    return recorder.captured


def post(srv: ControlServer, path: str, headers: dict, body: bytes) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=5)
    keep = {k: v for k, v in headers.items() if k.lower() not in ("host", "content-length", "connection")}
    conn.request("POST", path, body=body, headers=keep)
    response = conn.getresponse()
    raw = response.read()
    conn.close()
    return response.status, dict(response.headers), json.loads(raw)


def test_a_captured_heartbeat_replayed_to_another_verb_is_refused(server):
    """Review: a heartbeat's body and signature sent to /v1/node_stopping failed the job."""
    running(server)
    path, headers, body = capture("heartbeat", {"node_rank": 0, "generation": 1}, node=0)
    status, _, answer = post(server, "/v1/node_stopping", headers, body)
    assert status == 401 and "signature" in answer["error"]
    assert server.controller.state is JobState.RUNNING
    status, _, answer = post(server, path, headers, body)  # the genuine request, where it was going: served
    assert status == 200 and answer["state"] == "running"


def test_a_replayed_request_is_refused(server):
    """Review: any request replayed within the ±300 s clock window was accepted (e.g. a dead node's heartbeat)."""
    running(server)
    path, headers, body = capture("heartbeat", {"node_rank": 0, "generation": 1}, node=0)
    assert post(server, path, headers, body)[0] == 200
    status, response_headers, answer = post(server, path, headers, body)
    assert status == 401 and "replayed" in answer["error"]
    # the refusal is signed too, bound to the request's nonce
    nonce = json.loads(body)["nonce"]
    auth.verify_response(auth.node_key(TOKEN, "0"), 401, json.dumps(answer).encode(), nonce,
                         response_headers[auth.RESPONSE_SIGNATURE_HEADER])
    assert server.refusals.by_status[401] == 1


def _fake_controller(answer: dict, forge) -> ThreadingHTTPServer:
    """A server on the controller's endpoint answering ``answer``, signed as ``forge(key, status, body, nonce)`` says."""

    class Fake(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            body = json.dumps(answer).encode()
            key = auth.node_key(TOKEN, self.headers[auth.NODE_HEADER])
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            signature = forge(key, 200, body, request.get("nonce", ""))
            if signature is not None:
                self.send_header(auth.RESPONSE_SIGNATURE_HEADER, signature)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    fake = ThreadingHTTPServer(("127.0.0.1", free_port()), Fake)
    threading.Thread(target=fake.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return fake


@pytest.mark.parametrize("forge", [
    pytest.param(lambda key, status, body, nonce: None, id="unsigned"),
    pytest.param(lambda key, status, body, nonce: auth.sign_response(auth.node_key("x" * 64, "0"), status, body, nonce),
                 id="another-key"),
    pytest.param(lambda key, status, body, nonce: auth.sign_response(key, status, body, "0" * 32), id="another-request"),
    pytest.param(lambda key, status, body, nonce: auth.sign_response(key, 409, body, nonce), id="another-status"),
    pytest.param(lambda key, status, body, nonce: auth.sign_response(key, status, body + b" ", nonce), id="altered"),
])
def test_a_forged_answer_is_refused_by_the_client(forge):
    """Review: agents act on answers (``ss -K dst <addr>`` with an address from ``lost``): unsigned, they
    could be told to cut their connections to any address."""
    lie = {"state": "running", "generation": 1, "lost": ["10.0.0.1"], "promotions": [], "ranks": {}}
    fake = _fake_controller(lie, forge)
    try:
        client = ControlClient(f"127.0.0.1:{fake.server_address[1]}", TOKEN, timeout_s=5, node=0)
        with pytest.raises(ControlPlaneError, match="bad or missing response signature") as e:
            client.call("heartbeat", {"node_rank": 0, "generation": 1})
        assert e.value.body == {} and len(str(e.value).splitlines()) == 1
    finally:
        fake.shutdown()
        fake.server_close()


def test_a_correctly_signed_answer_is_accepted():
    fake = _fake_controller({"ok": True}, auth.sign_response)
    try:
        assert ControlClient(f"127.0.0.1:{fake.server_address[1]}", TOKEN, node=0).call("state", {}) == {"ok": True}
    finally:
        fake.shutdown()
        fake.server_close()


def test_refusals_are_signed_and_their_body_is_given():
    srv = serve()
    try:
        running(srv)
        with pytest.raises(ControlPlaneError) as e:
            ControlClient(srv.endpoint, TOKEN, node=0).call("node_done", {"node_rank": 0, "generation": 7})
        assert e.value.status == 409 and e.value.body["generation"] == 1
    finally:
        srv.stop()


def test_one_nodes_key_cannot_speak_for_another_node():
    """Review: one shared token and identity a payload field: node 0's process could stop node 1."""
    srv = serve(nnodes=2)
    try:
        running(srv)
        for who in (0, auth.OPERATOR):
            with pytest.raises(ControlPlaneError, match="cannot speak for node 1") as e:
                ControlClient(srv.endpoint, TOKEN, node=who).call(
                    "node_stopping", {"node_rank": 1, "generation": 1, "reason": "forged"})
            assert e.value.status == 403
        with pytest.raises(ControlPlaneError, match="cannot speak for node 0"):  # another spelling, another key
            ControlClient(srv.endpoint, TOKEN, node="00").call("heartbeat", {"node_rank": 0, "generation": 1})
        assert srv.controller.state is JobState.RUNNING
        # a body signed with node 0's key, naming node 1 in its header: the key is not node 1's
        body, signature = auth.encode_request(auth.node_key(TOKEN, "0"), {"node_rank": 1, "generation": 1},
                                              method="POST", path="/v1/node_stopping")
        status, _, _ = post(srv, "/v1/node_stopping", {auth.NODE_HEADER: "1", auth.SIGNATURE_HEADER: signature}, body)
        assert status == 401 and srv.controller.state is JobState.RUNNING
        # the operator may do what names no node
        assert ControlClient(srv.endpoint, TOKEN, node=auth.OPERATOR).call("state", {})["state"] == "running"
    finally:
        srv.stop()


@pytest.mark.parametrize("args", [["run", "-m", "x"], ["controller", "--nnodes", "1", "--port", "0"]])
def test_a_short_token_is_refused_in_one_line(tmp_path, args):
    secret = "s3cr3t-but-short"
    out = subprocess.run([*HP, *args], capture_output=True, text=True, timeout=60,
                         env={**os.environ, auth.TOKEN_ENV: secret}, cwd=tmp_path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hp: error: "), out.stderr
    assert "fewer than the 32" in lines[0] and secret not in out.stderr


def test_a_short_token_file_is_refused(tmp_path):
    (tmp_path / "token").write_text("abc\n")
    out = subprocess.run([*HP, "controller", "--nnodes", "1", "--port", "0", "--token-file", str(tmp_path / "token")],
                         capture_output=True, text=True, timeout=60, env={**os.environ, auth.TOKEN_ENV: ""})
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--token-file" in out.stderr and "fewer than the 32" in out.stderr


def test_tokens_stay_out_of_reprs():
    node = NodeContext(run_id="r", node_rank=0, nnodes=1, address="127.0.0.1", log_dir="/tmp", token=TOKEN)
    srv = serve()
    try:
        for thing in (node, srv, ControlClient(srv.endpoint, TOKEN, node=0)):
            assert TOKEN not in repr(thing) and auth.node_key(TOKEN, "0") not in repr(thing)
    finally:
        srv.stop()


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float:
    """Seconds until the server closed ``sock`` (while it trickles a byte every 0.1 s); fails past ``seconds``."""
    start = time.monotonic()
    sock.settimeout(0.1)
    while time.monotonic() - start < seconds:
        try:
            if sock.recv(1024) == b"":
                return time.monotonic() - start
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - start
        if trickle:
            try:
                sock.send(trickle)
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - start
    raise AssertionError(f"connection still open after {seconds} s")


@pytest.mark.parametrize("sent, trickle", [
    (b"POST /v1/heartbeat HTTP/1.1\r\n", b"X"),  # headers that never end
    (b"POST /v1/heartbeat HTTP/1.1\r\nContent-Length: 1000\r\n\r\n{", b" "),  # a body that never ends
    (b"", b""),  # silence
])
def test_a_slowloris_connection_is_dropped(sent, trickle):
    srv = serve(request_timeout_s=0.5)
    try:
        with socket.create_connection(srv.server_address[:2]) as sock:
            sock.sendall(sent)
            assert _closed_within(sock, 3.0, trickle) < 2.0
        time.sleep(0.1)
        assert srv.refusals.by_status[408] == 1
    finally:
        srv.stop()


def test_connections_beyond_the_cap_are_closed_at_once():
    srv = serve(request_timeout_s=3.0, max_connections=2)
    try:
        held = [socket.create_connection(srv.server_address[:2]) for _ in range(2)]
        time.sleep(0.2)  # both accepted and being served (silently)
        with socket.create_connection(srv.server_address[:2]) as extra:
            assert _closed_within(extra, 1.0) < 1.0
        assert srv.refusals.by_status[503] == 1
        for sock in held:
            sock.close()
        time.sleep(0.2)
        assert ControlClient(srv.endpoint, TOKEN, node=auth.OPERATOR).call("state", {})["state"] == "rendezvous"
    finally:
        srv.stop()


def test_a_flood_of_bad_requests_is_counted_not_logged_line_by_line(caplog):
    """Review: every refused request was logged: 300 requests, 300 warnings (and decision-log entries)."""
    caplog.set_level(logging.INFO, logger="hp.controller")
    srv = serve()
    try:
        conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=5)
        for i in range(300):
            conn.request("POST", "/v1/node_stopping", body=b'{"node_rank": 0}', headers={auth.NODE_HEADER: "0"})
            response = conn.getresponse()
            response.read()
            assert response.status == 401
            conn.close()
    finally:
        srv.stop()  # flushes the interval's summary
    assert srv.refusals.total == 300 and srv.refusals.by_status[401] == 300
    lines = [r.getMessage() for r in caplog.records if r.name == "hp.controller" and r.levelno >= logging.INFO]
    assert len(lines) <= 10, lines
    assert any("295 more refused" in line for line in lines), lines
    refused = [d for d in srv.controller.decisions if d["decision"] == "refused"]
    assert len(refused) <= 10 and srv.controller.state is JobState.RENDEZVOUS

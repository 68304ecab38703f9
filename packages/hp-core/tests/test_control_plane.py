"""The controller over real HTTP: authentication, fencing and refusals on the wire."""

from __future__ import annotations

import http.client
import json

import pytest

from hp.core import auth
from hp.core.control_plane import ControlClient, ControlServer
from hp.core.controller import Controller, ControllerConfig
from hp.core.errors import ControlPlaneError

TOKEN = "k" * 64


@pytest.fixture
def server():
    controller = Controller(ControllerConfig(nnodes=1, max_restarts=3))
    srv = ControlServer(controller, TOKEN, "127.0.0.1", 0).start()
    yield srv
    srv.stop()


def raw_post(srv: ControlServer, path: str, body: bytes, headers: dict) -> tuple[int, dict]:
    host, port = srv.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=5)
    conn.request("POST", path, body=body, headers=headers)
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def test_binds_only_the_interface_it_is_given(server):
    assert server.server_address[0] == "127.0.0.1"


def test_signed_requests_are_served(server):
    client = ControlClient(server.endpoint, TOKEN)
    client.call("join", {"node_rank": 0, "nproc": 2, "host": "h"})
    assert client.call("rendezvous", {"node_rank": 0})["world_size"] == 2


def test_wrong_token_is_refused_logged_and_changes_nothing(server, caplog):
    with pytest.raises(ControlPlaneError) as e:
        ControlClient(server.endpoint, "x" * 64).call("join", {"node_rank": 0, "nproc": 2, "host": "h"})
    assert e.value.status == 401 and "unauthenticated" in str(e.value)
    assert server.controller.nodes == {}
    assert server.controller.decisions[-1]["decision"] == "refused"
    assert any("refused join" in r.getMessage() for r in caplog.records)


def test_old_generation_is_refused_over_the_wire(server):
    client = ControlClient(server.endpoint, TOKEN)
    client.call("join", {"node_rank": 0, "nproc": 2, "host": "h"})
    client.call("worker_failed", {"node_rank": 0, "generation": 1, "rank": 1, "holder": "r1.0", "signal": "SIGKILL"})
    with pytest.raises(ControlPlaneError) as e:
        client.call("worker_failed", {"node_rank": 0, "generation": 1, "rank": 0, "holder": "r0.0", "signal": "SIGKILL"})
    assert e.value.status == 409 and e.value.body["generation"] == 2
    assert server.controller.restarts == 1
    assert server.controller.decisions[-1]["reason"] == "stale generation 1 (current is 2)"


@pytest.mark.parametrize("body, sign", [
    (b"not json", True),  # signed garbage
    (b'["a", "list"]', True),
    (b'{"node_rank": 0}', True),  # no timestamp
    (b'{"node_rank": 0, "ts": 1}', True),  # replayed from long ago
    (b'{"node_rank": 0, "ts": 1e18}', False),  # unsigned
])
def test_malformed_or_unsigned_bodies_are_refused(server, body, sign):
    headers = {auth.SIGNATURE_HEADER: auth.sign(TOKEN, body)} if sign else {}
    status, answer = raw_post(server, "/v1/join", body, headers)
    assert status == 401 and "error" in answer
    assert server.controller.nodes == {}


def test_bad_path_and_length_are_refused(server):
    status, _ = raw_post(server, "/elsewhere", b"{}", {})
    assert status == 400
    body, signature = auth.encode_request(auth.node_key(TOKEN, auth.OPERATOR), {"x": 1}, method="POST", path="/v1/nope")
    status, answer = raw_post(server, "/v1/nope", body,
                              {auth.SIGNATURE_HEADER: signature, auth.NODE_HEADER: auth.OPERATOR})
    assert status == 404 and "unknown request" in answer["error"]


def test_unreachable_controller_is_a_clear_error(free_port):
    with pytest.raises(ControlPlaneError, match="unreachable") as e:
        ControlClient(f"127.0.0.1:{free_port}", TOKEN, timeout_s=1).call("state", {})
    assert e.value.status == 0


def test_a_failure_report_tells_several_nodes_on_one_reading_of_the_state():
    """hp.core.node_failure over the wire, as the operator: two nodes lost in one report (each loss a new
    generation, the second fenced by the first's), a report about an earlier run of a node skipped, and an
    unreachable controller leaves everything to ask again."""
    from hp.core.node_failure import FailureReport

    controller = Controller(ControllerConfig(nnodes=3))
    srv = ControlServer(controller, TOKEN, "127.0.0.1", 0).start()
    try:
        for n in range(3):
            controller.handle("join", {"node_rank": n, "nproc": 1, "host": f"h{n}", "spares": 1, "incarnation": f"u{n}"})
        said: list[str] = []
        report = FailureReport(srv.endpoint, TOKEN, log=said.append)
        failures = [(1, "node b NotReady", "u1"), (2, "pod c deleted", "u2"), (0, "pod a deleted", "u0-before")]
        assert report.report_all(failures) == []
        assert controller.nodes[1].lost and controller.nodes[2].lost and not controller.nodes[0].lost
        assert controller.generation == 3 and any("failed as u0-before" in m for m in said)
    finally:
        srv.stop()
    said.clear()
    assert FailureReport(srv.endpoint, TOKEN, log=said.append).report_all(failures[:1]) == failures[:1]
    assert said and "could not report node 1's failure" in said[0]

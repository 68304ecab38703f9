"""Node services (``hp run --service``): spec parsing and the endpoint exchange through the job's store.
The whole lifecycle under ``hp run`` is tested with a real service in hp-tiered-ckpt's tests."""

from __future__ import annotations

import threading

import pytest

from hp.core import get_backend
from hp.core.errors import UnknownBackendError, UsageError
from hp.core.services import NodeContext, ServiceError, ServiceHost, parse_service_spec


@pytest.mark.parametrize("spec, parsed", [
    ("ckpt", ("ckpt", {})),
    ("ckpt:replicas=2,url=s3://bucket/a=b", ("ckpt", {"replicas": "2", "url": "s3://bucket/a=b"})),
    ("my-svc:", ("my-svc", {})),
])
def test_service_spec_parses(spec, parsed):
    assert parse_service_spec(spec) == parsed


@pytest.mark.parametrize("spec", ["", ":a=1", "ck pt", "ckpt:replicas", "ckpt:=1"])
def test_bad_service_spec_is_a_usage_error(spec):
    with pytest.raises(UsageError):
        parse_service_spec(spec)


def test_unknown_service_names_the_family():
    with pytest.raises(UnknownBackendError, match="node_service"):
        ServiceHost(["no-such-service"])


def _node(rank: int, nnodes: int = 2) -> NodeContext:
    return NodeContext(run_id="r", node_rank=rank, nnodes=nnodes, address="127.0.0.1", log_dir="/tmp", token="t")


def test_endpoints_are_exchanged_through_the_store():
    server = get_backend("store", "tcp").serve("127.0.0.1")
    try:
        got: dict[int, list[str]] = {}

        def node(rank: int) -> None:
            store = get_backend("store", "tcp").connect(server.host, server.port)
            got[rank] = ServiceHost._exchange(store, "svc", _node(rank), f"ep{rank}", 30, lambda: None)

        threads = [threading.Thread(target=node, args=(r,)) for r in (1, 0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert got == {0: ["ep0", "ep1"], 1: ["ep0", "ep1"]}
    finally:
        server.close()


def test_a_node_that_never_publishes_is_named_and_the_wait_keeps_the_agent_alive():
    server = get_backend("store", "tcp").serve("127.0.0.1")
    beats = []
    try:
        with pytest.raises(ServiceError, match=r"nodes \[1\] did not publish"):
            ServiceHost._exchange(server.store, "svc", _node(0), "ep0", 2.5, lambda: beats.append(1))
        assert beats  # the agent heartbeats the controller while it waits
    finally:
        server.close()


def test_a_forged_endpoint_is_refused_and_a_node_publishes_its_own_again():
    from hp.core.protocol import node_service_key
    from hp.core.signed_values import seal

    server = get_backend("store", "tcp").serve("127.0.0.1")
    try:
        # unsealed, and sealed for another key: a node would connect its service to the forger
        server.store.set(node_service_key("svc", 1), "evil:1")
        with pytest.raises(ServiceError, match=r"nodes \[1\] did not publish"):
            ServiceHost._exchange(server.store, "svc", _node(0), "ep0", 1.5, lambda: None)
        got: dict[int, list[str]] = {}

        def node(rank: int) -> None:
            store = get_backend("store", "tcp").connect(server.host, server.port)
            got[rank] = ServiceHost._exchange(store, "svc", _node(rank), f"ep{rank}", 30, lambda: None)

        first = threading.Thread(target=node, args=(0,))
        first.start()
        server.store.set(node_service_key("svc", 0), seal("t", node_service_key("svc", 1), "evil:0"))
        second = threading.Thread(target=node, args=(1,))
        second.start()
        for t in (first, second):
            t.join(60)
        assert got == {0: ["ep0", "ep1"], 1: ["ep0", "ep1"]}
    finally:
        server.close()

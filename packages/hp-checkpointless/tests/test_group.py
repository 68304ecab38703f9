"""Forming a generation's group (``hp.checkpointless.group``) against a real TCPStore and gloo."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from hp.checkpointless.group import FormingStore
from hp.checkpointless.recovery import CollectiveError
from hp.core import get_backend


@pytest.fixture
def server():
    served = get_backend("store", "tcp").serve("127.0.0.1")
    yield served
    served.close()


def client(server) -> dist.Store:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))


def test_forming_store_passes_keys_through_and_times_out_on_its_own_limit(server):
    store = FormingStore(client(server), lambda: None, timedelta(seconds=60))
    store.set("a", "1")
    assert store.get("a") == b"1" and store.check(["a"]) and store.add("n", 2) == 2
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        store.wait(["never"], timedelta(seconds=0.5))
    assert time.monotonic() - start < 5


def test_forming_store_gives_up_once_the_generation_is_superseded(server):
    reasons = iter([None, None, "generation 3 superseded by 4"])
    store = FormingStore(client(server), lambda: next(reasons), timedelta(seconds=60), slice_s=0.05)
    with pytest.raises(CollectiveError, match="superseded by 4"):
        store.get("never")


def test_a_group_given_up_while_forming_leaves_the_next_generation_formable(server):
    # the flaky elastic-kill-joiner-during-grow: the joiner died after the arrival barrier; its peer
    # waited the group's whole 60 s init timeout, then used a group name the fresh joiner did not
    worker = Path(__file__).with_name("group_worker.py")
    procs = [subprocess.Popen([sys.executable, str(worker), role, str(server.port)], stdout=subprocess.PIPE, text=True)
             for role in ("abandon", "fresh")]
    try:
        outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0]["abandoned_after_s"] < 10, outs[0]  # not the 60 s init timeout
    assert "superseded" in outs[0]["error"]
    assert outs[0]["sum"] == outs[1]["sum"] == [2.0, 2.0]

"""Memory tier: the node daemon owns sealed shards, so a SIGKILLed worker loses nothing; a killed
daemon (node loss) is covered by the replica its peer holds; a peer dying mid-transfer corrupts
nothing the receiver already had."""

from __future__ import annotations

import os
import signal
import socket
import zlib
from pathlib import Path

from hp.testing import wait_for
from hp.tiered_ckpt import wire


def test_worker_sigkill_after_save_restores_from_memory_tier(daemons, ranks, shm):
    node = daemons("node0", replicas=0)
    ready = shm / "saved"
    job = ranks(1, ["save", "--ns", "job", "--daemon", node.addr, "--steps", "1,2", "--ready-file", str(ready)])
    wait_for(lambda: Path(f"{ready}.0").exists(), 120, "the worker's saves")
    os.kill(job.procs[0].pid, signal.SIGKILL)  # the worker dies right after its save returned
    job.procs[0].wait()
    out = ranks(1, ["load", "--ns", "job", "--daemon", node.addr]).results()
    assert (out[0]["step"], out[0]["tier"], out[0]["tiers_used"], out[0]["ok"]) == (2, "memory", ["memory"], True)


def test_every_rank_is_told_when_there_is_no_checkpoint_to_load(daemons, ranks):
    node = daemons("empty", replicas=0)
    out = ranks(2, ["load", "--ns", "job", "--daemon", node.addr]).results()
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o.get("error", "").startswith("NoCheckpointError") for o in out), out


def test_node_daemon_killed_restores_from_peer_replica(daemons, ranks):
    b = daemons("nodeB", replicas=1)
    a = daemons("nodeA", replicas=1, peers=[b.addr])
    ranks(2, ["save", "--ns", "job", "--daemon", a.addr, "--peers", b.addr, "--steps", "3"]).results()
    wait_for(lambda: any(s["step"] == 3 and s["complete"] for s in b.client.steps("job")), 60,
             "node B holding a complete replica of step 3")
    a.kill()  # node A's memory is gone
    out = ranks(2, ["load", "--ns", "job", "--daemon", a.addr, "--peers", b.addr]).results()
    assert [(o["step"], o["tier"], o["tiers_used"], o["ok"]) for o in out] == [(3, "peer", ["peer"], True)] * 2


def _put(node, token: str, step: int, payload: bytes, send: int | None = None) -> None:
    """A peer's replica upload; ``send`` < len(payload) makes the peer die mid-transfer."""
    from hp.tiered_ckpt.signed import new_save_id

    head = {"op": "put", "ns": "job", "step": step, "world": 1, "rank": 0, "save_id": new_save_id(),
            "items": [[0, len(payload), zlib.crc32(payload)]]}
    frame = wire.frame(token, head, payload)
    with socket.create_connection(("127.0.0.1", node.port)) as s:
        s.sendall(frame if send is None else frame[:len(frame) - len(payload) - 32 + send])
        if send is None:
            assert wire.recv_header(s, token)["ok"]


def test_dead_peer_mid_transfer_leaves_existing_copies_intact(daemons, token):
    node = daemons("node0", replicas=0)
    good = os.urandom(3 << 20)
    _put(node, token, 1, good)
    _put(node, token, 1, os.urandom(3 << 20), send=1 << 20)  # same step, peer dies after 1 MiB
    _put(node, token, 2, os.urandom(3 << 20), send=1 << 20)  # a new step, peer dies after 1 MiB
    # both dead peers noticed: each connection removes its partial file before it logs (fc: waiting for
    # the first message alone found the second peer's partial file still there)
    died = "put failed: peer closed the connection"
    wait_for(lambda: node.output().count(died) >= 2, 30, "the daemon to notice both dead peers")
    assert node.client.fetch("job", 1, 0, 0, len(good)) == good
    assert [s["step"] for s in node.client.steps("job")] == [1]
    assert not list(node.root.rglob("*.partial*"))


def test_gc_never_counts_an_incomplete_step_against_the_complete_ones(tmp_path):
    """#13 finding 4: `hp ckpt gc --daemon --keep 1` deleted the only complete step because a newer
    save still arriving was counted as one of the steps to keep."""
    from hp.tiered_ckpt.store import FileRec, MemoryStore, StepRec

    store = MemoryStore(tmp_path)

    def step(s: int, complete: bool) -> StepRec:
        f = FileRec(0, str(tmp_path / f"r{s}"), 8, [[0, 8]], "0" * 32, items=[[0, 8, 0]] if complete else None)
        return StepRec(s, 1, files={0: f}, meta_json={} if complete else None, save_id="0" * 32)

    store.steps["job"] = {4: step(4, True), 5: step(5, True), 6: step(6, False)}
    assert store.gc("job", 1) == [4]  # 5 is the newest complete step; 6 is still arriving
    assert sorted(store.steps["job"]) == [5, 6]
    store.steps["job"] = {6: step(6, False), 7: step(7, False)}
    assert store.gc("job", 1) == []  # no complete step: nothing goes
    assert store.gc("job", 0) == [6, 7]  # keep 0 is the daemon's "forget this job" (job end)


def test_slots_and_replicas_are_private_to_the_user(daemons, token, monkeypatch):
    """#13 finding 6: /dev/shm/hp-ckpt was 0755 with 0644 slots: any local user could read the weights."""
    import stat

    import torch

    from hp.tiered_ckpt import TieredConfig, api

    monkeypatch.setenv("HP_JOB_TOKEN", token)
    node = daemons("node0", replicas=0)
    assert api.save({"w": torch.ones(16)}, 1, TieredConfig("job", daemon=node.addr))
    assert stat.S_IMODE(os.stat(node.root).st_mode) == 0o700
    slots = list(node.root.rglob("*.buf"))
    assert slots and all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in slots)
    loose = [(str(d), oct(stat.S_IMODE(os.stat(d).st_mode))) for d in node.root.rglob("*") if d.is_dir()
             and stat.S_IMODE(os.stat(d).st_mode) & 0o077]
    assert not loose, loose

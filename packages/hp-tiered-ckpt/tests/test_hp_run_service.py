"""``hp run --service ckpt``: the agent starts the node daemon before its workers, wires the daemons
of all nodes into a replica ring, hands workers their addresses, and stops the daemons after them."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from hp.core.auth import new_token
from hp.testing import Launched, free_port, kill_tagged
from hp.tiered_ckpt.service import ring_peers

WORKER = Path(__file__).parent / "workers" / "run_worker.py"


class Jobs:
    """``hp run`` agents tagged with a per-test id, so that every process they started can be found."""

    def __init__(self, cwd: Path) -> None:
        self.cwd, self.tag = cwd, uuid.uuid4().hex
        self.launched: list[Launched] = []

    def __call__(self, args: list[str], token: str | None = None) -> Launched:
        env = {**os.environ, "HP_TEST_TAG": self.tag, "PYTHONPATH": str(WORKER.parent)}
        if token:
            env["HP_JOB_TOKEN"] = token
        self.launched.append(Launched(args, env, self.cwd))
        return self.launched[-1]

    def daemons(self) -> list[int]:
        """PIDs of checkpoint daemons started by this test's agents that are still running."""
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if (entry.name.isdigit() and f"HP_TEST_TAG={self.tag}".encode() in (entry / "environ").read_bytes()
                        and b"hp.tiered_ckpt\0daemon" in (entry / "cmdline").read_bytes()):
                    found.append(int(entry.name))
            except OSError:
                pass
        return found


@pytest.fixture
def job(tmp_path):
    jobs = Jobs(tmp_path)
    yield jobs
    for agent in jobs.launched:
        agent.kill()
    kill_tagged(f"HP_TEST_TAG={jobs.tag}")


def _results(out: Path, ranks: int) -> list[dict]:
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(ranks)]


def test_worker_sigkill_restores_from_daemon_started_by_hp_run(job, tmp_path):
    run_id = f"t{uuid.uuid4().hex[:10]}"
    logs, out = tmp_path / "logs", tmp_path / "result"
    agent = job(["run", "--run-id", run_id, "--max-restarts", "1", "--log-dir", str(logs), "--service", "ckpt",
                 str(WORKER), "--steps", "1,2", "--crash", "--out", str(out)])
    assert agent.wait(240) == 0, agent.output
    (r,) = _results(out, 1)
    # the first attempt saved steps 1 and 2 then died; the daemon it saved to outlived it
    assert (r["attempt"], r["step"], r["tier"], r["ok"]) == (1, 2, "memory", True), r
    assert "node services started: ckpt" in agent.output
    assert "listening on 127.0.0.1:" in (logs / "services" / "ckpt.log").read_text()
    assert job.daemons() == []  # stopped with the job
    assert not Path(f"/dev/shm/hp-ckpt/{run_id}").exists()  # the memory tier ends with its job


def test_two_nodes_daemons_replicate_in_a_ring(job, tmp_path):
    token, port = new_token(), free_port()
    out = tmp_path / "result"
    agents = [job(["run", "--nnodes", "2", "--node-rank", str(n), "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--heartbeat-timeout", "10", "--log-dir", str(tmp_path / f"node{n}"),
                   "--service", "ckpt:replicas=1,keep_memory=1", str(WORKER), "--steps", "3", "--out", str(out)],
                  token) for n in range(2)]
    for a in agents:
        assert a.wait(240) == 0, a.output
    r0, r1 = _results(out, 2)
    assert r0["peers"] == [r1["daemon"]] and r1["peers"] == [r0["daemon"]]
    assert r0["daemon"] != r1["daemon"]
    for r in (r0, r1):
        assert (r["step"], r["tier"], r["ok"]) == (3, "memory", True), r
        assert r["peers_hold_step"] == {r["peers"][0]: True}, r  # the replica reached the next node
    assert job.daemons() == []


@pytest.mark.parametrize("spec, error", [
    ("ckpt:replicas=two", "replicas must be an integer"),
    ("ckpt:colour=blue", "unknown option(s) ['colour']"),
    ("nosuch", "unknown node_service backend 'nosuch'"),
    ("ckpt:replicas", "expected KEY=VALUE"),
])
def test_bad_service_spec_is_a_one_line_error(job, tmp_path, spec, error):
    agent = job(["run", "--service", spec, str(WORKER), "--out", str(tmp_path / "never")])
    assert agent.wait(120) == 2, agent.output
    assert error in agent.output
    assert not list(tmp_path.glob("never*"))  # no worker ran


def test_ring_peers_follow_node_order():
    assert ring_peers(["a", "b", "c"], 0) == ["b", "c"]
    assert ring_peers(["a", "b", "c"], 2) == ["a", "b"]
    assert ring_peers(["a"], 0) == []

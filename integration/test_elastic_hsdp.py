"""An elastic HSDP job end to end: real `hp run` jobs, the model sharded with FSDP2 on hp's 2-D mesh
(shard groups of 2 ranks, replicated across them), CPU gloo.

A rank killed with no spare left takes its whole replica group out of the job (the policy's unit is the
shard group): 2 x 2 -> 1 x 2, the survivors keep their shards (no transfer, no storage) and replay the step
on the smaller mesh. The processes started in the freed slots join once ready and the job grows back to
2 x 2, each joiner copying its shard from the rank holding it in the other replica group.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from hp.checkpointless.demo.run import RunResult, final_states
from hp.checkpointless.events import finished_at, read_events
from hp.testing import finish_when, free_port, kill_tagged, wait_for
from hp.elastic.demo.run import (
    ElasticDemoConfig,
    commits,
    lost_steps,
    one_node_run,
    events_went_through,
    world_by_step,
)

pytestmark = pytest.mark.slow
STEPS = 16
POLICY = "min_replicas: 2\nmax_replicas: 4\nunit: 2\nglobal_batch: 8\nmicro_batch: 2\n"


@pytest.fixture
def job(tmp_path, monkeypatch):
    monkeypatch.setenv("HP_DATA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HP_TEST_DIR", str(tmp_path))
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)

    def run(name: str, ranks: int, faults: list[dict] | None = None, steps: int = STEPS, unit: int = 2,
            exact: bool = False, agent_flags: tuple[str, ...] = (),
            finish: tuple[list[int], int] | None = None) -> RunResult:
        if unit != 2:
            policy.write_text(POLICY.replace("unit: 2", f"unit: {unit}"))
        cfg = ElasticDemoConfig(steps=steps, exact=exact, corpus_mb=2, timeout_s=240,
                                train_args=["--hsdp-shard", "2", "--dropout", "0"])
        return one_node_run(cfg, str(tmp_path), str(policy), ranks, name, faults, elastic=faults is not None,
                            agent_flags=agent_flags, finish=finish)

    yield run
    kill_tagged(f"HP_TEST_DIR={tmp_path}")


def kill(step: int) -> list[dict]:
    return [{"kind": "kill", "at_step": step, "rank": 1, "phase": "forward"}]


def sizes(events: list[dict]) -> list[int]:
    """The world sizes the job committed its steps at, each run of one size once."""
    worlds = world_by_step(events)
    out = [worlds[s] for s in sorted(worlds)]
    return [w for i, w in enumerate(out) if i == 0 or w != out[i - 1]]


def losses(events: list[dict]) -> dict[int, set[str]]:
    return {s: {e["loss"] for e in es} for s, es in commits(events).items()}


def assert_replicas_equal(result: RunResult) -> None:
    """2 x 2 at the end: each shard is held by one rank of each replica group, and both copies are the same
    bits (parameters and optimizer state): a joiner got its holder's shard and both trained on alike."""
    final = final_states(result)
    assert sorted(final) == ["0", "1", "2", "3"], sorted(final)
    for r in (0, 1):
        for part in ("params", "optimizer"):
            assert final[str(r)][part] == final[str(r + 2)][part], (r, part)
        assert final["0"]["params"] != final["1"]["params"]  # two different shards


def test_a_replica_group_lost_at_the_first_step_leaves_the_job_training_as_one_born_at_its_size(job):
    """Killed in step 0's forward: the job replays it at 1 x 2, bit for bit what a job started at 2 ranks
    computes, step after step, until the freed slots' processes grow it back to 2 x 2."""
    born = job("born-at-2", 2)
    # The job grows back at the first step boundary where the freed slots' new processes are ready. Forked
    # (the default) they are ready in well under a second: a fresh-clone run grew back right after the replay
    # of step 0 (at 1 x 2 only step 0, nothing "step after step" to compare), and slowing steps 1-2 could not
    # help, since it is the boundary after step 0 that counts. Started cold (spawn: torch imported anew, several
    # CPU seconds) they come after the replay and at least one more step (a step of this job: ~0.1 CPU s).
    # A margin, not a hold: a deterministic hold needs a way to keep joiners back (not in hp yet).
    shrunk = job("shrunk-at-0", 4, kill(0), agent_flags=("--start-method", "spawn"))
    assert born.returncode == 0 and shrunk.returncode == 0, (born.output[-2000:], shrunk.output[-2000:])
    assert sizes(born.events) == [2]
    assert sizes(shrunk.events)[0] == 2 and sizes(shrunk.events) in ([2], [2, 4]), sizes(shrunk.events)
    at_two = [s for s, w in world_by_step(shrunk.events).items() if w == 2]
    assert len(at_two) >= 2 and at_two == list(range(len(at_two))), at_two
    want, got = losses(born.events), losses(shrunk.events)
    assert {s: got[s] for s in at_two} == {s: want[s] for s in at_two}
    assert all(len(v) == 1 for v in got.values())
    assert lost_steps(shrunk.events, STEPS) == 0
    if sizes(shrunk.events) == [2, 4]:
        assert_replicas_equal(shrunk)


def test_a_replica_group_lost_mid_run_shrinks_the_mesh_and_joiners_grow_it_back(job):
    # at most 800 steps, ended (hp finish) 5 steps after the joiners grew it back: however long the freed slots'
    # new processes take to start and join on a loaded 2-core box
    run = job("shrink-grow", 4, kill(3), steps=800, finish=([4, 2, 4], 5))
    assert run.returncode == 0, run.output[-3000:]
    assert sizes(run.events) == [4, 2, 4], sizes(run.events)
    ended = finished_at(run.events)
    assert ended is not None and lost_steps(run.events, ended + 1) == 0
    worlds = world_by_step(run.events)
    assert [worlds[s] for s in range(4)] == [4, 4, 4, 2]  # step 3 replayed at the smaller size
    left = [e for e in run.events if e["event"] == "left"]
    assert len(left) == 1 and left[0]["why"] == "shrink"  # the dead rank's unit-mate, at once
    rebuilt = [e for e in run.events if e["event"] == "shard_rebuilt"]
    assert sorted((e["rank"], e["buddy"]) for e in rebuilt if e["buddy"] is not None)[-2:] == [(2, 0), (3, 1)], rebuilt
    assert_replicas_equal(run)


def test_a_policy_whose_unit_splits_a_shard_group_stops_the_job_naming_the_fix(job):
    """Unit 1: the controller shrinks 4 -> 3, which no HSDP mesh of shard groups of 2 covers, and the job
    stops with one line naming the fix (no hang, no wrong shard). Which generation refuses depends on the
    freed slot's new process: forked, it can be ready before the survivors form the 3-rank mesh, and the
    job grows back to 4 with ranks renumbered by 1, whose shards are not where the mesh puts them (seen in a
    fresh-clone run). Either refusal is the mesh's (hp.checkpointless.mesh), with the same fix."""
    run = job("unit-1", 4, kill(3), unit=1)
    assert run.returncode != 0
    final = [line for line in run.output.splitlines() if line.startswith("hp run: job failed: ")]
    assert len(final) == 1 and final[0].endswith("(the scaling policy's unit must be a multiple of the shard group "
                                                 "size 2)"), run.output[-3000:]
    assert ("only an HSDP mesh changes its world size, by whole replica groups of 2" in final[0]
            or re.search(r"rank \d of 4 is shard (\d) of a mesh of \(2, 2\); this process holds shard (?!\1)\d", final[0])), final


def test_exact_mode_with_an_fsdp_model_is_refused_in_one_line(job):
    run = job("exact", 2, exact=True)
    assert run.returncode != 0
    assert "an FSDP2 model's gradients are reduced by FSDP: pass no reduction=" in run.output, run.output[-3000:]


def test_a_node_joining_grows_the_job_by_a_replica_group_whose_shards_come_from_the_first(job, tmp_path):
    """The job starts as 1 x 2 on node 0; node 1's agent (two processes) joins the running job: once both
    are ready the job grows to 2 x 2 at a step boundary, each newcomer copying its shard from the rank of
    replica group 0 that holds it (their environment says nothing of the mesh they join: a spare's mesh is
    the generation's that gives it its rank)."""
    port = free_port()
    # node 1 starts cold (its agent, fork server, imports) while the job trains: at most 2000 steps, ended (hp
    # finish) 5 steps after the job grew
    steps, logs = 2000, tmp_path / "grow"
    flags = ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--scaling-policy",
             str(tmp_path / "policy.yaml"), "--tee", "0", "--monitor-interval", "0.05"]
    train = ["-m", "hp.elastic.demo.train", "--steps", str(steps), "--policy", str(tmp_path / "policy.yaml"),
             "--hsdp-shard", "2", "--dropout", "0", "--corpus-mb", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HP_JOB_TOKEN": os.urandom(16).hex()}
    agents = []
    try:
        for node in (0, 1):
            if node == 1:  # once the job trains at 2
                wait_for(lambda: agents[0].poll() is not None or any(
                    e["event"] == "commit" for e in read_events(str(logs / "node0" / "events"))), 120, "node 0's first commit")
                assert agents[0].poll() is None, (logs.parent / "grow-node0.out").read_text()[-3000:]
            with open(logs.parent / f"grow-node{node}.out", "w") as out:  # the agent keeps its own descriptor
                agents.append(subprocess.Popen([sys.executable, "-m", "hp.core.cli", "run", *flags, "--node-rank",
                                                str(node), "--log-dir", str(logs / f"node{node}"), *train], stdout=out,
                                               stderr=subprocess.STDOUT, env=env, start_new_session=True))
        def grown() -> bool:  # 5 steps committed at 2 x 2 after 1 x 2
            return events_went_through(read_events(str(logs / "node0" / "events"))
                                       + read_events(str(logs / "node1" / "events")), [2, 4], 5)

        finish_when(agents[0], f"127.0.0.1:{port}", env["HP_JOB_TOKEN"], grown, 300, "5 steps at 2 x 2")
        codes = [a.wait(timeout=300) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, 9)
                a.wait()
    assert codes == [0, 0], (logs.parent / "grow-node0.out").read_text()[-3000:]
    events = sorted(read_events(str(logs / "node0" / "events")) + read_events(str(logs / "node1" / "events")),
                    key=lambda e: e["t"])
    result = RunResult(0, 0.0, events, "")
    assert sizes(events) == [2, 4], sizes(events)
    ended = finished_at(events)
    assert ended is not None and lost_steps(events, ended + 1) == 0
    rebuilt = sorted((e["rank"], e["buddy"]) for e in events if e["event"] == "shard_rebuilt")
    assert rebuilt == [(2, 0), (3, 1)], rebuilt
    assert_replicas_equal(result)

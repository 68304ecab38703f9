"""A 2-node hp job (one network namespace per node, gloo over the veths) survives the loss of a
node, a partition and packet loss, with losses bit-identical to a fault-free run of the same job.

Every job is real: two `hp run` agents, their workers and spares, the controller in node 0's agent.
"""

from __future__ import annotations

import os
import time

import pytest

from hp.chaos.multinode import MultiNodeJob, recovery_after
from hp.chaos.scenario import JobSpec
from hp.chaos.topology import Topology
from hp.checkpointless.demo.run import DemoConfig, RunResult, compare, compare_state
from hp.core.warm_start import resolve

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
              pytest.mark.timeout(600)]  # a hang guard: the first test also runs the reference job

STEPS, FAULT_AFTER = 12, 3
# node 1 is lost after 4 s of silence; its agent fences itself after 3 s (two beats earlier)
AGENT_FLAGS = ["--heartbeat-interval", "0.5", "--heartbeat-timeout", "4"]


def config() -> DemoConfig:
    # one worker per node: world size 2; a hang timeout a loaded CI machine never reaches by accident
    return DemoConfig(nproc=1, steps=STEPS, corpus_mb=2, hang_timeout_s=20.0)


@pytest.fixture(scope="module")
def job_env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return {"HP_DATA_CACHE_DIR": str(cache)}


@pytest.fixture(scope="module")
def reference(chaos_reference_cache, chaos_env, tmp_path_factory) -> RunResult:
    """The fault-free run of this job (2 nodes x 1 rank, each in its namespace): the session's, shared with the
    2-node chaos scenarios of the same job and with the other xdist worker (hp.chaos.references.ReferenceCache)."""
    cfg = config()
    job = JobSpec(nodes=2, nproc_per_node=cfg.nproc, steps=cfg.steps, model=cfg.model_size, seed=cfg.seed,
                  corpus_mb=cfg.corpus_mb)
    result = chaos_reference_cache.get(job, chaos_env, str(tmp_path_factory.mktemp("reference")))
    assert result.returncode == 0, result.output[-3000:]
    assert sorted(result.losses()) == list(range(STEPS))
    return result


def faulted_job(topo: Topology, tmp_path, job_env, spares: list[int], agent_flags=AGENT_FLAGS) -> MultiNodeJob:
    job = MultiNodeJob(topo, config(), str(tmp_path / "job"), spares=spares, extra_env=job_env,
                       agent_flags=agent_flags).start()
    job.wait_for_step(FAULT_AFTER, timeout=300)
    return job


def decision(job: MultiNodeJob, name: str) -> dict:
    return next(d for d in job.decisions() if d["decision"] == name)


def assert_identical(reference: RunResult, result: RunResult) -> None:
    """Every step's losses and every rank's final state (parameters, optimizer, ...) are the reference's bits."""
    verdict = compare(reference, result)
    assert verdict == {"bitwise_equal": True, "lost_steps": 0, "steps_compared": STEPS}, (
        verdict, result.output[-3000:])
    state = compare_state(reference, result, nproc=2)
    assert state["state_equal"] and {"params", "optimizer"} <= set(state["state_parts"]), state


def test_node_loss_moves_its_ranks_to_spares_on_the_surviving_node(reference, job_env, tmp_path):
    with Topology(2) as topo:
        job = faulted_job(topo, tmp_path, job_env, spares=[1, 1])
        t0 = time.time()
        # agent, its fork server and multiprocessing's resource tracker, worker, spare: all at once (and the
        # agent's stand-in when the agent was forked by the session's warm-start server, hp.core.warm_start)
        stand_in = resolve(job.procs[1].pid) != job.procs[1].pid
        assert topo.kill_node(1) == 5 + stand_in
        result = job.wait(timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    assert_identical(reference, result)
    lost = decision(job, "node_lost")
    assert lost["node_rank"] == 1 and lost["address"] == topo.address(1)
    promoted = [d for d in job.decisions() if d["decision"] == "promote_spare"]
    assert [(d["rank"], d["spare"], d["spare_node"]) for d in promoted] == [(1, "n0s0", 0)]
    bumps = [d["why"] for d in job.decisions() if d["decision"] == "new_generation"]
    assert bumps == ["rendezvous_complete", "node_lost"]  # one generation for the whole node
    timeline = recovery_after(result.events, t0)
    assert timeline["recovery_s"] is not None and timeline["detect_s"] < 3  # gloo noticed the dead peer


def test_a_partitioned_node_fences_itself_and_is_treated_as_lost(reference, job_env, tmp_path):
    with Topology(2) as topo:
        job = faulted_job(topo, tmp_path, job_env, spares=[1, 1])
        topo.partition(0, 1, mode="drop")  # packets vanish: nobody gets an error, only silence
        result = job.wait(timeout=300)
        node1_left = topo.pids(1)
    assert result.returncode == 0, result.output[-3000:]
    assert job.returncodes()[1] == 1
    assert "node 1 fenced itself: no answer from the controller" in job.output(1)
    assert node1_left == []  # no process of the cut-off node outlived it
    assert_identical(reference, result)
    lost = decision(job, "node_lost")
    assert lost["node_rank"] == 1
    # the cut-off node never committed a step after the job gave its rank away
    node1_pids = {e["pid"] for e in job.events() if e.get("rank") == 1 and e["event"] == "pg_ready"
                  and e["generation"] == 1}
    assert not [e for e in result.events if e["pid"] in node1_pids and e["event"] == "commit" and e["t"] > lost["t"]]
    assert "lost node" in job.output(0) and "cut this node's connections" in job.output(0)


def test_node_loss_without_a_spare_on_the_survivors_fails_naming_the_node(job_env, tmp_path):
    with Topology(2) as topo:
        job = faulted_job(topo, tmp_path, job_env, spares=[0, 1])  # node 1's spare dies with it
        topo.kill_node(1)
        result = job.wait(timeout=300)
    assert result.returncode == 1
    assert ("job failed: node 1 (" in result.output and f"{topo.address(1)}) lost: no heartbeat for" in result.output
            and "its ranks [1] need 1 spare(s) on the surviving nodes, 0 free" in result.output), result.output[-3000:]


def test_packet_loss_slows_the_job_but_changes_no_bit(reference, job_env, tmp_path):
    with Topology(2) as topo:
        # every heartbeat is a new TCP connection: at 5 % loss a lost SYN and its retry cost 1 + 2 s
        # of backoff, which a 3 s lease (CI's 4 s timeout) does not always survive; 10 s does
        job = faulted_job(topo, tmp_path, job_env, spares=[0, 0],
                          agent_flags=["--heartbeat-interval", "0.5", "--heartbeat-timeout", "10"])
        topo.loss(1, 0.05)
        result = job.wait(timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    assert_identical(reference, result)
    assert not [d for d in job.decisions() if d["decision"] == "node_lost"]

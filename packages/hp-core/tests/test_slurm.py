"""The ``slurm`` scheduler backend (hp.core.schedulers.slurm.backend, issue #15) against a real Slurm: munged, slurmctld and
three slurmd as fake nodes (hp.chaos.clusters.slurm), partitions ``low`` (requeued when preempted, 5 s of
grace) and ``high``. No Slurm command is mocked."""

from __future__ import annotations

import json
import os
import sys

import pytest
from torchx import specs

from hp.chaos.clusters.slurm import LocalSlurm
from hp.core import get_backend
from hp.core.errors import BackendUnavailableError
from hp.core.schedulers.slurm.backend import SlurmError, SlurmScheduler
from hp.testing import wait_for


@pytest.fixture(scope="module")
def cluster():
    with LocalSlurm(nodes=3, cpus=2, grace_s=5) as slurm:
        yield slurm


@pytest.fixture
def slurm(cluster):
    """The cluster with every node idle and no job, again after the test."""
    yield cluster
    cli = cluster.cli
    cli.run("scancel", "--full", "--user", str(os.getuid()))
    for name in cluster.node_names:
        if next(n for n in cli.nodes() if n.name == name).state not in ("idle", "allocated", "mixed", "completing"):
            cli.set_node_state(name, "RESUME")
    wait_for(lambda: not [j for j in cli.jobs() if j.active] and all(n.state == "idle" for n in cli.nodes()),
             60, "an idle cluster")


def _script(body: str) -> str:
    return "#!/bin/bash\n" + body + "\n"


def _running(sched: SlurmScheduler, job: str, timeout: float = 30) -> None:
    wait_for(lambda: sched.state(job) == "RUNNING", timeout, f"job {job} running")


def test_slurm_is_a_scheduler_backend():
    assert isinstance(get_backend("scheduler", "slurm"), SlurmScheduler)


def test_capacity_is_the_partitions_idle_nodes_and_their_cpus(slurm):
    cap = SlurmScheduler(slurm.env).capacity("low")
    assert (cap.hosts, cap.slots_per_host, cap.preemption_requested) == (3, 2, False)
    assert SlurmScheduler(slurm.env).capacity() == cap  # low is the default partition


def test_a_job_runs_on_its_nodes_sees_them_as_its_hosts_and_is_cancelled(slurm, tmp_path):
    sched = SlurmScheduler(slurm.env)
    probe = tmp_path / "probe.json"
    code = ("import json; from hp.core.schedulers.slurm.backend import SlurmScheduler as S; s = S(); "
            f"json.dump({{'hosts': s.hosts(), 'hosts_capacity': s.capacity().hosts}}, open({str(probe)!r}, 'w')); "
            "import time; time.sleep(300)")
    job = sched.submit_script(_script(f"{sys.executable} -c \"{code}\""), "-p", "low", "-N", "2", "-o", "/dev/null")
    _running(sched, job)
    wait_for(probe.exists, 30, "the job's probe")
    seen = json.loads(probe.read_text())
    assert len(seen["hosts"]) == 2 and set(seen["hosts"]) <= set(slurm.node_names)
    assert seen["hosts_capacity"] == 3  # its own 2 nodes and the idle one
    assert sched.capacity().hosts == 1  # seen from outside the job: the idle one only
    sched.cancel(job)
    wait_for(lambda: sched.state(job) in (None, "CANCELLED"), 30, "the job cancelled")
    wait_for(lambda: sched.capacity().hosts == 3, 30, "its nodes back")


def test_an_appdef_submitted_through_torchx_runs_every_replica(slurm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # TorchX notes its job dirs in ./.torchxslurmjobdirs
    out = tmp_path / "replicas"
    role = specs.Role("r", image=str(tmp_path), entrypoint="bash", num_replicas=2,
                      args=["-c", f"echo $SLURM_PROCID >> {out}"], resource=specs.Resource(cpu=1, gpu=0, memMB=100))
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])  # TorchX runs sbatch with the process's environment
    sched = SlurmScheduler(slurm.env)
    try:
        handle = sched.submit(specs.AppDef("probe", roles=[role]), {"partition": "low", "job_dir": str(tmp_path)})
        assert handle.startswith("slurm://")
        assert sched.wait(handle, 0.2) == "COMPLETED"  # from squeue: TorchX itself would need sacct
    finally:
        sched.close()
    assert sorted(out.read_text().split()) == ["0", "1"]  # one task per replica, one srun over the parts


def test_a_higher_tier_job_preempts_with_sigterm_to_the_tasks_and_is_seen_as_preemption(slurm, tmp_path):
    sched = SlurmScheduler(slurm.env)
    terms = tmp_path / "terms"
    task = tmp_path / "task.sh"
    # a task that records SIGTERM and leaves 2 s later, within the 5 s grace (hp: at its next step boundary)
    task.write_text(_script(f"trap 'echo $SLURM_NODEID >> {terms}; sleep 2; exit 0' TERM\n"
                            f"for i in $(seq 600); do sleep 0.1; done"))
    task.chmod(0o755)
    low = sched.submit_script(_script(f"srun {task}"), "-p", "low", "-N", "2", "-o", "/dev/null")
    _running(sched, low)
    assert not sched.capacity("low").preemption_requested
    high = sched.submit_script(_script("sleep 300"), "-p", "high", "-N", "3", "-o", "/dev/null")
    wait_for(lambda: terms.exists() and len(terms.read_text().split()) == 2, 30, "SIGTERM to both tasks")
    # within the grace time: the low job still holds its nodes, the high one waits for them
    assert sched.state(high) == "PENDING"
    assert sched.capacity("low").preemption_requested
    _running(sched, high)  # the tasks gone, the nodes change hands
    assert sched.state(low) in ("COMPLETED", "COMPLETING", "PENDING", "REQUEUED", "PREEMPTED")


def test_a_node_set_down_leaves_the_capacity_and_comes_back_resumed(slurm):
    sched = SlurmScheduler(slurm.env)
    slurm.cli.set_node_state("n3", "DOWN", "test")
    assert sched.capacity().hosts == 2
    slurm.cli.set_node_state("n3", "RESUME")
    wait_for(lambda: sched.capacity().hosts == 3, 30, "n3 back")


def test_bad_input_is_one_line(slurm, tmp_path):
    sched = SlurmScheduler(slurm.env)
    with pytest.raises(SlurmError, match="unknown partition 'nope'") as e:
        sched.capacity("nope")
    assert "\n" not in str(e.value)
    with pytest.raises(SlurmError, match="not inside a Slurm allocation"):
        SlurmScheduler({**slurm.env, "SLURM_JOB_NODELIST": ""}).hosts()
    with pytest.raises(SlurmError, match="not a Slurm job id"):
        sched.cancel("slurm://torchx/../etc")
    with pytest.raises(SlurmError, match="sbatch failed: .*") as e:
        sched.submit_script(_script("true"), "-p", "nope")
    assert "\n" not in str(e.value)
    nowhere = SlurmScheduler({**slurm.env, "PATH": str(tmp_path)})
    for call in (lambda: nowhere.capacity(), lambda: nowhere.submit_script(_script("true"))):
        with pytest.raises(BackendUnavailableError, match="is not on PATH") as e:
            call()
        assert "\n" not in str(e.value)
    assert not [j for j in slurm.cli.jobs() if j.active]  # nothing was submitted


def test_a_local_slurm_stops_every_daemon_and_removes_its_directory():
    slurm = LocalSlurm(nodes=1).start()
    root, daemons = slurm.root, slurm.daemons
    assert len(daemons) == 3 and all(p.poll() is None for p in daemons)  # munged, slurmctld, one slurmd
    slurm.close()
    assert not os.path.exists(root)
    assert all(p.poll() is not None for p in daemons)
    slurm.close()  # idempotent

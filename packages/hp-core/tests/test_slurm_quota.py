"""Quotas from Slurm QOS limits (hp.core.schedulers.slurm.quota, issue #15): the arithmetic without Slurm, then
against a real Slurm with accounting (MariaDB + slurmdbd, hp.chaos.clusters.slurm_accounting) enforcing the limits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hp.chaos.clusters.slurm import LocalSlurm
from hp.chaos.clusters.slurm_accounting import set_qos
from hp.core.schedulers.slurm.backend import SlurmError, SlurmScheduler
from hp.core.schedulers.slurm.quota import QosLimits, quota_hosts
from hp.core.schedulers.slurm.records import SlurmJob
from hp.testing import wait_for


def _job(job_id: str, nodes: int, state: str = "RUNNING", qos: str = "q", user: str = "me") -> SlurmJob:
    return SlurmJob(job_id, "low", state, "n1" if state == "RUNNING" else "", nodes, qos=qos, user=user)


def test_qos_lines_parse_to_node_and_job_limits():
    assert QosLimits.parse("q|cpu=8,node=6|node=3|4") == QosLimits("q", 6, 3, 4)
    assert QosLimits.parse("normal|||") == QosLimits("normal") and not QosLimits("normal").limited
    assert QosLimits.parse("q|cpu=8||") == QosLimits("q")  # a limit on CPUs says nothing about nodes


def test_the_quota_is_what_the_job_holds_plus_the_tightest_headroom():
    jobs = [_job("1", 2), _job("2", 1), _job("3", 1, "PENDING"), _job("9", 1, user="other"), _job("7", 4, qos="x")]
    own = {"1", "2", "3"}  # a 2-node base, a running unit and a waiting one
    assert quota_hosts(QosLimits("q", nodes_per_user=3), jobs, "me", own) == 3  # holds 3, no headroom
    assert quota_hosts(QosLimits("q", nodes_per_user=5), jobs, "me", own) == 5
    assert quota_hosts(QosLimits("q", grp_nodes=5), jobs, "me", own) == 4  # the other user's node counts
    assert quota_hosts(QosLimits("q", jobs_per_user=3), jobs, "me", own) == 4  # one more one-node unit
    assert quota_hosts(QosLimits("q", grp_nodes=2), jobs, "me", own) == 3  # over (lowered): never below held
    assert quota_hosts(QosLimits("q"), jobs, "me", own) is None


@pytest.fixture(scope="module")
def cluster():
    with LocalSlurm(nodes=3, cpus=2, accounting=True) as slurm:
        yield slurm


def test_capacity_follows_the_enforced_qos_limits(cluster):
    cli, sched = cluster.cli, SlurmScheduler(cluster.env, job_names=("mine",), qos="capq")
    set_qos(cli, "capq", MaxTRESPerUser="node=2")
    assert sched.capacity("low").quota_hosts == 2 and sched.capacity("low").hosts == 2  # 3 idle, quota 2
    jobs = []
    try:
        for name in ("mine", "other", "third"):
            jobs.append(cli.sbatch("#!/bin/bash\nexec sleep 300\n", "-N", "1", "--qos=capq", "-J", name, "-o", "/dev/null"))
        wait_for(lambda: [j.reason for j in cli.jobs() if j.state == "PENDING"] == ["QOSMaxNodePerUserLimit"], 30,
                 "the third job waiting for the quota")
        cap = sched.capacity("low")
        assert (cap.hosts, cap.quota_hosts) == (1, 1), cap  # it holds 1; the user's other job took the rest
        set_qos(cli, "capq", MaxTRESPerUser="node=-1", GrpTRES="node=3")
        wait_for(lambda: all(j.state == "RUNNING" for j in cli.jobs() if j.active), 30, "the quota raised")
        assert sched.capacity("low").quota_hosts == 1  # the group's 3 nodes are all running
        set_qos(cli, "capq", GrpTRES="node=-1")
        assert sched.capacity("low").quota_hosts is None  # nothing limits it any more
    finally:
        for job in jobs:
            cli.scancel(job)


def test_a_cluster_without_accounting_has_no_quota():
    with LocalSlurm(nodes=1) as slurm:
        assert SlurmScheduler(slurm.env, qos="normal").capacity().quota_hosts is None


@pytest.mark.parametrize("argv, message", [
    (["--qos", "a=b"], "the QOS must be 1-128 of"),
    (["--qos", "nosuchqos"], "unknown QOS 'nosuchqos'"),
    (["--partition", "nope"], "unknown partition 'nope'"),
    (["--run-id", "../x"], "--run-id must be"),
])
def test_hp_slurm_capacity_bad_input_is_one_line(cluster, argv, message):
    done = subprocess.run([sys.executable, "-m", "hp.core.cli", "slurm", "capacity", *argv], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **cluster.env})
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_hp_slurm_capacity_prints_json(cluster):
    set_qos(cluster.cli, "jsonq", MaxJobsPerUser="2")
    done = subprocess.run([sys.executable, "-m", "hp.core.cli", "slurm", "capacity", "--qos", "jsonq", "--json"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **cluster.env})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"hosts": 2, "slots_per_host": 2, "preemption_requested": False,
                                       "replicas": None, "quota_hosts": 2}


def test_set_qos_reports_a_bad_limit_in_one_line(cluster):
    with pytest.raises(SlurmError, match="sacctmgr failed"):
        set_qos(cluster.cli, "badq", NoSuchLimit="1")

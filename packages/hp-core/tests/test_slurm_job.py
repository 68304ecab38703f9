"""``hp slurm``'s job spec, scripts and unit keeper (hp.core.schedulers.slurm.job, hp.core.schedulers.slurm.units), without a Slurm:
the keeper is a pure state machine driven here by hand. The whole path on a real Slurm is
hp-chaos's test_slurm_elastic.py."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from hp.core.errors import UsageError
from hp.core.schedulers.slurm.job import (
    SPEC_FILE,
    TOKEN_FILE,
    SlurmJobSpec,
    agent_argv,
    base_script,
    base_steps,
    prepare,
    unit_script,
)
from hp.core.schedulers.slurm.records import SlurmJob
from hp.core.schedulers.slurm.units import FailedUnits, Slot, UnitKeeper

TOKEN = "ab" * 16


def _spec(tmp_path, **kw) -> SlurmJobSpec:
    base = dict(entrypoint=["-m", "train", "--steps", "5"], job_dir=str(tmp_path / "job"), min_nodes=2, max_nodes=4,
                scaling_policy="/p/policy.yaml", base_partition="high", unit_partition="low", port=29401,
                run_id="r1", grace_period_s=4)
    return SlurmJobSpec(**{**base, **kw})


def test_prepare_writes_a_private_dir_and_the_token_only_to_its_file(tmp_path):
    spec = _spec(tmp_path)
    path = prepare(spec, TOKEN)
    assert stat.S_IMODE(os.stat(spec.job_dir).st_mode) == 0o700
    for name in (SPEC_FILE, TOKEN_FILE):
        assert stat.S_IMODE(os.stat(spec.path(name)).st_mode) == 0o600
    assert SlurmJobSpec.load(path) == spec
    scripts = base_script(spec) + unit_script(spec, 3, "10.0.0.1:29401") + " ".join(agent_argv(spec, 3, "h:1", "7"))
    assert TOKEN not in scripts and TOKEN not in open(path).read()


def test_scripts_name_partitions_slots_and_the_controller(tmp_path):
    spec = _spec(tmp_path)
    base = base_script(spec)
    assert "#SBATCH --partition=high" in base and "#SBATCH --nodes=2" in base and "slurm base" in base
    unit = unit_script(spec, 3, "10.0.0.1:29401")
    assert "#SBATCH --partition=low" in unit and "#SBATCH --nodes=1" in unit and "#SBATCH --no-requeue" in unit
    assert "#SBATCH --job-name=hp-r1-u3" in unit and '--cpus-per-task="$SLURM_CPUS_ON_NODE"' in unit
    assert unit.rstrip().endswith("--endpoint 10.0.0.1:29401 --node-rank 3")
    argv = agent_argv(spec, 3, "10.0.0.1:29401", "77")
    # hp run's flags come before the training command (after it they would be the script's)
    assert argv[argv.index("--node-rank") + 1] == "3" and argv.index("--node-rank") < argv.index("-m", 3)
    assert argv[-4:] == ["-m", "train", "--steps", "5"]
    assert ["--nnodes", "2:4"] == argv[argv.index("--nnodes"):argv.index("--nnodes") + 2]
    assert argv[argv.index("--log-dir") + 1] == spec.path("node3-77")
    fixed = agent_argv(_spec(tmp_path, max_nodes=2, scaling_policy=None), 1, "h:1", "1")
    assert "--scaling-policy" not in fixed and fixed[fixed.index("--nnodes") + 1] == "2"


def test_a_failed_base_node_ends_its_agent_not_the_job(tmp_path):
    """The base job has --no-kill; node 0's agent (the controller's) is a step of its own, whose exit is the
    job's; the other base nodes' step numbers its tasks from node rank 1; a replacement of a base node is a
    one-node job in the base partition."""
    spec = _spec(tmp_path, min_nodes=3, max_nodes=4)
    assert "#SBATCH --no-kill" in base_script(spec) and "#SBATCH --no-kill" not in unit_script(spec, 3, "h:1")
    head, rest = base_steps(spec, "h:1", ["n1", "n2", "n3"])
    assert "--nodelist=n1" in head and head[-2:] == ["--node-rank", "0"] and "--nodes=1" in head
    assert "--exclude=n1" in rest and rest[-2:] == ["--node-rank-offset", "1"] and "--nodes=2" in rest
    assert all("--no-kill" in step and "--kill-on-bad-exit=0" in step for step in (head, rest))
    assert len(base_steps(_spec(tmp_path, min_nodes=1), "h:1", ["n1"])) == 1
    replacement = unit_script(spec, 1, "h:1")
    assert "#SBATCH --partition=high" in replacement and "#SBATCH --job-name=hp-r1-u1" in replacement
    assert replacement.rstrip().endswith("--node-rank 1")


@pytest.mark.parametrize("change, message", [
    (dict(min_nodes=3, max_nodes=2), "MIN <= MAX"),
    (dict(scaling_policy=None), "needs --scaling-policy"),
    (dict(entrypoint=[]), "training script"),
    (dict(run_id="../x"), "--run-id"),
    (dict(unit_partition="low;rm"), "--unit-partition"),
    (dict(port=70000), "--port"),
    (dict(job_dir="relative/dir"), "absolute"),
    # #31 item 10: unquoted in the sbatch script's #SBATCH lines
    (dict(job_dir="/shared/jobs/a\necho owned > /tmp/x"), "--job-dir must not contain whitespace"),
    (dict(job_dir="/shared/my jobs/a"), "--job-dir must not contain whitespace"),
    (dict(job_dir="/shared/jobs/%x"), "--job-dir must not contain"),
    (dict(nproc_per_node=0), "--nproc-per-node"),
])
def test_bad_specs_are_one_line_errors(tmp_path, change, message):
    with pytest.raises(UsageError, match=message) as e:
        _spec(tmp_path, **change).validate()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text", ['{"entrypoint": "train.py", "job_dir": "/j"}', "[1]", "not json",
                                  '{"entrypoint": ["t"], "job_dir": "/j", "extra": 1}',
                                  '{"entrypoint": ["t"], "job_dir": "/j", "min_nodes": true}'])
def test_a_spec_file_that_is_not_one_is_refused(tmp_path, text):
    path = tmp_path / "spec.json"
    path.write_text(text)
    with pytest.raises(UsageError, match="slurm job spec"):
        SlurmJobSpec.load(str(path))


def _job(job_id: str, name: str, state: str) -> SlurmJob:
    return SlurmJob(job_id, "low", state, "", 1, name=name)


def test_keeper_submits_for_empty_slots_waits_for_queued_ones_and_paces_failures():
    now = [0.0]
    keeper = UnitKeeper({2: "hp-r-u2", 3: "hp-r-u3"}, clock=lambda: now[0], min_interval_s=2.0)
    assert keeper.due([]) == [2, 3]
    keeper.submitted(2, "10")
    keeper.submitted(3, "11")
    assert keeper.states([]) == {2: Slot.QUEUED, 3: Slot.QUEUED}  # submitted, not listed yet
    jobs = [_job("10", "hp-r-u2", "PENDING"), _job("11", "hp-r-u3", "RUNNING"), _job("5", "other", "COMPLETED")]
    assert keeper.states(jobs) == {2: Slot.QUEUED, 3: Slot.RUNNING} and keeper.due(jobs) == []
    # unit 3 was preempted (its ranks left, its job ended): a new one, but not twice within min_interval_s
    jobs[1] = _job("11", "hp-r-u3", "COMPLETED")
    now[0] = 1.0
    assert keeper.due(jobs) == []
    now[0] = 2.5
    assert keeper.due(jobs) == [3]
    keeper.submitted(3, "12")
    assert keeper.due(jobs) == []  # the new job is not listed yet: trusted as queued
    jobs.append(_job("12", "hp-r-u3", "PENDING"))
    assert keeper.states(jobs)[3] == Slot.QUEUED  # the newest job of a slot is the one read
    assert UnitKeeper.active(jobs) == ["10", "12"]


def test_a_failed_unit_is_told_once_after_the_grace_period_and_holds_its_slot_until_then():
    now = [0.0]
    failed = FailedUnits(grace_s=5.0, clock=lambda: now[0])
    names = {2: "hp-r-u2", 3: "hp-r-u3"}
    jobs = [_job("10", "hp-r-u2", "NODE_FAIL"), _job("11", "hp-r-u3", "COMPLETED"), _job("9", "other", "NODE_FAIL")]
    failed.observe(jobs, names)
    assert failed.due() == [] and failed.holds(2) and not failed.holds(3)  # its ranks may still be leaving
    now[0] = 4.0
    failed.observe(jobs, names)  # seen again: still from t=0
    assert failed.due() == []
    now[0] = 5.0
    assert failed.due() == [(2, "10")] and not failed.holds(2)
    failed.observe(jobs, names)
    now[0] = 60.0
    assert failed.due() == []  # once


def test_keeper_stops_submitting_after_its_limit():
    keeper = UnitKeeper({1: "u1"}, clock=lambda: 100.0, max_submissions=1)
    keeper.submitted(1, "1")
    assert keeper.due([_job("1", "u1", "FAILED")]) == []


def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path):
    job_dir = tmp_path / "job"
    run = lambda *a: subprocess.run([sys.executable, "-m", "hp.core.cli", "slurm", *a], capture_output=True, text=True,  # noqa: E731
                                    env={**os.environ, "PATH": "/nonexistent"})
    for argv, message in ((["submit", "--nnodes", "2:4", "--job-dir", str(job_dir), "--", "t.py"], "--scaling-policy"),
                          (["submit", "--nnodes", "x", "--", "t.py"], "--nnodes"),
                          (["submit", "--job-dir", str(job_dir), "--", "t.py"], "is not on PATH (is this a Slurm client?)"),
                          (["agent", str(tmp_path / "missing.json"), "--endpoint", "h:1"], "slurm job spec"),
                          (["base", str(tmp_path / "missing.json")], "not inside a Slurm job")):
        done = run(*argv)
        assert done.returncode != 0 and message in done.stderr, (argv, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not job_dir.exists()


def test_agent_refuses_a_rank_outside_the_job(tmp_path):
    path = prepare(_spec(tmp_path), TOKEN)
    done = subprocess.run([sys.executable, "-m", "hp.core.cli", "slurm", "agent", path, "--endpoint", "h:1",
                           "--node-rank", "4"], capture_output=True, text=True)
    assert done.returncode != 0 and "node rank 4 outside 0..3" in done.stderr
    assert json.loads(open(path).read())["max_nodes"] == 4

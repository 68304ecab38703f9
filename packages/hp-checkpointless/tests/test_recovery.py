"""In-process recovery end to end: real `hp run` jobs (4 workers on gloo) with one injected fault,
each compared bit for bit with a fault-free run of the same job."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hp.checkpointless.demo.run import DemoConfig, RunResult, compare, compare_state, job_command, run_job
from hp.checkpointless.events import finished_at, read_events
from hp.core import auth
from hp.core.control_plane import request_finish
from hp.testing import free_port, kill_tagged, wait_for
from hp.core.warm_start import python_command

STEPS, AT = 10, 5


def config(**kw) -> DemoConfig:
    # a hang timeout that a loaded 2-core CI machine never reaches by accident
    return DemoConfig(corpus_mb=2, **{"steps": STEPS, "hang_timeout_s": 10.0, **kw})


@pytest.fixture(scope="session")
def job_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("recovery")
    env = {"HP_DATA_CACHE_DIR": str(root / "cache"), "HP_TEST_DIR": str(root)}
    (root / "cache").mkdir()
    yield env
    kill_tagged(f"HP_TEST_DIR={root}")


@pytest.fixture(scope="session")
def reference(job_env, tmp_path_factory, chaos_reference_cache) -> RunResult:
    result = chaos_reference_cache.demo(config(spares=0), job_env, str(tmp_path_factory.mktemp("reference")))
    assert result.returncode == 0, result.output[-3000:]
    assert len(result.losses()) == STEPS
    return result


def decisions(log_dir: Path) -> list[str]:
    """The controller's decisions; a new generation is named with its reason."""
    out = []
    for line in (log_dir / "controller_decisions.jsonl").read_text().splitlines():
        d = json.loads(line)
        name = f"new_generation:{d['why']}" if d["decision"] == "new_generation" else d["decision"]
        out.append(f"{name}:{d['reason']}" if d.get("why") == "in_process_recovery" else name)
    return out


def faulted(tmp_path, job_env, faults, **kw) -> tuple[RunResult, Path]:
    log_dir = tmp_path / "logs"
    result = run_job(config(**kw), str(log_dir), faults, job_env)
    assert result.returncode == 0, result.output[-3000:]
    return result, log_dir


def assert_identical(reference: RunResult, result: RunResult, state: bool = True) -> None:
    """Every step's losses, and with ``state`` every rank's final state (parameters, optimizer, ...), are the
    reference's bits (``state=False``: a ZeRO job against the replicated reference, whose optimizer state is
    laid out otherwise). One ulp in a hydrated rank's optimizer state changes no loss of a 10-step job."""
    verdict = compare(reference, result)
    assert verdict == {"bitwise_equal": True, "lost_steps": 0, "steps_compared": STEPS}, (
        verdict, reference.losses(), result.losses())
    if state:
        same = compare_state(reference, result)
        assert same["state_equal"] and {"params", "optimizer"} <= set(same["state_parts"]), same


@pytest.mark.parametrize("phase, rank", [("forward", 1), ("backward", 2), ("allreduce", 2), ("commit", 3),
                                         ("optimizer", 1)])
def test_killed_rank_is_replaced_by_the_spare(reference, job_env, tmp_path, phase, rank):
    result, logs = faulted(tmp_path, job_env, [{"at_step": AT, "phase": phase, "kind": "kill", "rank": rank}], spares=1)
    assert_identical(reference, result)
    assert "promote_spare" in decisions(logs) and "restart_worker" not in decisions(logs)
    hydrated = [e for e in result.events if e["event"] == "hydrated"]
    # killed after the vote, the survivors committed step AT: the spare hydrates at it
    assert [e["rank"] for e in hydrated] == [rank]
    assert hydrated[0]["step"] == (AT if phase == "optimizer" else AT - 1)


def test_kill_of_the_source_during_hydration_is_survived(reference, job_env, tmp_path):
    faults = [{"at_step": AT, "phase": "allreduce", "kind": "kill", "rank": 1},
              {"at_step": AT - 1, "phase": "hydration", "kind": "kill", "rank": 0}]
    result, logs = faulted(tmp_path, job_env, faults, spares=2)
    assert_identical(reference, result)
    assert decisions(logs).count("promote_spare") == 2
    assert {e["rank"] for e in result.events if e["event"] == "hydrated"} == {0, 1}
    assert any(e["event"] == "reform_failed" for e in result.events)


def test_a_failure_of_every_rank_while_re_forming_is_reported_and_retried(job_env, tmp_path):
    """Two ranks, both inside the re-form when it fails: rank 0 (the source of the hydration) raises
    an exception of its own, so the replacement's receive fails too. No process died and no rank
    reached a step, so no agent and no step has anything to report: the ranks waiting for the next
    generation must ask the controller for it themselves."""
    reference = run_job(config(nproc=2, spares=0), str(tmp_path / "reference"), [], job_env)
    assert reference.returncode == 0, reference.output[-3000:]
    faults = [{"at_step": AT, "phase": "allreduce", "kind": "kill", "rank": 1},
              {"at_step": AT - 1, "phase": "hydration", "kind": "exception", "rank": 0}]
    result, logs = faulted(tmp_path, job_env, faults, nproc=2, spares=1)
    assert_identical(reference, result)
    assert {e["rank"] for e in result.events if e["event"] == "reform_failed"} == {0, 1}
    assert "new_generation:in_process_recovery:collective" in decisions(logs)


def test_hung_rank_is_killed_and_replaced(reference, job_env, tmp_path):
    result, logs = faulted(tmp_path, job_env, [{"at_step": AT, "phase": "forward", "kind": "hang", "rank": 1}],
                           spares=1, hang_timeout_s=3.0)
    assert_identical(reference, result)
    assert "promote_spare" in decisions(logs)


def test_exception_in_step_recovers_in_process(reference, job_env, tmp_path):
    result, logs = faulted(tmp_path, job_env, [{"at_step": AT, "phase": "forward", "kind": "exception", "rank": 1}],
                           spares=1)
    assert_identical(reference, result)
    assert "promote_spare" not in decisions(logs)  # nobody died: same processes, new generation
    assert "new_generation:in_process_recovery:exception" in decisions(logs)
    assert [e for e in result.events if e["event"] == "failure_detected" and e["in_step"]][0]["rank"] == 1


def test_a_rank_whose_device_fails_its_health_check_leaves_for_a_spare(reference, job_env, tmp_path):
    """An exception whose device is then unusable (the ``unhealthy`` fault: the CPU stand-in for a CUDA
    error that poisons the context): the rank's health check before re-entry fails (hp.core.health), it
    exits 74 and the spare takes its rank."""
    result, logs = faulted(tmp_path, job_env, [{"at_step": AT, "phase": "backward", "kind": "unhealthy", "rank": 2}],
                           spares=1)
    assert_identical(reference, result)
    failed = [e for e in result.events if e["event"] == "health_check_failed"]
    assert [(e["rank"], e["check"]) for e in failed] == [(2, "injected")]
    assert "promote_spare" in decisions(logs) and "exit code 74" in result.output


def test_a_rank_that_keeps_failing_is_replaced(reference, job_env, tmp_path):
    faults = [{"at_step": s, "phase": "forward", "kind": "exception", "rank": 2} for s in (AT - 1, AT, AT + 1)]
    result, logs = faulted(tmp_path, job_env, faults, spares=1)
    assert_identical(reference, result)
    assert decisions(logs).count("new_generation:in_process_recovery:exception") == 2
    assert "escalate" in decisions(logs) and "promote_spare" in decisions(logs)


def test_without_a_spare_the_process_is_restarted_and_hydrates(reference, job_env, tmp_path):
    result, logs = faulted(tmp_path, job_env, [{"at_step": AT, "phase": "allreduce", "kind": "kill", "rank": 1}],
                           spares=0, max_restarts=1)
    assert_identical(reference, result)
    assert "restart_worker" in decisions(logs)
    assert [e["rank"] for e in result.events if e["event"] == "hydrated"] == [1]


def test_without_spare_or_restart_the_job_stops_with_a_clear_error(job_env, tmp_path):
    result = run_job(config(spares=0), str(tmp_path / "logs"),
                     [{"at_step": AT, "phase": "allreduce", "kind": "kill", "rank": 1}], job_env)
    assert result.returncode == 1
    assert "job failed: rank 1" in result.output and "restarts exhausted (0/0)" in result.output


# the stale process: torch and the demo imported first (20+ s on a loaded 2-core box), then it waits for the
# environment to claim rank 1 with, so that it arrives within a second of the recovery, while the job still runs
STALE = """
import json, os, sys, time
from pathlib import Path
import hp.checkpointless.demo.train as train
env = Path(sys.argv[1])
while not env.exists():
    time.sleep(0.05)
os.environ.clear()
os.environ.update(json.loads(env.read_text()))
sys.argv = ["train", *sys.argv[2:]]
train.main()
"""


def test_a_replaced_process_of_an_old_generation_is_fenced_out(job_env, tmp_path):
    """A process that still believes it holds rank 1 of generation 1 (as after a partition) tries
    to rejoin after a spare took rank 1: it must exit, and the job must not notice. Then the job is asked to
    end (hp finish): ``steps`` is only the most it may run, long enough for a slow stale process to arrive."""
    log_dir, steps, port, token = tmp_path / "logs", 2000, free_port(), auth.new_token()
    cfg = config(spares=1, steps=steps)
    kill = [{"at_step": 2, "phase": "allreduce", "kind": "kill", "rank": 1}]
    env_file = tmp_path / "stale-env.json"
    stale = subprocess.Popen(python_command(["-c", STALE, str(env_file), "--steps", str(steps), "--corpus-mb", "2"]),
                             env={**os.environ, **job_env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    # the stale process is given a worker's environment, read from /proc: a worker started cold has it there
    # (a forked one's /proc environ is its fork server's: it sets the worker's in os.environ)
    job = subprocess.Popen(job_command(cfg, str(log_dir), ["--start-method", "spawn", "--rdzv-endpoint",
                                                           f"127.0.0.1:{port}"]),
                           env={**os.environ, **job_env, "HP_FAULTS": json.dumps(kill), auth.TOKEN_ENV: token},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        events = lambda: read_events(str(log_dir / "events"))  # noqa: E731
        wait_for(lambda: any(e["event"] == "resumed" and e["generation"] == 2 for e in events()), 120, "recovery")
        rank2 = next(e["pid"] for e in events() if e["event"] == "pg_ready" and e["rank"] == 2)
        claim = dict(x.split("=", 1) for x in Path(f"/proc/{rank2}/environ").read_text().split("\0") if "=" in x)
        claim.update({"RANK": "1", "LOCAL_RANK": "1", "HP_HOLDER": "r1.0", "HP_GENERATION": "1", "HP_FAULTS": "",
                      "HP_HEARTBEAT_FILE": "", "HP_LOG_DIR": str(tmp_path / "stale")})
        env_file.with_suffix(".tmp").write_text(json.dumps(claim))
        env_file.with_suffix(".tmp").rename(env_file)  # whole: the stale process reads it once it exists
        _, err = stale.communicate(timeout=120)
        assert stale.returncode != 0
        assert re.search(r"fenced out: rank 1 of generation \d+ is held by 'spare.n0s0'", err), err[-3000:]
        assert job.poll() is None, "the job ended before the stale process arrived: the test proved nothing"
        request_finish(f"127.0.0.1:{port}", token, "the stale process was fenced out")
        assert job.wait(timeout=240) == 0
    finally:
        for p in (job, stale):
            if p.poll() is None:
                p.kill()
    result = RunResult(0, 0.0, read_events(str(log_dir / "events")), "")
    ended = finished_at(result.events)
    assert ended is not None and sorted(result.losses()) == list(range(ended + 1))  # every step, to the agreed end
    assert all(len(v) == 1 for v in result.losses().values())  # nothing committed twice


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_and_spares_of_a_dead_agent_exit(job_env, tmp_path):
    """The agent (and the controller it hosts) is SIGKILLed: nobody supervises its workers and spare
    any more, so they must leave instead of training on, or waiting, forever."""
    log_dir = tmp_path / "logs"
    job = subprocess.Popen(job_command(config(spares=1, steps=500), str(log_dir)), env={**os.environ, **job_env},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        events = lambda: read_events(str(log_dir / "events"))  # noqa: E731
        wait_for(lambda: any(e["event"] == "commit" for e in events()), 120, "training")
        wait_for(lambda: any(e["event"] == "spare_ready" for e in events()), 60, "the spare")
        children = {e["pid"] for e in events() if e["event"] in ("pg_ready", "spare_ready")}
        assert len(children) == 5
        job.kill()
        job.wait()
        wait_for(lambda: not any(map(running, children)), 30, "orphaned workers to exit")
        workers = {e["pid"] for e in events() if e["event"] == "pg_ready"}
        # the spare may notice first that the store (in the dead agent) is gone: it exits either way
        assert workers <= {e["pid"] for e in events() if e["event"] == "orphaned"}
    finally:
        if job.poll() is None:
            job.kill()


# ---- sharded optimizer state (torch ZeroRedundancyOptimizer, buddy replicas) -----------------------
ZERO = ["--zero"]


def test_sharded_optimizer_trains_bit_identically_to_replicated(reference, job_env, tmp_path):
    """ZeRO-1 only changes where optimizer state lives: the fault-free losses are the same bits."""
    result = run_job(config(spares=0, train_args=ZERO), str(tmp_path / "logs"), [], job_env)
    assert result.returncode == 0, result.output[-3000:]
    assert_identical(reference, result, state=False)


@pytest.mark.parametrize("phase, rank, rolled_forward", [
    ("forward", 1, False),  # before the vote: the buddy's copy is at the last committed step
    ("optimizer", 2, True),  # after the vote, before its shard update: the buddy re-runs it from one step back
])
def test_a_lost_shard_is_rebuilt_from_the_buddy(reference, job_env, tmp_path, phase, rank, rolled_forward):
    result, logs = faulted(tmp_path, job_env, [{"at_step": AT, "phase": phase, "kind": "kill", "rank": rank}],
                           spares=1, train_args=ZERO)
    assert_identical(reference, result, state=False)
    assert "promote_spare" in decisions(logs)
    rebuilt = [e for e in result.events if e["event"] == "shard_rebuilt"]
    assert [(e["rank"], e["buddy"], e["rolled_forward"]) for e in rebuilt] == [(rank, (rank + 1) % 4, rolled_forward)]
    assert rebuilt[0]["step"] == (AT if phase == "optimizer" else AT - 1)


def test_sharded_job_survives_an_exception_and_a_restarted_process(reference, job_env, tmp_path):
    faults = [{"at_step": AT - 2, "phase": "backward", "kind": "exception", "rank": 3},
              {"at_step": AT, "phase": "allreduce", "kind": "kill", "rank": 0}]
    result, logs = faulted(tmp_path, job_env, faults, spares=0, max_restarts=1, train_args=ZERO)
    assert_identical(reference, result, state=False)
    assert "restart_worker" in decisions(logs)
    assert [e["rank"] for e in result.events if e["event"] == "shard_rebuilt"] == [0]


def test_sharded_job_survives_a_second_failure_during_hydration(reference, job_env, tmp_path):
    """Rank 3 dies while rank 1's replacement is being hydrated: rank 3's shard is still at its buddy
    (rank 0), and the buddy of rank 1 keeps its copy until a transfer completes."""
    faults = [{"at_step": AT, "phase": "forward", "kind": "kill", "rank": 1},
              {"at_step": AT - 1, "phase": "hydration", "kind": "kill", "rank": 3}]
    result, logs = faulted(tmp_path, job_env, faults, spares=2, train_args=ZERO)
    assert_identical(reference, result, state=False)
    assert decisions(logs).count("promote_spare") == 2
    assert {e["rank"] for e in result.events if e["event"] == "shard_rebuilt"} == {1, 3}


def test_a_shard_lost_with_its_buddy_stops_the_job_naming_it(job_env, tmp_path):
    faults = [{"at_step": AT, "phase": "forward", "kind": "kill", "rank": r} for r in (1, 2)]
    result = run_job(config(spares=2, train_args=ZERO), str(tmp_path / "logs"), faults, job_env)
    assert result.returncode != 0
    assert "optimizer shard of rank 1 at step 4 is lost: its buddy rank 2 holds nothing" in result.output, \
        result.output[-3000:]

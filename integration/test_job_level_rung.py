"""The job-level rung of the recovery ladder: hp-checkpointless falls back on hp-tiered-ckpt's tiers
when no peer holds the state, and a job started again resumes from the newest complete checkpoint.
Real `hp run` jobs, a real `hp ckpt daemon`; losses compared bit for bit with a fault-free run."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hp.checkpointless.demo.run import DemoConfig, RunResult, compare, run_job
from hp.core.auth import new_token
from hp.core.testing import free_port, kill_tagged, wait_for
from hp.tiered_ckpt.client import DaemonClient

STEPS = 10


def config(**kw) -> DemoConfig:
    return DemoConfig(corpus_mb=2, steps=STEPS, hang_timeout_s=10.0, **kw)


@pytest.fixture(scope="module")
def job_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("rung")
    (root / "cache").mkdir()
    token = new_token()
    shm = Path(tempfile.mkdtemp(prefix="hp-rung-test-", dir="/dev/shm"))
    port = free_port()
    env = {**os.environ, "HP_JOB_TOKEN": token, "HP_TEST_DIR": str(root)}
    daemon = subprocess.Popen([sys.executable, "-m", "hp.core.cli", "ckpt", "daemon", "--listen", f"127.0.0.1:{port}",
                               "--dir", str(shm), "--replicas", "0"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    client = DaemonClient(("127.0.0.1", port), token, timeout=10)

    def up() -> bool:
        assert daemon.poll() is None, "hp ckpt daemon exited"
        try:
            client.ping()
            return True
        except OSError:
            return False

    try:
        wait_for(up, 60, "hp ckpt daemon")
        yield {"HP_DATA_CACHE_DIR": str(root / "cache"), "HP_TEST_DIR": str(root), "HP_JOB_TOKEN": token,
               "HP_CKPT_DAEMON": f"127.0.0.1:{port}"}
    finally:
        os.killpg(daemon.pid, signal.SIGKILL)
        daemon.wait()
        kill_tagged(f"HP_TEST_DIR={root}")
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(job_env, tmp_path_factory) -> RunResult:
    result = run_job(config(spares=0), str(tmp_path_factory.mktemp("reference")), [], job_env)
    assert result.returncode == 0, result.output[-3000:]
    return result


def restored(result: RunResult) -> list[dict]:
    return [e for e in result.events if e["event"] == "restored"]


def test_a_lost_shard_comes_back_from_the_memory_tier(reference, job_env, tmp_path):
    """Rank 1 and its buddy die together: no peer holds rank 1's optimizer shard, so every rank loads
    the newest checkpoint (step 4, saved every 2 steps) from the node daemon and training goes on."""
    faults = [{"at_step": 5, "phase": "forward", "kind": "kill", "rank": r} for r in (1, 2)]
    args = ["--zero", "--checkpoint", "rung-zero", "--checkpoint-every", "2"]
    result = run_job(config(spares=2, train_args=args), str(tmp_path / "logs"), faults, job_env)
    assert result.returncode == 0, result.output[-3000:]
    assert compare(reference, result) == {"bitwise_equal": True, "lost_steps": 0, "steps_compared": STEPS}
    assert {(e["rank"], e["step"], e["tier"]) for e in restored(result)} == {(r, 4, "memory") for r in range(4)}
    assert "hp: restored step 4 from the memory tier (the optimizer shard of rank 1" in result.output


def test_a_job_started_again_resumes_from_the_newest_checkpoint(reference, job_env, tmp_path):
    """The whole job dies at step 7 (no spare, no restart left); started again with the same
    checkpoint namespace it resumes after step 6, the newest checkpoint, instead of from scratch."""
    args = ["--checkpoint", "rung-restart", "--checkpoint-every", "3"]
    kill = [{"at_step": 7, "phase": "allreduce", "kind": "kill", "rank": 1}]
    first = run_job(config(spares=0, train_args=args), str(tmp_path / "first"), kill, job_env)
    assert first.returncode != 0 and sorted(first.losses()) == list(range(7)), first.output[-3000:]
    again = run_job(config(spares=0, train_args=args), str(tmp_path / "again"), [], job_env)
    assert again.returncode == 0, again.output[-3000:]
    assert {(e["step"], e["tier"]) for e in restored(again)} == {(6, "memory")}
    assert sorted(again.losses()) == list(range(7, STEPS))  # nothing before the checkpoint recomputed
    assert all(again.losses()[s] == reference.losses()[s] for s in range(7, STEPS))

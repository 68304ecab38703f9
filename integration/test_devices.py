"""A node's processes each have a device (LOCAL_RANK) before they hold a rank: a hot spare its own, a
replenished spare the one the dead rank freed (what a GPU node needs; on CPU nothing binds to it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hp.checkpointless.events import read_events
from hp.core import auth
from hp.testing import finish_when, free_port, kill_tagged

ROOT = Path(__file__).resolve().parents[1]


def test_a_spare_has_its_own_device_and_its_replacement_takes_the_dead_rank_s(tmp_path):
    kill = json.dumps([{"at_step": 3, "phase": "allreduce", "kind": "kill", "rank": 1}])
    port, token = free_port(), auth.new_token()
    env = {**os.environ, "HP_DATA_CACHE_DIR": str(tmp_path), "HP_FAULTS": kill, "HP_TEST_DIR": str(tmp_path),
           auth.TOKEN_ENV: token}
    events = lambda: read_events(str(tmp_path / "logs" / "events"))  # noqa: E731
    # at most 4000 steps: the job ends (hp finish) once the replenished spare said it is ready, however long
    # a loaded machine takes to start it
    out = open(tmp_path / "job.out", "w")  # the agent keeps its own descriptor
    job = subprocess.Popen(
        [sys.executable, "-m", "hp.core.cli", "run", "--nproc-per-node", "2", "--spares", "1", "--replenish-spares",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--log-dir", str(tmp_path / "logs"), "--tee", "0",
         "-m", "hp.checkpointless.demo.train", "--steps", "4000", "--corpus-mb", "1"],
        cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    out.close()
    try:
        finish_when(job, f"127.0.0.1:{port}", token,
                    lambda: any(e["event"] == "spare_ready" and e["spare"] == "n0s1" for e in events()), 240,
                    "the replenished spare's readiness")
        job.wait(timeout=240)
    finally:  # nothing of the job outlives the test, even on a timeout
        kill_tagged(f"HP_TEST_DIR={tmp_path}")
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, (tmp_path / "job.out").read_text()[-3000:]
    ready = {e["spare"]: e["local_rank"] for e in events() if e["event"] == "spare_ready"}
    # n0s0 took rank 1; n0s1 replaced it on rank 1's device
    assert ready == {"n0s0": 2, "n0s1": 1}, ready

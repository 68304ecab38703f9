"""Replacement spares forked from the pre-imported server: they run the worker's command with the
worker's environment and threads, their output lands in the worker's log files, and their exit is
reported like any worker's."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing import Std

from hp.core import forkserver
from hp.core.workers import python_command

SCRIPT = """
import json, os, sys, time
import torch
out = {"threads": torch.get_num_threads(), "argv": sys.argv[1:], "env": os.environ.get("HP_FORK_TEST"),
       "main": __name__, "pid": os.getpid(), "sid": os.getsid(0)}
print(json.dumps(out), flush=True)
mode = sys.argv[1]
if mode == "fail":
    raise ValueError("broken on purpose")
if mode == "wait":
    time.sleep(600)
"""


def _worker(tmp_path: Path, mode: str) -> forkserver.ForkedWorker:
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    w = forkserver.ForkedWorker(-1, -1, python_command(str(script), [mode, "x"], False), str(tmp_path),
                                Std.ALL, spare_id="n0s9")
    w.start({"HP_FORK_TEST": "yes", "OMP_NUM_THREADS": "1"})
    return w


def _wait_exit(w: forkserver.ForkedWorker, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while (status := w.poll()) is None:
        assert time.monotonic() < deadline, "the forked worker never ended"
        time.sleep(0.05)
    return status


def _stdout(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "spare-n0s9" / "attempt_0" / "stdout.log").read_text().splitlines()[0])


def test_a_forked_worker_runs_the_command_with_the_worker_env_and_one_thread(tmp_path):
    forkserver.warm({"OMP_NUM_THREADS": "1"})
    w = _worker(tmp_path, "ok")
    status = _wait_exit(w)
    assert status.ok and status.pid == w.pid
    out = _stdout(tmp_path)
    assert out == {**out, "threads": 1, "argv": ["ok", "x"], "env": "yes", "main": "__main__", "sid": w.pid}
    w.finish()


def test_a_failing_forked_worker_reports_its_exit_code(tmp_path):
    w = _worker(tmp_path, "fail")
    status = _wait_exit(w)
    assert status.exitcode == 1 and status.signal is None
    assert "ValueError: broken on purpose" in (tmp_path / "spare-n0s9" / "attempt_0" / "stderr.log").read_text()


def test_a_forked_worker_killed_or_stopped_reports_the_signal(tmp_path):
    w = _worker(tmp_path, "wait")
    deadline = time.monotonic() + 120
    out = tmp_path / "spare-n0s9" / "attempt_0" / "stdout.log"
    while not (out.exists() and out.read_text()):  # the child has started the script
        assert time.monotonic() < deadline
        time.sleep(0.05)
    w.kill_hung()
    assert _wait_exit(w).signal == "SIGKILL"
    (tmp_path / "again").mkdir()
    w2 = _worker(tmp_path / "again", "wait")
    w2.stop(signal.SIGTERM, timeout_s=30)
    assert w2.poll().signal == "SIGTERM"

"""Workers forked from the pre-imported server: they run the worker's command with the worker's
environment and threads, their output lands where torch elastic's would (the log files with --tee, the
agent's console without), their atexit handlers run, and their exit is reported like any worker's."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import Std

from hp.core import fork_context, forkserver
from hp.testing import wait_for
from hp.core.workers import python_command
from hp.core.warm_start import resolve

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
    w.finish()  # stops the log tails: their threads would keep this process from exiting
    return status


def _stdout(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "spare-n0s9" / "attempt_0" / "stdout.log").read_text().splitlines()[0])


def test_a_forked_worker_runs_the_command_with_the_worker_env_and_one_thread(tmp_path):
    fork_context.warm({"OMP_NUM_THREADS": "1"})
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


# a worker script for `hp run`: its atexit handler must run, and it waits for the test's word to end
JOB_SCRIPT = """
import atexit, os, sys, time
rank = os.environ["RANK"]
atexit.register(lambda: print(f"atexit of rank {rank}", flush=True))
print(f"rank {rank} started", flush=True)
open(os.path.join(os.environ["HP_TEST_DIR"], f"started{rank}"), "w").close()
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(os.environ["HP_TEST_DIR"], "finish")):
    assert time.monotonic() < deadline, "never told to finish"
    time.sleep(0.05)
"""


def _forkserver_of(agent_pid: int) -> int:
    """The agent's fork server: its child running multiprocessing's forkserver main."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == agent_pid and b"forkserver" in cmdline:
                return int(entry.name)
    raise AssertionError(f"agent {agent_pid} has no fork server")


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_workers_of_either_start_method_share_the_agent_s_console_and_run_atexit(launch, tmp_path, start_method):
    """--tee 0: a worker's streams are the agent's (no log files), as torch elastic's are; a forked worker's
    atexit handlers run like a cold one's. With the fork server, a SIGTERM sent to the server by someone
    else (Slurm signals every process of a job step) neither kills it nor the workers it forked."""
    script = tmp_path / "w.py"
    script.write_text(JOB_SCRIPT)
    job = launch("run", "--nproc-per-node", "2", "--tee", "0", "--start-method", start_method,
                 "--log-dir", str(tmp_path / "logs"), str(script))
    wait_for(lambda: all((tmp_path / f"started{r}").exists() for r in range(2)), what="2 workers to start")
    if start_method == "forkserver":
        server = _forkserver_of(resolve(job.proc.pid))  # the agent, forked warm or not
        os.kill(server, signal.SIGTERM)
        time.sleep(1)
        assert Path(f"/proc/{server}").exists(), "the fork server died of a SIGTERM from outside its agent"
    (tmp_path / "finish").touch()
    assert job.wait() == 0, job.output
    for rank in range(2):
        assert f"rank {rank} started" in job.output and f"atexit of rank {rank}" in job.output, job.output
        assert not (tmp_path / "logs" / f"rank{rank}" / "attempt_0" / "stdout.log").exists()


def test_nothing_the_agent_started_outlives_it_a_plain_script_stuck_at_exit_included(launch, tmp_path):
    """An agent SIGKILLed (a CI timeout, an OOM kill) takes its fork server, the workers forked from it and
    multiprocessing's resource tracker with it, even when a worker is a plain script that would never exit
    on its own (one stuck at its exit, as a DDP script in gloo's teardown was)."""
    script = tmp_path / "w.py"
    script.write_text(JOB_SCRIPT.replace('"finish"', '"never"'))
    job = launch("run", "--nproc-per-node", "2", "--tee", "0", "--log-dir", str(tmp_path / "logs"), str(script))
    wait_for(lambda: all((tmp_path / f"started{r}").exists() for r in range(2)), what="2 workers to start")
    server = _forkserver_of(resolve(job.proc.pid))  # the agent, forked warm or not
    tag = f"HP_TEST_DIR={tmp_path}"
    from hp.testing import tagged_pids

    started = set(tagged_pids(tag))
    assert server in started and len(started) >= 5, started  # agent, server, tracker, 2 workers
    os.kill(job.proc.pid, signal.SIGKILL)
    job.proc.wait()
    wait_for(lambda: not tagged_pids(tag), 20, f"every process of the agent to end (left: {tagged_pids(tag)})")

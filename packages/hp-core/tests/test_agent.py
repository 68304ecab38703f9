"""`hp run` end to end: real agent, controller, store and worker processes."""

from __future__ import annotations

import json
import os
import signal

from pathlib import Path

from hp.testing import pids, wait_for

WORKERS = Path(__file__).parent / "workers"
MARKER = str(WORKERS / "marker_worker.py")


def _all_started(tmp_path, n):
    return lambda: all(pids(tmp_path, r) for r in range(n))


def test_killed_worker_is_restarted_alone(launch, tmp_path):
    job = launch("run", "--nproc-per-node", "3", "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"), MARKER)
    wait_for(_all_started(tmp_path, 3), what="3 workers to start")
    before = {r: pids(tmp_path, r) for r in range(3)}
    os.kill(before[1][0], signal.SIGKILL)
    wait_for(lambda: len(pids(tmp_path, 1)) == 2, what="rank 1 to be restarted")
    (tmp_path / "finish").touch()
    assert job.wait() == 0, job.output
    assert pids(tmp_path, 0) == before[0] and pids(tmp_path, 2) == before[2], "healthy ranks were restarted"
    assert len(pids(tmp_path, 1)) == 2 and pids(tmp_path, 1)[1] != before[1][0]
    assert "restarted rank 1" in job.output
    restarted_env = json.loads((tmp_path / "rank1.env.json").read_text())
    assert restarted_env["HP_GENERATION"] == "2" and restarted_env["TORCHELASTIC_RESTART_COUNT"] == "1"
    decisions = [json.loads(line) for line in (tmp_path / "logs" / "controller_decisions.jsonl").read_text().splitlines()]
    assert [d["decision"] for d in decisions if d["decision"] == "restart_worker"] == ["restart_worker"]
    assert decisions[-1]["decision"] == "job_succeeded"
    # both attempts of rank 1 kept their own logs
    assert (tmp_path / "logs" / "rank1" / "attempt_0" / "stdout.log").read_text().startswith("worker rank 1 started")
    assert (tmp_path / "logs" / "rank1" / "attempt_1" / "stdout.log").exists()


def test_kill_without_restarts_fails_naming_rank_and_signal(launch, tmp_path):
    job = launch("run", "--nproc-per-node", "3", "--max-restarts", "0", MARKER)
    wait_for(_all_started(tmp_path, 3), what="3 workers to start")
    os.kill(pids(tmp_path, 1)[0], signal.SIGKILL)
    code = job.wait()
    assert code != 0
    failure = [line for line in job.output.splitlines() if "job failed" in line]
    assert failure and "rank 1" in failure[0] and "SIGKILL" in failure[0], job.output
    assert "Traceback" not in job.output
    assert len(pids(tmp_path, 1)) == 1


def test_worker_env_and_prefixed_logs(launch, tmp_path):
    job = launch("run", "--nproc-per-node", "2", MARKER)
    wait_for(_all_started(tmp_path, 2), what="2 workers to start")
    (tmp_path / "finish").touch()
    assert job.wait() == 0, job.output
    for rank in range(2):
        env = json.loads((tmp_path / f"rank{rank}.env.json").read_text())
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["HP_GENERATION"] == "1"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["HP_CONTROLLER"].startswith("127.0.0.1:") and len(env["HP_JOB_TOKEN"]) == 64
        assert f"[rank{rank}]:worker rank {rank} started" in job.output
        assert f"[rank{rank}]:worker rank {rank} on stderr" in job.output


def test_exception_message_reaches_the_failure_report(launch, tmp_path):
    job = launch("run", "--nproc-per-node", "2", str(WORKERS / "raising_worker.py"))
    assert job.wait() == 1
    failure = [line for line in job.output.splitlines() if "job failed" in line]
    assert failure and "rank 1" in failure[0] and "exited with code 1" in failure[0], job.output
    assert "ValueError: rank 1 was told to raise" in failure[0]


def test_sigterm_is_forwarded_to_workers(launch, tmp_path):
    job = launch("run", "--nproc-per-node", "2", MARKER)
    wait_for(_all_started(tmp_path, 2), what="2 workers to start")
    worker_pids = [pids(tmp_path, r)[0] for r in range(2)]
    started = {pid: _start_time(pid) for pid in worker_pids}
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait() == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in job.output
    for pid in worker_pids:  # gone, a zombie, or its pid already reused by another process (pid_max is small)
        stat = _stat(pid)
        assert stat is None or stat[2] == "Z" or stat[21] != started[pid], f"worker {pid} still runs: {stat[2]}"


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (which may hold spaces), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    return [str(pid), "comm", *raw.rsplit(")", 1)[1].split()]


def _start_time(pid: int) -> str:
    stat = _stat(pid)
    assert stat is not None, f"worker {pid} is gone before the test signalled anything"
    return stat[21]


def test_two_agents_form_one_job_over_loopback(launch, tmp_path, free_port):
    endpoint = f"127.0.0.1:{free_port}"
    token = {"HP_JOB_TOKEN": "t" * 64}
    nodes = [
        launch("run", "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "2", "--rdzv-endpoint",
               endpoint, str(WORKERS / "allreduce_worker.py"), extra_env=token)
        for n in (1, 0)  # node 1 first: it must wait for the controller to appear
    ]
    assert [n.wait() for n in nodes] == [0, 0], [n.output for n in nodes]
    results = [(tmp_path / f"rank{r}.sum").read_text().split() for r in range(4)]
    assert all(r[:2] == ["6.0", "4"] for r in results), results  # 0+1+2+3 over 4 ranks
    assert [r[2] for r in results] == ["0", "0", "1", "1"]


def test_multi_node_without_a_token_is_refused(launch, tmp_path, free_port):
    env = {"HP_JOB_TOKEN": ""}
    job = launch("run", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port}", MARKER, extra_env=env)
    assert job.wait() == 2
    assert job.output.strip().splitlines() == [
        "hp: error: a shared job token is required: set HP_JOB_TOKEN or --token-file (`hp token` prints a new one)"
    ]


def test_standalone_controller_runs_the_job(launch, tmp_path, free_port):
    token = {"HP_JOB_TOKEN": "s" * 64}
    controller = launch("controller", "--nnodes", "1", "--port", str(free_port),
                        "--decision-log", str(tmp_path / "decisions.jsonl"), extra_env=token)
    job = launch("run", "--external-controller", "--rdzv-endpoint", f"127.0.0.1:{free_port}",
                 "--nproc-per-node", "2", MARKER, extra_env=token)
    wait_for(_all_started(tmp_path, 2), what="2 workers to start")
    (tmp_path / "finish").touch()
    assert job.wait() == 0, job.output
    assert controller.wait() == 0, controller.output
    assert "job succeeded" in controller.output
    decisions = [json.loads(line)["decision"] for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert decisions[0] == "join" and decisions[-1] == "job_succeeded"


def test_an_agent_cut_off_from_the_controller_fences_itself(launch, tmp_path, free_port):
    """The controller vanishes (as behind a partition): once its lease (heartbeat timeout minus two
    beats) runs out, the agent kills its workers and exits 1 instead of letting them train on."""
    token = {"HP_JOB_TOKEN": "f" * 64}
    timing = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "2"]
    controller = launch("controller", "--nnodes", "1", "--port", str(free_port), "--heartbeat-timeout", "2",
                        extra_env=token)
    job = launch("run", "--external-controller", "--rdzv-endpoint", f"127.0.0.1:{free_port}",
                 "--nproc-per-node", "2", *timing, MARKER, extra_env=token)
    wait_for(_all_started(tmp_path, 2), what="2 workers to start")
    worker_pids = [pids(tmp_path, r)[0] for r in range(2)]
    controller.kill()
    assert job.wait(timeout=120) == 1, job.output
    assert "node 0 fenced itself: no answer from the controller" in job.output and "lease 1.6 s" in job.output
    for pid in worker_pids:
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]

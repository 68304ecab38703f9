"""A timed-out scenario says where each of its processes is stuck: a real process blocked in a known
function shows that function in the failure message; torch's C++ warnings leave the output tail."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from hp.chaos import stacks
from hp.chaos.launch import JobRun
from hp.chaos.runner import evaluate
from hp.chaos.scenario import parse_scenario
from hp.checkpointless.demo.run import RunResult

STUCK = textwrap.dedent("""
    import threading, time
    def wait_for_a_peer_that_never_answers():
        threading.Event().wait()
    print("ready", flush=True)
    wait_for_a_peer_that_never_answers()
""")


def test_a_stuck_process_is_dumped_with_its_main_thread_frames(tmp_path):
    assert stacks.py_spy() is not None, "py-spy is in hp-chaos's test extra"
    proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        got = stacks.dump([proc.pid], str(tmp_path))
        title, text = got[proc.pid]
        assert "wait_for_a_peer_that_never_answers" in " ".join(stacks.main_thread_frames(text))
        assert (tmp_path / "stacks" / f"{proc.pid}.txt").read_text().count("wait_for_a_peer") >= 1
        line, = stacks.summary(got)
        assert line.startswith(f"pid {proc.pid} (") and "wait (threading.py:" in line \
            and "wait_for_a_peer_that_never_answers (<string>:4)" in line
    finally:
        proc.kill()
        proc.wait()
    assert stacks.dump([proc.pid], str(tmp_path)) == {}  # an ended process: nothing to show


def test_a_timed_out_verdict_shows_the_stacks_and_drops_torch_chatter():
    chatter = "".join(f"[W1202 16:28:{s:02d}.216718994 socket.cpp:469] [c10d] waitForInput: poll returned 0\n"
                      for s in range(40))
    output = "hp run: node 1: all 1 workers succeeded\n" + chatter
    run = JobRun(RunResult(124, 240.0, [{"t": 1.0, "event": "commit", "rank": 0, "step": 0, "generation": 1,
                                         "loss": (1.0).hex(), "pid": 7}], output), True, 0, [],
                 stacks={7: ("python -m hp.core.worker_main demo", "Thread 7 (idle): \"MainThread\"\n"
                             "    join (threading.py:1119)\n    close (group.py:88)\n")})
    scenario = parse_scenario({"name": "unit", "job": {"steps": 2},
                               "faults": [{"at_step": 1, "kind": "kill", "target": "rank:0"}], "expect": {"completes": True}})
    failure, = [f for f in evaluate(scenario, run.result, run)["failures"] if f.startswith("completes")]
    assert "pid 7 (python -m hp.core.worker_main demo): join (threading.py:1119) <- close (group.py:88)" in failure
    assert "hp run: node 1: all 1 workers succeeded" in failure and "waitForInput" not in failure
    assert "40 lines of torch's C++ warnings left out" in failure

"""A replacement spare's CPU priority: lowered while it starts, raised back, never a shared group's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hp.core import priority

needs_autogroup = pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="kernel without autogroups")
SLEEPER = [sys.executable, "-c", "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
                                 "print('up', flush=True); time.sleep(60)"]


def _start(own_session: bool) -> subprocess.Popen:
    proc = subprocess.Popen(SLEEPER, stdout=subprocess.PIPE, text=True, start_new_session=own_session)
    assert proc.stdout.readline().strip() == "up"  # both threads exist
    return proc


def _policies(pid: int) -> set[int]:
    return {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


@needs_autogroup
def test_a_session_leader_is_lowered_and_restored_with_all_its_threads():
    proc = _start(own_session=True)
    try:
        done = priority.lower(proc.pid)
        assert "autogroup nice 19" in done
        assert Path(f"/proc/{proc.pid}/autogroup").read_text().split()[-1] == "19"
        idle = priority.can_leave_idle()
        assert ("SCHED_IDLE" in done) == idle
        assert _policies(proc.pid) == ({os.SCHED_IDLE} if idle else {os.SCHED_OTHER})
        priority.restore(proc.pid)
        assert Path(f"/proc/{proc.pid}/autogroup").read_text().split()[-1] == "0"
        assert _policies(proc.pid) == {os.SCHED_OTHER}
    finally:
        proc.kill()
        proc.wait()


@needs_autogroup
def test_a_process_sharing_its_session_keeps_the_group_s_priority():
    proc = _start(own_session=False)  # in this test's session: lowering its group would lower pytest too
    before = Path("/proc/self/autogroup").read_text()
    try:
        assert "autogroup nice 19" not in priority.lower(proc.pid)
        assert Path("/proc/self/autogroup").read_text() == before
    finally:
        priority.restore(proc.pid)
        proc.kill()
        proc.wait()


def test_a_gone_process_is_not_an_error():
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    priority.lower(proc.pid)
    priority.restore(proc.pid)

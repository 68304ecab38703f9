"""CPU priority of a waiting hot spare: low while it starts and waits, normal once it holds a rank.

A replacement spare starts while the job trains (``import torch`` alone is seconds of CPU); on a
host whose cores the ranks already fill, it steals those seconds from the ranks and a synchronous
step runs at the pace of the slowest one. At low priority it takes only the CPU the ranks leave.

Two knobs, because of how Linux schedules:

* **the autogroup's nice** (``/proc/<pid>/autogroup``). With ``kernel.sched_autogroup_enabled``
  every session is a scheduling group and CPU is shared fairly *between groups*; torch's elastic
  launcher starts each worker in a session of its own, so a process's own nice or policy changes
  nothing against the other ranks. The group's nice can be set back to 0 by its owner without
  privilege (only a negative nice needs CAP_SYS_NICE), so lowering it is always undoable.
* **the threads' policy** (``SCHED_IDLE``), which is what counts when autogroups are off. Leaving
  SCHED_IDLE needs CAP_SYS_NICE (or an RLIMIT_NICE nobody sets), so it is used only where it can be
  undone: a spare must never be promoted stuck at idle priority.

Everything here is best effort: a failure leaves the process at normal priority, which is correct,
only slower for the ranks.
"""

from __future__ import annotations

import os
import resource

LOW_NICE = 19  # the lowest an autogroup can get: its weight is 15 against 1024 at nice 0
# Opt-in (HP_SPARE_LOW_PRIORITY_S=10, say): seconds a replacement spare starts at low priority before
# the agent raises it. Off by default: on the 2-core bench box (4 ranks, other jobs) there was no idle
# CPU to harvest, spares got ready in ~31 s instead of ~10 s, and 7 of 9 were promoted before ready
# (recovery 1.1 s median instead of 0.3 s), with no step time won back (hp bench goodput, README).
LOW_FOR_S = float(os.environ.get("HP_SPARE_LOW_PRIORITY_S", "0"))


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def _autogroup(pid: int, nice: int) -> bool:
    """Only a session leader's: a session's autogroup holds that session alone, whereas the group of
    a process that shares its session (with the agent, say) would lower them all."""
    try:
        if os.getsid(pid) != pid:
            return False
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
        return True
    except OSError:  # no autogroup support, not ours, or gone
        return False


def can_leave_idle() -> bool:
    """Whether this process may move a thread from SCHED_IDLE back to SCHED_OTHER at nice 0."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or soft >= 20


def lower(pid: int) -> list[str]:
    """Lower a just-started process (and its threads); returns what was lowered."""
    done = []
    if _autogroup(pid, LOW_NICE):
        done.append(f"autogroup nice {LOW_NICE}")
    if can_leave_idle():
        lowered = 0
        for tid in _threads(pid):
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                lowered += 1
            except OSError:
                pass
        if lowered:
            done.append("SCHED_IDLE")
    return done


def restore(pid: int) -> None:
    """Back to normal priority: the autogroup at nice 0, every thread of ``pid`` at SCHED_OTHER (a
    policy is per thread, and threads started while lowered inherited it)."""
    _autogroup(pid, 0)
    if not hasattr(os, "SCHED_IDLE"):
        return
    for tid in _threads(pid):
        try:
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except OSError:  # not permitted or gone: the autogroup alone decides, as without privilege
            pass

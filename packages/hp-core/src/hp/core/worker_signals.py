"""A worker's SIGTERM is its agent's to act on.

A scheduler's preemption notice does not reach the agent alone: Slurm signals every process of the job
step at the start of the grace time (``proctrack/linuxproc`` walks the process tree, ``proctrack/cgroup``
signals the whole cgroup), so the workers get the SIGTERM their agent gets. A worker that dies of it
leaves in the middle of a step, and the ranks that stay see a failed collective and replay that step,
while its agent is still asking the controller to let this node's ranks leave at the next step boundary
(hp.core.agent.departure, ``Departure.leave``). Kubernetes signals only the container's first process; Slurm does not.

So a worker of ``hp run`` (``HP_AGENT_PID`` in its environment) keeps SIGTERM blocked in every thread and
waits for it in one thread of its own (``sigwaitinfo``, which says who sent it):

* from its agent (the agent stopping it), or once the agent is gone: the worker dies of SIGTERM, as
  before (the signal is re-raised in that thread with the default action);
* from anyone else while the agent lives: nothing happens here. The agent got the same notice; the
  controller's next generation tells this rank to leave at the step boundary, or (the job cannot go on
  without it) to save its last committed step and stop. A scheduler kills what is left at the end of its
  grace time anyway.

Installed by :func:`defer_sigterm_to_agent`, which :mod:`hp.core.worker_main` (how ``hp run`` starts every
worker) calls in the main thread before the script runs and starts other threads
(threads inherit the blocked mask; one started earlier could still take the signal and die of it, as
before: counted and reported). Linux only (``sigwaitinfo``); elsewhere nothing is installed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping

from hp.core.protocol import AGENT_PID_ENV


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (one of another user's counts; a zombie its parent has not reaped yet
    does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return not os.path.isdir("/proc/self")  # no procfs: kill(pid, 0) said it exists


def parent_death_signal(sig: int) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``; 0
    clears it). A worker forked by its node's fork server dies with the server, which dies with its agent
    (:mod:`hp.core.fork_context`): nothing ``hp run`` started outlives it, a script stuck at its exit
    included. hp's runtime clears it and leaves on its own, saying why (its orphan watch). Linux only;
    elsewhere nothing is done."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def set_title(title: str) -> None:
    """What ``ps`` and ``/proc/<pid>/cmdline`` show for this process (a forked worker shows its server's
    command line otherwise). Its environment stays readable in ``/proc/<pid>/environ`` (``SPT_NOENV``: the
    title is cut to the original command line's length instead)."""
    os.environ.setdefault("SPT_NOENV", "1")
    from setproctitle import setproctitle

    setproctitle(title)


def _say(line: str) -> None:
    print(f"hp worker: {line}", file=sys.stderr, flush=True)


def defer_sigterm_to_agent(env: Mapping[str, str] = os.environ, say: Callable[[str], None] = _say) -> bool:
    """Leave SIGTERM from anyone but the agent to the agent (see the module docstring). Call from the main
    thread; returns whether it was installed (no agent pid in ``env``, or no ``sigwaitinfo``: not)."""
    pid = env.get(AGENT_PID_ENV, "")
    if not pid.isdigit() or not hasattr(signal, "sigwaitinfo") or threading.current_thread() is not threading.main_thread():
        return False
    agent = int(pid)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    others = len(os.listdir("/proc/self/task")) - 1 if os.path.isdir("/proc/self/task") else 0
    if others:
        say(f"{others} thread(s) started before SIGTERM was left to the agent: one of them may still take it")
    threading.Thread(target=_wait, args=(agent, say), name="hp-sigterm", daemon=True).start()
    return True


def _wait(agent: int, say: Callable[[str], None]) -> None:
    told = False
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == agent or not pid_alive(agent):
            # delivered again to this thread alone: the default action ends the process, as before; a
            # handler the script installed runs (in the main thread) as it would have
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            continue
        if not told:
            say(f"SIGTERM from pid {info.si_pid} left to the agent (pid {agent}): this rank leaves when the "
                f"job's next generation says so")
            told = True

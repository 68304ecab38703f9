"""This node leaving the job before it ends: an elastic leave at a step boundary (a SIGTERM is a
preemption notice), a preempted job whose ranks save their last committed step, and telling the
controller that this node's part is done."""

from __future__ import annotations

import signal
import time

from hp.core.agent.link import Fenced, JobFailed, Link
from hp.core.agent.messages import say
from hp.core.agent.pool import Pool
from hp.core.config import RunConfig
from hp.core.control_plane import ControlClient
from hp.core.protocol import EXIT_PREEMPTED, FailureAction, Verb


class Departure:
    def __init__(self, config: RunConfig, link: Link, pool: Pool) -> None:
        self.cfg = config
        self.link = link
        self.pool = pool
        self.done_reported = False  # NODE_DONE was answered: this node's ranks finished (or saved)

    def report_done(self, client: ControlClient) -> dict:
        """Tell the controller this node's ranks are done; its answer says the job's state."""
        done = self.link.call(client, Verb.NODE_DONE, {}, fenced=True)
        self.done_reported = True
        return done

    def leave(self, sig: signal.Signals) -> int | None:
        """Elastic: a SIGTERM is a preemption. Ask the controller to let this node's ranks leave at the next
        step boundary and wait (at most the grace period) for them to exit: 0 once they did, or once those
        still running at its end are killed (the job goes on without them). Where the job cannot go on without
        this node (below the policy's minimum, or it hosts the controller) the job is preempted: its ranks save
        their last committed step and exit (:meth:`preempted`). None: stop as a fixed-size job does (the
        controller could not be asked, or refused)."""
        deadline = time.monotonic() + self.cfg.elastic.grace_period_s
        try:
            answer = self.link.tell(Verb.NODE_LEAVING,
                                    {"signal": sig.name, "hosts_controller": self.link.hosts_controller})
        except (JobFailed, Fenced) as e:
            say(f"{sig.name}: could not leave gracefully ({e})")
            return None
        if answer.get("action") == FailureAction.SAVE:
            return self.preempted(self.link.client, deadline)
        if answer.get("action") != FailureAction.LEAVE:
            say(f"{sig.name}: the job cannot shrink without this node ({answer.get('reason')}); stopping")
            return None
        self.pool.leave(answer.get("spares", []))
        say(f"{sig.name}: this node's ranks leave the job at the next step boundary (generation "
            f"{answer['generation']}, {answer['world_size']} ranks stay; grace {self.cfg.elastic.grace_period_s:g} s)")
        while time.monotonic() < deadline:
            if self.pool.workers_exited():
                say("left the job gracefully")
                return 0
            time.sleep(self.cfg.fault_tolerance.monitor_interval_s)
        # the job already goes on without this node (the controller made the generation without it): what is
        # left here is a process still exiting, or a rank that never reached the boundary (the others replay
        # that step). Telling the controller this node stopped would fail a job this node has left.
        say(f"grace period of {self.cfg.elastic.grace_period_s:g} s over: killing this node's processes still running; "
            f"the job goes on without them")
        self.pool.stop(signal.SIGKILL)
        return 0

    def preempted(self, client: ControlClient, deadline: float) -> int:
        """The job is preempted (``JobState.PREEMPTED``): this node's ranks abandon their step, save the last
        committed one and exit by themselves. Wait for them until ``deadline`` (the grace period); the node
        hosting the controller (and the store the ranks save through) then waits for every other node's.
        Ranks still running at the deadline are killed: a restart resumes from the newest complete
        checkpoint, an older one."""
        say(f"the job is preempted: its ranks save their last committed step, then stop "
            f"({max(deadline - time.monotonic(), 0):.0f} s of grace left)")
        while time.monotonic() < deadline:
            if self.pool.workers_exited():
                try:
                    if not self.done_reported:
                        self.report_done(client)
                    finished = not self.link.hosts_controller or self.link.call(client, Verb.HEARTBEAT, {}).get(
                        "finished")
                except (JobFailed, Fenced) as e:  # this node's part is done; the controller's answer only informs
                    say(f"preempted: the controller could not be told this node's ranks saved ({e})")
                    return EXIT_PREEMPTED
                if finished:
                    say("the job's ranks saved their last committed step and stopped (preempted)")
                    return EXIT_PREEMPTED
            time.sleep(self.cfg.fault_tolerance.monitor_interval_s)
        say("grace period over before every rank saved: stopping; a restart resumes from the newest complete checkpoint")
        return EXIT_PREEMPTED

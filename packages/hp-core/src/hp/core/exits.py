"""Why a process of this node that exited 0 ended: it finished the job's loop, or it was scaled out.

Elastic, both look the same to the agent (exit status 0), and only the controller's membership tells
them apart: a rank still counted after it exited finished; one no longer counted was scaled out, and
its slot gets a new process the job can grow back into. The membership the agent holds comes from
its last heartbeat, so it can predate the exit: a grow that gave a waiting process a rank on the
job's last steps, then saw it finish, would look like a scale-out (the agent replaced it with a
joiner that waited forever, and the node never reported done); a scale-out would look like a
finished rank. So a verdict is given only on a membership read that was *asked for after* the exit
was seen. Pure: times are passed in (``time.monotonic()`` in the agent), so tests drive it directly.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Verdict(enum.Enum):
    PENDING = "pending"  # no membership read asked for since the exit: ask (a heartbeat) before deciding
    FINISHED = "finished"  # still a member after it exited: its part of the job is done
    SCALED_OUT = "scaled_out"  # no longer a member: its slot waits for the job to grow back


@dataclass
class CleanExits:
    elastic: bool  # a fixed-size job scales nobody out: a clean exit is a finished rank
    _seen: dict[str, float] = field(default_factory=dict)  # holder -> when its exit 0 was seen
    _members: frozenset[str] = frozenset()  # holders of this node's ranks, by the last read
    _asked: float = float("-inf")  # when that read was asked for

    def exited(self, holder: str, at: float) -> bool:
        """``holder``'s process was seen to exit 0 at ``at``; returns whether a membership read is needed
        (elastic: send the heartbeat now rather than at its interval)."""
        self._seen.setdefault(holder, at)
        return self.elastic

    def heard(self, members: set[str] | frozenset[str], asked_at: float) -> None:
        """The controller counted ``members`` among this node's ranks, answering a request sent at ``asked_at``."""
        if asked_at >= self._asked:
            self._members, self._asked = frozenset(members), asked_at

    def verdict(self, holder: str) -> Verdict:
        """What ``holder``'s exit 0 means (it must have been reported through :meth:`exited`)."""
        if not self.elastic:
            return Verdict.FINISHED
        if self._seen.get(holder, float("inf")) >= self._asked:
            return Verdict.PENDING
        return Verdict.FINISHED if holder in self._members else Verdict.SCALED_OUT

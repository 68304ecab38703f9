"""A scenario's job ended at a step decided at run time (``job.finish_after``).

How many steps an event-driven job (an elastic one: a node joining, a kill during a grow, a
preemption) needs for its events depends on the machine's load, so its ``job.steps`` is only the most
it may run. Once every fault has fired, the run has gone through ``expect.world_sizes`` and it has
committed ``finish_after`` steps at its last size, the runner asks the job to end: ``hp finish`` to the
controller, which every rank learns in the same commit vote, so every rank ends after the same step.
The fault-free reference then runs to that step (:func:`hp.chaos.runner.run_scenario`).
"""

from __future__ import annotations

from collections.abc import Callable

from hp.chaos.faults.base import Action, FaultSpec, LiveJob
from hp.core.protocol import Event


class FinishAfter(Action):
    """Fires once ``faults`` have all fired, the world sizes by step went through ``world_sizes``, and
    ``after`` steps were committed at the last of them; then asks the job to finish."""

    def __init__(self, faults: list[FaultSpec], world_sizes: list[int], after: int) -> None:
        self.faults, self.world_sizes, self.after = faults, world_sizes, after
        self._seen = -2  # rank 0's newest commit when last looked at: nothing new, nothing to look at

    def ready(self, job: LiveJob) -> bool:
        if job.committed() == self._seen:
            return False
        self._seen = job.committed()
        events = job.events()
        injected = [e for e in events if e["event"] == Event.FAULT_INJECTED]
        if not all(any(f.injected_by(e) for e in injected) for f in self.faults):
            return False
        from hp.elastic.demo.run import events_went_through

        return events_went_through(events, self.world_sizes, self.after)

    def fire(self, job: LiveJob) -> Callable[[], None] | None:
        job.finish(f"the run went through world sizes {self.world_sizes} and {self.after} steps at the last")
        return None

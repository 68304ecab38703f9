"""FaultPlan: a planned fault targets a rank, whoever holds it at its step, and fires once in the job
(claimed in the job's store), so the replay of the step it failed runs clean in whichever process."""

from __future__ import annotations

import json

import pytest

from hp.checkpointless.faults import Fault, FaultPlan, InjectedFault


class Store:
    """The job's store as the runtime uses it for claims: an atomic add, shared by every process."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def claim(self, key: str) -> bool:
        self.counts[key] = self.counts.get(key, 0) + 1
        return self.counts[key] == 1


def plan(store: Store, *faults: dict) -> FaultPlan:
    return FaultPlan.from_env(store.claim, {"HP_FAULTS": json.dumps(list(faults))})


def test_a_fault_fires_once_in_the_job_whoever_holds_the_rank():
    store = Store()
    exception = {"at_step": 3, "phase": "forward", "kind": "exception", "rank": 1}
    original, replacement = plan(store, exception), plan(store, exception)  # two processes, one job
    recorded = []
    original.fire(2, "forward", 1, recorded.append)  # not its step
    original.fire(3, "backward", 1, recorded.append)  # not its phase
    original.fire(3, "forward", 0, recorded.append)  # not its rank
    with pytest.raises(InjectedFault, match="step 3 \\(forward\\) on rank 1"):
        original.fire(3, "forward", 1, recorded.append)
    original.fire(3, "forward", 1, recorded.append)  # this process's replay of step 3
    replacement.fire(3, "forward", 1, recorded.append)  # a spare's (or a renumbered process's) replay
    assert [f.at_step for f in recorded] == [3]


def test_a_later_fault_of_the_rank_fires_in_the_process_that_holds_it_by_then():
    """What "the replacement dies too" needs: a second fault of rank 1 fires in the spare that took it."""
    store = Store()
    faults = ({"at_step": 3, "phase": "forward", "kind": "exception", "rank": 1},
              {"at_step": 7, "phase": "commit", "kind": "exception", "rank": 1})
    original, spare = plan(store, *faults), plan(store, *faults)
    with pytest.raises(InjectedFault):
        original.fire(3, "forward", 1, lambda f: None)
    spare.fire(3, "forward", 1, lambda f: None)  # the replay: clean
    with pytest.raises(InjectedFault, match="step 7 \\(commit\\)"):
        spare.fire(7, "commit", 1, lambda f: None)


def test_a_slow_fault_slows_every_step_of_its_window_once_and_is_recorded_once(monkeypatch):
    slept, recorded = [], []
    monkeypatch.setattr("hp.checkpointless.faults.time.sleep", slept.append)
    store = Store()
    slow = plan(store, {"at_step": 4, "phase": "allreduce", "kind": "slow", "rank": 2, "delay_s": 0.5, "steps": 3})
    for step in (3, 4, 4, 5, 6, 7):
        slow.fire(step, "allreduce", 2, recorded.append)
    plan(store, {"at_step": 4, "phase": "allreduce", "kind": "slow", "rank": 2, "delay_s": 0.5, "steps": 3}).fire(
        5, "allreduce", 2, recorded.append)  # another process replaying step 5: already slowed once
    assert slept == [0.5, 0.5, 0.5] and len(recorded) == 1


@pytest.mark.parametrize("raw, message", [
    ({"at_step": 1, "kind": "kill"}, "bad fault"),
    ({"at_step": 1, "kind": "melt", "rank": 0}, "kind one of"),
    ({"at_step": 1, "kind": "kill", "rank": 0, "phase": "lunch"}, "phase must be one of"),
    ({"at_step": 1, "kind": "slow", "rank": 0, "delay_s": -1}, "delay_s must be >= 0"),
])
def test_a_bad_plan_is_a_one_line_error(raw, message):
    with pytest.raises(ValueError, match=message) as e:
        Fault.parse(raw)
    assert "\n" not in str(e.value)

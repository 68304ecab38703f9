"""The recovery state machine driven directly, without processes (like hp.core.controller's tests)."""

from __future__ import annotations

import threading

import pytest

from hp.checkpointless.recovery import TRANSITIONS, RankState, RecoveryMachine

S = RankState


def running(generation: int = 1) -> RecoveryMachine:
    m = RecoveryMachine()
    m.forming(generation)
    m.to(S.COMPUTING)
    return m


def test_every_state_has_its_transitions_written_down_and_can_close():
    assert set(TRANSITIONS) == set(RankState)
    assert all(S.CLOSED in targets for targets in TRANSITIONS.values())
    assert TRANSITIONS[S.CLOSED] == {S.CLOSED}


@pytest.mark.parametrize("start, illegal", [
    (S.IDLE, S.COMPUTING),  # no step before a group is formed
    (S.COMPUTING, S.FINISHING),  # no commit tail without the vote's collectives
    (S.COMMITTING, S.COMPUTING),  # no new step before the vote
    (S.RECOVERING, S.COMPUTING),  # no step before re-forming
    (S.CLOSED, S.FORMING),
])
def test_illegal_transitions_raise(start, illegal):
    m = RecoveryMachine()
    m.state = start
    with pytest.raises(RuntimeError, match=f"illegal recovery transition {start.value} -> {illegal.value}"):
        m.to(illegal)


def test_a_step_goes_compute_commit_finish_and_on_to_the_next():
    m = running()
    for _ in range(3):
        m.to(S.COMMITTING)
        assert m.superseded() is None
        m.to(S.FINISHING)
        m.to(S.COMPUTING)
    assert m.generation == 1


def test_a_newer_generation_interrupts_a_computing_step_once():
    m = running(generation=3)
    assert m.observe(3) is False  # its own generation
    assert m.observe(4) is True  # signal the main thread
    assert m.observe(4) is False  # once per generation, not per poll
    assert m.superseded() == "generation 3 superseded by 4"
    assert m.take_interrupt() is True and m.state is S.RECOVERING
    assert m.take_interrupt() is False  # a second signal during recovery raises nothing
    assert m.observe(5) is False  # recovering: nothing to interrupt


@pytest.mark.parametrize("state", [S.COMMITTING, S.FINISHING, S.FORMING, S.IDLE])
def test_hp_collectives_and_the_commit_tail_are_never_interrupted(state):
    m = running(generation=2)
    m.state = state
    assert m.observe(3) is False
    assert m.take_interrupt() is False and m.state is state
    # but no new collective starts on the dead group: the step fails at its next collective instead
    assert m.superseded() == "generation 2 superseded by 3"


def test_the_generation_seen_never_goes_back():
    m = running(generation=2)
    m.observe(5)
    m.observe(3)  # a late read of an older value
    assert m.latest == 5


@pytest.mark.parametrize("state, in_step, report, replay", [
    (S.COMPUTING, True, "exception", True),  # the user's step raised: this rank's own failure
    (S.COMPUTING, False, None, True),  # a collective failed or an interrupt: the dead peer's agent reports
    (S.COMMITTING, False, None, True),  # before the vote completed: replay
    (S.FINISHING, False, None, False),  # after the vote (shard replication failed): the step stands
])
def test_failure_decisions(state, in_step, report, replay):
    m = running()
    m.state = state
    failure = m.failed(in_step=in_step)
    assert (failure.report, failure.replay, failure.in_step) == (report, replay, in_step)
    assert m.state is S.RECOVERING


def test_an_interrupted_step_is_replayed_and_recovery_re_forms_the_next_generation():
    m = running(generation=1)
    m.observe(2)
    assert m.take_interrupt()
    assert m.failed(in_step=False).replay is True
    m.forming(2)
    assert (m.state, m.generation, m.superseded()) == (S.FORMING, 2, None)
    m.to(S.COMPUTING)


def test_a_re_form_that_fails_moves_on_to_the_next_generation():
    m = RecoveryMachine()
    m.forming(1)
    m.failed(in_step=False)
    m.forming(2)
    m.forming(2)  # forming again the same generation is allowed (no double transition)
    assert (m.state, m.generation) == (S.FORMING, 2)


def test_observe_from_another_thread_while_the_main_thread_steps():
    """The watch thread's only call is observe(): it never moves the machine, the main thread does."""
    m = running(generation=1)
    signals = []
    watcher = threading.Thread(target=lambda: signals.extend(m.observe(2) for _ in range(200)))
    watcher.start()
    watcher.join()
    assert signals.count(True) == 1 and m.state is S.COMPUTING


def test_a_finishing_plan_is_remembered_whatever_the_plans_after_it_say():
    m = RecoveryMachine()
    assert m.finishing is False
    m.observe(2, at_boundary=True, finishing=True)
    m.observe(3)  # a recovery generation after it: the job still ends
    assert m.finishing is True

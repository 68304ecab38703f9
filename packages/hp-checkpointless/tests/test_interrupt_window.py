"""The watch thread's interrupt (a signal handled between two bytecodes of the main thread) raises only
inside the user's ``with step:`` block, which recovers from it. Landing in hp's own code around the
block, raising would leave the user's loop and end the rank: it waits for the step's next check point.
Driven with the real handler (``Context._interrupt``) and the real ``Step``/``Context.steps`` code."""

from __future__ import annotations

import sys

import pytest
from hp.checkpointless.recovery import CollectiveError, RankState, RecoveryMachine
from hp.checkpointless.runtime import Context, Step, at_block_edge


class Stop(Exception):
    pass


class Probe:
    """Stands in for a Context whose step computes for generation 1 while the watch thread has seen 2."""

    _interrupt = Context._interrupt
    _check_interrupt = Context._check_interrupt

    def __init__(self) -> None:
        self._machine = RecoveryMachine()
        self._machine.forming(1)
        self._machine.to(RankState.COMPUTING)
        assert self._machine.observe(2)
        self.raised: list[str] = []
        self._in_block = False
        # what Context.steps() reads before its first step
        self._training, self._tx, self._start_generation = object(), None, 1
        self._formation = self

    def signal_here(self) -> None:
        """The handler runs in the caller's frame, as if the signal arrived there."""
        try:
            self._interrupt(0, sys._getframe(1))
        except CollectiveError as exc:
            self.raised.append(str(exc))

    _enter_step = Context._enter_step

    def _end_step(self, step: Step, exc: BaseException | None) -> bool:  # called by Step.__exit__
        self.signal_here()  # as if the signal came before Context._end_step left the block
        self._in_block = False
        return True

    def join(self, *_args) -> None:  # Formation.join, called by Context.steps()
        self.signal_here()
        raise Stop


def users_code(probe: Probe) -> None:
    probe.signal_here()


def test_the_users_step_is_interrupted_once():
    probe = Probe()
    with Step(3, probe):
        users_code(probe)
        users_code(probe)
    assert probe.raised == ["generation 1 superseded by 2 during the step"]
    assert probe._machine.state is RankState.RECOVERING


def test_the_users_code_before_or_after_the_block_is_not_interrupted():
    probe = Probe()
    users_code(probe)  # `for step in ctx.steps(n):` then code before `with step:`
    with Step(3, probe):
        pass
    users_code(probe)  # after the block (its __exit__ left the step to the next check point)
    assert probe.raised == [] and probe._machine.state is RankState.COMPUTING


def test_inside_step_exit_the_interrupt_waits_for_the_next_check_point():
    probe = Probe()
    with Step(3, probe):
        raise ValueError("the user's step failed")  # __exit__ recovers it; a raise there would escape
    assert probe.raised == [] and probe._machine.state is RankState.COMPUTING


def test_the_next_check_point_takes_an_interrupt_left_pending():
    probe = Probe()
    Step(3, probe).__exit__(None, None, None)
    with pytest.raises(CollectiveError, match="superseded by 2 at a collective"):
        probe._check_interrupt("at a collective")
    probe._check_interrupt("at a gradient")  # once per step
    assert probe._machine.state is RankState.RECOVERING


def test_inside_the_steps_generator_nothing_is_raised():
    probe = Probe()
    with pytest.raises(Stop):
        next(Context.steps(probe, 5))
    assert probe.raised == [] and probe._machine.state is RankState.COMPUTING
    with Step(0, probe):
        users_code(probe)
    assert len(probe.raised) == 1


def test_the_frame_walk_sees_callers_not_just_the_current_frame():
    assert at_block_edge(None) is False
    assert at_block_edge(sys._getframe()) is False

"""The watch thread's interrupt (a signal handled between two bytecodes of the main thread) raises only
inside the user's ``with step:`` block, which recovers from it. Landing in hp's own code around the
block, raising would leave the user's loop and end the rank: it waits for the step's next check point.
Driven with the real handler (:meth:`Interrupt.handle`) and the real ``Step``/``StepLoop`` code."""

from __future__ import annotations

import sys

import pytest
from hp.checkpointless.hooks import Attempt
from hp.checkpointless.interrupt import Interrupt
from hp.checkpointless.recovery import CollectiveError, RankState, RecoveryMachine
from hp.checkpointless.runtime import Step, at_block_edge
from hp.checkpointless.steps import BLOCK_EDGES, StepLoop


class Stop(Exception):
    pass


class Probe:
    """A step that computes for generation 1 while the watch thread has seen 2, and the parts of a
    Context its step loop talks to: the wiring's formation (``join``) and the recovery path (``recover``)."""

    def __init__(self) -> None:
        self.machine = RecoveryMachine()
        self.machine.forming(1)
        self.machine.to(RankState.COMPUTING)
        assert self.machine.observe(2)
        self.interrupt = Interrupt(self.machine, BLOCK_EDGES)
        self.raised: list[str] = []
        self.recovered: list[str] = []
        self.formation = self
        self.loop = Loop(self, object(), None, self.interrupt, None, self, Attempt(), close=lambda: None)

    def signal_here(self) -> None:
        """The handler runs in the caller's frame, as if the signal arrived there."""
        try:
            self.interrupt.handle(0, sys._getframe(1))
        except CollectiveError as exc:
            self.raised.append(str(exc))

    def join(self, *_args) -> None:  # Formation.join, called by StepLoop.steps()
        self.signal_here()
        raise Stop

    def recover(self, step: int, exc: Exception) -> None:  # Recovery.recover, called by StepLoop.exit
        self.recovered.append(f"{type(exc).__name__}: {exc}")


class Loop(StepLoop):
    def exit(self, step: Step, exc: BaseException | None) -> bool:  # called by Step.__exit__
        self._wiring.signal_here()  # as if the signal came before StepLoop.exit left the block
        return super().exit(step, exc)


def users_code(probe: Probe) -> None:
    probe.signal_here()


def test_the_users_step_is_interrupted_once():
    probe = Probe()
    with Step(3, probe.loop):
        users_code(probe)
        users_code(probe)
    assert probe.raised == ["generation 1 superseded by 2 during the step"]
    assert probe.machine.state is RankState.RECOVERING


def test_the_users_code_before_or_after_the_block_is_not_interrupted():
    probe = Probe()
    users_code(probe)  # `for step in ctx.steps(n):` then code before `with step:`
    with Step(3, probe.loop):
        pass
    users_code(probe)  # after the block (its __exit__ left the step to the next check point)
    assert probe.raised == [] and probe.machine.state is RankState.COMPUTING


def test_inside_step_exit_the_interrupt_waits_for_the_next_check_point():
    probe = Probe()
    with Step(3, probe.loop):
        raise ValueError("the user's step failed")  # __exit__ recovers it; a raise there would escape
    assert probe.raised == [] and probe.machine.state is RankState.COMPUTING
    assert probe.recovered == ["ValueError: the user's step failed"]


def test_the_next_check_point_takes_an_interrupt_left_pending():
    probe = Probe()
    Step(3, probe.loop).__exit__(None, None, None)
    with pytest.raises(CollectiveError, match="superseded by 2 at a collective"):
        probe.interrupt.check("at a collective")
    probe.interrupt.check("at a gradient")  # once per step
    assert probe.machine.state is RankState.RECOVERING


def test_inside_the_steps_generator_nothing_is_raised():
    probe = Probe()
    with pytest.raises(Stop):
        next(probe.loop.steps(5, 1))
    assert probe.raised == [] and probe.machine.state is RankState.COMPUTING
    with Step(0, probe.loop):
        users_code(probe)
    assert len(probe.raised) == 1


def test_the_frame_walk_sees_callers_not_just_the_current_frame():
    assert at_block_edge(None) is False
    assert at_block_edge(sys._getframe()) is False
    seen: list[bool] = []

    class Edges(StepLoop):
        def __init__(self) -> None:
            pass

        def enter(self, step: Step) -> None:  # called by Step.__enter__: inside the edge
            seen.append(at_block_edge(sys._getframe()))

        def exit(self, step: Step, exc: BaseException | None) -> bool:
            seen.append(at_block_edge(sys._getframe()))
            return False

    with Step(0, Edges()):
        seen.append(at_block_edge(sys._getframe()))  # the user's block itself is no edge
    assert seen == [True, False, True]

"""The doomed-step interrupt: a step whose generation is already dead stops now, not at its next collective.

Without it, a peer that died at the start of a step is noticed only at the step's all-reduce, a whole
step later. The watch thread sees the newer generation (:meth:`Interrupt.on_generation`) and signals
the main thread; the handler runs there between two Python bytecodes (torch ops run to the end) and
raises :class:`~hp.checkpointless.recovery.CollectiveError` only inside the user's ``with step:`` block,
which is what recovers from it. Anywhere else the interrupt stays pending in the
:class:`~hp.checkpointless.recovery.RecoveryMachine` until the step's next check point
(:meth:`Interrupt.check`: a collective, a gradient, a micro-batch, ``ctx.reduce``) takes it, at most
once a step. A context made off the main thread cannot take signals: there only the check points stop a step.
"""

from __future__ import annotations

import signal
import threading
from types import CodeType, FrameType
from typing import Any

from hp.checkpointless.recovery import CollectiveError, RecoveryMachine
from hp.core.protocol import Plan

# Sent by the watch thread to the main thread to stop a step whose group is already dead. SIGUSR2,
# not SIGUSR1, which Slurm and Lightning use for requeue notices.
INTERRUPT_SIGNAL = signal.SIGUSR2


class Interrupt:
    """``block_edges``: the code of the ``with step:`` block's ``__enter__`` and ``__exit__``
    (:data:`hp.checkpointless.steps.BLOCK_EDGES`), where ``in_block`` does not yet (or still) say
    where the main thread is."""

    def __init__(self, machine: RecoveryMachine, block_edges: frozenset[CodeType]) -> None:
        self._machine, self._edges = machine, block_edges
        self.in_block = False  # the main thread is inside a `with step:` block (between __enter__ and __exit__)
        self.can_signal = threading.current_thread() is threading.main_thread()

    def install(self) -> None:
        """Handle :data:`INTERRUPT_SIGNAL` (main thread only: elsewhere signals cannot be handled)."""
        if self.can_signal:
            signal.signal(INTERRUPT_SIGNAL, self.handle)

    def on_generation(self, plan: Plan) -> None:
        """Watch thread: a newer generation means this rank's group is dead; stop a step that computes
        for nothing. A planned one (grow, preemption) waits for a step boundary."""
        if self._machine.observe(plan.generation, plan.at_boundary, plan.finishing) and self.can_signal:
            signal.pthread_kill(threading.main_thread().ident, INTERRUPT_SIGNAL)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """Main thread, between two Python bytecodes. Raises only inside the user's ``with step:`` block: a
        signal that lands outside it (the ``ctx.steps()`` generator preparing a step,
        ``Step.__enter__``/``__exit__``, the user's own code before or after the block) is left to the
        step's next check point; raised there, it would leave the user's loop and end the rank (seen: an
        HSDP rank interrupted while ``ctx.steps()`` cleared its gradients)."""
        if self.in_block and not at_block_edge(frame, self._edges):
            self.check("during the step")

    def check(self, where: str) -> None:
        """A check point inside the user's step: stop it if its generation is dead (at most once a step)."""
        if self._machine.take_interrupt():
            raise CollectiveError(f"{self._machine.superseded()} {where}")


def at_block_edge(frame: Any, edges: frozenset[CodeType]) -> bool:
    """Whether ``frame`` (where a signal handler runs), or a frame that called it, runs one of ``edges``."""
    while frame is not None:
        if frame.f_code in edges:
            return True
        frame = frame.f_back
    return False

"""The callbacks between hp and the user's code, both ways.

hp inside the user's step: autograd hooks on the registered parameters (an FSDP model's forward
output), and the device mesh's hook before each of its collectives. They are where a doomed step
stops (:mod:`hp.checkpointless.interrupt`: ``backward()`` is one call into C++ that takes most of a
step), where the "backward" and "allreduce" fault phases fire, and where an overlapping reduction
starts a bucket. The user's code inside hp: ``on_scale(old_world, new_world)`` after a formation whose
world size differs from the one the state is for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from hp.checkpointless.interrupt import Interrupt
from hp.checkpointless.recovery import RankState
from hp.checkpointless.registry import TrainingState
from hp.checkpointless.transaction import StepTransaction
from hp.checkpointless.wiring import Wiring
from hp.core.devices import pin_to_core

# the mesh collectives that reduce gradients (FSDP: reduce-scatter; HSDP also all-reduces)
REDUCTIONS = frozenset({"reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
                        "reduce_scatter_single", "reduce_scatter_single_coalesced", "allreduce"})


class Attempt:
    """The step in progress, as the step loop runs it and the hooks inside it see it."""

    def __init__(self) -> None:
        self.step: int | None = None  # the last step begun (None before the first)
        self.done = False  # committed, or recovered (ctx.steps() yields it again): the loop may go on
        self.owned: list[int] = []  # the micro-batches this rank computes in it
        self.samples = 0  # samples it consumes (all ranks), when split in micro-batches
        self.reduction_fired = False  # its "allreduce" fault phase fired (FSDP: at its first reduce-scatter)


class Hooks:
    def __init__(self, wiring: Wiring, interrupt: Interrupt, attempt: Attempt) -> None:
        self._wiring, self._interrupt, self._attempt = wiring, interrupt, attempt
        self._tx: StepTransaction | None = None
        self._on_scale: Callable[[int, int], None] | None = None

    def attach(self, st: TrainingState, tx: StepTransaction, on_scale: Callable[[int, int], None] | None) -> None:
        """``ctx.register``: hook the registered model's backward; the user's ``on_scale``."""
        self._tx, self._on_scale = tx, on_scale
        if st.fsdp is not None:  # gradients land on the sharded parameters without hooks: backward starts here
            st.model.register_forward_hook(self.on_output)
            return
        if st.params:  # the "backward" fault phase fires while the first parameter's gradient is accumulated
            st.params[0].register_post_accumulate_grad_hook(self.on_backward)
        for i, p in enumerate(st.params):
            p.register_post_accumulate_grad_hook(functools.partial(self.on_gradient, index=i))

    def _computing(self) -> bool:
        return self._attempt.step is not None and self._wiring.machine.state is RankState.COMPUTING

    def on_output(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        """An FSDP model's forward returned ``output``: the gradient reaching it starts backward (the
        "backward" fault phase), the way FSDP's own pre-backward hook is placed."""
        for t in (output if isinstance(output, (tuple, list)) else (output,)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad: self.on_backward(None))
                return

    def on_backward(self, _param: torch.Tensor | None) -> None:
        if self._computing():
            self._wiring.phase(self._attempt.step, "backward")

    def on_gradient(self, _param: torch.Tensor, index: int) -> None:
        """Each accumulated gradient is a point where a step whose group already died stops.
        ``backward()`` is one call into C++ that takes most of a step, and the watch thread's interrupt
        is raised only between Python bytecodes: without these points a survivor that is in backward
        when a peer dies finishes it first (measured: 1.75 s of a 25 M-param model's recovery). It is
        also where an overlapping reduction starts a bucket (:meth:`StepTransaction.gradient_ready`)."""
        self._interrupt.check("during backward")
        if self._computing():
            self._tx.gradient_ready(index)

    def before_collective(self, op: str) -> None:
        """Every collective on the device mesh (FSDP's all-gathers and reductions, DTensor's): a step
        whose generation is dead stops here, and the step's gradient reduction starts at its first
        reduce-scatter (the "allreduce" fault phase)."""
        self._interrupt.check("during the step")
        if not self._attempt.reduction_fired and op in REDUCTIONS and self._computing():
            self._attempt.reduction_fired = True
            self._wiring.phase(self._attempt.step, "allreduce")

    def formed(self, st: TrainingState) -> None:
        """After every formation: state for another world size than the group's is the user's to adapt
        (``on_scale``), on every rank alike: a survivor's, a joiner's hydrated from a survivor, a job's
        restored from a checkpoint taken at another size. A rank pins itself to its core here when
        ``HP_PIN_CORES=1`` (benchmarks: a promoted spare takes the dead rank's core)."""
        rank = self._wiring.formation.rank
        if rank >= 0:  # a process left out of the new group (a joiner not taken) has none
            pin_to_core(rank)
        new_world = self._wiring.link.world_size
        if st.world and st.world != new_world and self._on_scale is not None:
            self._on_scale(st.world, new_world)
        st.world = new_world

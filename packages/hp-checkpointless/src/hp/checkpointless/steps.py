"""The step loop: each step a restart block (``with step:``), sequenced through the step transaction.

A step is a transaction (:mod:`hp.checkpointless.transaction`): forward/backward (user code) →
gradient reduction → (clipping, AMP unscale) → commit vote → local optimizer step. This module runs
the steps in order, moves the :class:`~hp.checkpointless.recovery.RecoveryMachine` through them, fires
each step's fault phases, and hands a failed step to the recovery path (:mod:`hp.checkpointless.recover`),
after which the same step (same index, so the same batch) is yielded again. What the last vote said
(re-form at this boundary, or finish) is acted on before the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from hp.checkpointless import ladder
from hp.checkpointless.hooks import Attempt, Hooks
from hp.checkpointless.interrupt import Interrupt, at_block_edge as _at_edge
from hp.checkpointless.microbatch import micro_batch_seed
from hp.checkpointless.recover import Recovery
from hp.checkpointless.recovery import CollectiveError, JobEnded, RankState
from hp.checkpointless.registry import TrainingState
from hp.checkpointless.sampler import StepLoader
from hp.checkpointless.transaction import StepTransaction
from hp.checkpointless.wiring import Wiring
from hp.core.errors import UsageError
from hp.core.protocol import FINISHED_KEY, Event


class Step(int):
    """A step index that is also the restart block of that step: ``with step: ...``."""

    _loop: StepLoop

    def __new__(cls, value: int, loop: StepLoop) -> Step:
        self = super().__new__(cls, value)
        self._loop = loop
        return self

    def __enter__(self) -> Step:
        self._loop.enter(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return self._loop.exit(self, exc)

    def micro_batches(self, loader: StepLoader) -> Iterator[Any]:
        """This rank's micro-batches of the step at the current world size (constant global batch).

        Run forward and ``backward()`` on each (do not divide the loss: hp divides the summed gradients
        by the step's micro-batch count) and pass the losses, one per micro-batch in order, to
        ``ctx.commit``. Before each micro-batch torch's global RNG is seeded from (seed, step,
        micro-batch), so dropout draws the same masks whichever rank computes it."""
        return self._loop.micro_batches(self, loader)


# the edges of a `with step:` block, where the interrupt's `in_block` does not yet (or still) say where
# the main thread is (hp.checkpointless.interrupt)
BLOCK_EDGES = frozenset({Step.__enter__.__code__, Step.__exit__.__code__})


def at_block_edge(frame: Any) -> bool:
    """Whether ``frame`` (where a signal handler runs) is in ``Step.__enter__`` or ``Step.__exit__``, or
    code they called."""
    return _at_edge(frame, BLOCK_EDGES)


class StepLoop:
    """``ctx.steps()`` and what the user calls inside a step; ``attempt``: the step in progress, shared
    with the hooks; ``close``: leaves the job when the loop ends, however it ends."""

    def __init__(self, wiring: Wiring, st: TrainingState, tx: StepTransaction, interrupt: Interrupt,
                 hooks: Hooks, recovery: Recovery, attempt: Attempt, close: Callable[[], None]) -> None:
        self._wiring, self._st, self._tx, self._interrupt = wiring, st, tx, interrupt
        self._hooks, self._recovery, self._attempt, self._close = hooks, recovery, attempt, close
        self.last_loss: float | None = None
        self._reform_due = False  # the last vote said: re-form (a planned generation) before the next step
        self._finish_due = False  # the last vote said: the job ends after this step (hp finish)
        self._size_published = False

    def steps(self, total: int, start_generation: int) -> Iterator[Step]:
        w, st, a = self._wiring, self._st, self._attempt
        w.formation.join(st, self._tx, start_generation)
        self._hooks.formed(st)
        try:
            while st.committed + 1 < total and not self._finish_due:
                if self._reform_due:
                    self._reform_due = False
                    self._recovery.rescale()
                step = a.step = Step(st.committed + 1, self)
                a.done = False
                w.machine.to(RankState.COMPUTING)
                self._tx.begin()
                a.samples = 0
                a.reduction_fired = False
                try:
                    w.phase(step, "forward")
                except Exception as exc:  # an injected fault: the step failed before the user's code ran
                    self._recovery.recover(step, exc)
                    continue
                yield step
                if not a.done:
                    raise UsageError("each step must end with ctx.commit(loss)")
            rank = w.formation.rank
            if self._finish_due:  # hp finish: every rank ends after this same step
                w.events.record(Event.FINISH_AGREED, rank=rank, step=st.committed, generation=w.machine.generation)
            w.publish(FINISHED_KEY, str(st.committed))  # releases a joiner that would wait for us forever
            w.events.record(Event.FINAL_STATE, rank=rank, step=st.committed, digests=st.digests())
        finally:
            self._close()

    def enter(self, step: Step) -> None:
        self._interrupt.in_block = True  # the watch thread's interrupt may raise from here on

    def exit(self, step: Step, exc: BaseException | None) -> bool:
        self._interrupt.in_block = False
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, (UsageError, JobEnded)):
            return False
        self._recovery.recover(step, exc)
        self._attempt.done = True  # recovered: ctx.steps() yields the step again
        return True

    def micro_batches(self, step: Step, loader: StepLoader) -> Iterator[Any]:
        w, a = self._wiring, self._attempt
        if a.step is not step or w.machine.state is not RankState.COMPUTING:
            raise UsageError("step.micro_batches(loader) is called inside `with step:`, before ctx.commit")
        sampler, world, rank = loader.sampler, w.world_size, w.formation.rank
        total = sampler.micro_batches_at(world)
        if self._st.fsdp is not None and total % world:  # FSDP reduces in each backward, on every rank
            raise UsageError(f"with an FSDP2 model every rank runs as many micro-batches as the others: "
                             f"{total} micro-batches per step do not divide among {world} ranks")
        self._tx.split(total)
        a.samples = sampler.samples_at(world)
        a.owned = sampler.owned(int(step), rank, world)
        for m, batch in zip(a.owned, loader.step(int(step), rank, world, self._st.samples)):
            self._interrupt.check("before a micro-batch")
            torch.manual_seed(micro_batch_seed(sampler.seed, int(step), m))
            yield batch
            self._tx.micro_batch_done(m)

    def reduce(self) -> None:
        w, a = self._wiring, self._attempt
        if a.step is None or w.machine.state is not RankState.COMPUTING:
            raise UsageError("ctx.reduce() is called once per step, inside `with step:`, before ctx.commit(loss)")
        self._interrupt.check("before the reduction")
        w.machine.to(RankState.COMMITTING)  # from here on a failure surfaces in a collective, never midway
        if not a.reduction_fired:
            w.phase(a.step, "allreduce")
        self._tx.reduce(int(a.step), w.world_size)

    def commit(self, loss: torch.Tensor | float | Sequence[torch.Tensor | float]) -> float:
        w, machine, st = self._wiring, self._wiring.machine, self._st
        if machine.state is RankState.COMPUTING:
            self.reduce()
        elif machine.state is not RankState.COMMITTING:
            raise UsageError("ctx.commit(loss) is called once per step, inside `with step:`")
        step, rank = int(self._attempt.step), w.formation.rank
        w.phase(step, "commit")
        slots = self._loss_slots(loss, rank)
        mean, skip, self._reform_due, self._finish_due = self._tx.vote(step, slots, w.world_size,
                                                                       machine.boundary_due(), machine.finishing)
        # committed: from here on, survivors finish the step whatever happens to peers
        machine.to(RankState.FINISHING)
        w.phase(step, "optimizer")
        self._tx.apply(step, skip)
        st.mark_committed(step)
        if st.premaps is not None:  # a step boundary: map a same-node spare's buffer before it is needed
            st.premaps.poll()
        st.samples += self._attempt.samples  # a skipped step (inf gradients) consumed its samples too
        self._attempt.done, self.last_loss = True, mean
        if skip:
            w.events.record(Event.STEP_SKIPPED, step=step, rank=rank, scale=st.scaler.get_scale())
        # loss: the global mean; local: this rank's own losses by vote slot (its rank, or its micro-batches)
        overlapped = getattr(self._tx.reduction, "overlapped", None)  # buckets started during backward
        w.events.record(Event.COMMIT, step=step, rank=rank, generation=machine.generation, loss=mean.hex(),
                        local={str(k): float(v).hex() for k, v in slots.items()}, world=w.world_size,
                        samples=st.samples, **({} if overlapped is None else {"overlapped": overlapped}))
        if not self._size_published:  # after the first commit, when lazily created optimizer state exists
            self._size_published = True
            w.formation.publish_state_size(st)
        failure = self._share_shards(rank) if st.sharded is not None else None
        if failure is not None:  # the step is committed here; only peers' copies need repair
            self._recovery.recover(self._attempt.step, failure)
        elif st.checkpoint is not None and st.checkpoint.due(step):
            ladder.save_or_warn(st, rank, step, w.events)
        return mean

    def _loss_slots(self, loss: Any, rank: int) -> dict[int, float]:
        """This rank's losses by vote slot: its micro-batches' ids in a split step, else its rank."""
        owned = self._attempt.owned
        if self._tx.micro_batches is None:
            return {rank: _number(loss)}
        if isinstance(loss, (list, tuple)):
            if len(loss) != len(owned):
                raise UsageError(f"ctx.commit got {len(loss)} losses for the {len(owned)} micro-batches "
                                 f"this rank computed")
            return {m: _number(v) for m, v in zip(owned, loss)}
        return {owned[0]: _number(loss)} if owned else {}

    def _share_shards(self, rank: int) -> CollectiveError | None:
        """Sharded optimizer, after the local update: owners broadcast their partitions, then every
        shard is copied to its buddy. Returns the failure instead of raising it, outside any frame
        of the failed collective (see group.py)."""
        collective, sharded = self._wiring.link.collective, self._st.sharded
        try:
            collective(sharded.sync_params)
            sharded.replicate(rank, collective)
        except CollectiveError as e:
            return e
        return None


def _number(value: Any) -> float:
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)

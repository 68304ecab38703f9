"""In-process recovery: the restart block around each training step, and the user's API to it.

A step is a transaction (:mod:`hp.checkpointless.transaction`): forward/backward (user code) →
gradient reduction → (clipping, AMP unscale) → commit vote → local optimizer step. A failure before
the vote rolls every survivor back to its last committed state (:mod:`hp.checkpointless.registry`)
and the step is replayed with the same batch. After re-forming the process group of a new generation
(:mod:`hp.checkpointless.formation`), ranks agree on the newest committed step and the ranks behind
it (a promoted spare, a restarted process, a rank that failed after the vote) pull the state from a
peer (:mod:`hp.checkpointless.hydration`). Survivors never re-import torch or rebuild anything.
Where a rank is in all this is the explicit state machine of :mod:`hp.checkpointless.recovery`.

:class:`Context` is the front; the parts behind it each hold one idea: the process's wiring from its
environment (:mod:`hp.checkpointless.wiring`), the step loop (:mod:`hp.checkpointless.steps`), the
doomed-step interrupt (:mod:`hp.checkpointless.interrupt`), the hooks between hp and the user's code
(:mod:`hp.checkpointless.hooks`) and the recovery path (:mod:`hp.checkpointless.recover`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch

from hp.checkpointless import ladder
from hp.checkpointless.hooks import Attempt, Hooks
from hp.checkpointless.interrupt import Interrupt
from hp.checkpointless.premap import Premaps
from hp.checkpointless.recover import Recovery, release_holders
from hp.checkpointless.recovery import CollectiveError, JobEnded
from hp.checkpointless.reduction import Reduction
from hp.checkpointless.registry import TrainingState
from hp.checkpointless.steps import BLOCK_EDGES, Step, StepLoop, at_block_edge  # noqa: F401 (at_block_edge: tests)
from hp.checkpointless.transaction import StepTransaction
from hp.checkpointless.wiring import Wiring, read_worker_env
from hp.core.errors import UsageError

__all__ = ["CollectiveError", "Context", "JobEnded", "Step", "recoverable"]


class Context:
    """What a training function wrapped by :func:`recoverable` gets: identity, state registration,
    and the step loop. Read-only: ``rank``, ``world_size``, ``generation``, ``committed`` (last
    committed step, -1 before the first), ``device``, ``last_loss``, ``optimizer``, ``scheduler``. A
    hot spare runs the same code up to ``ctx.steps()``, where it waits for a rank: read ``rank``
    inside the loop. ``env``: the environment ``hp run`` gave the process, read once
    (:func:`hp.checkpointless.wiring.read_worker_env`). As a context manager, leaving it closes it."""

    def __init__(self, env=os.environ, pg_timeout: timedelta = timedelta(seconds=60)) -> None:
        self._training: TrainingState | None = None
        self._wiring = wiring = Wiring(read_worker_env(env), env, pg_timeout,
                                       on_release=lambda: release_holders(self._training))
        self.events = wiring.events
        self._attempt = Attempt()
        self._interrupt = Interrupt(wiring.machine, BLOCK_EDGES)
        self._hooks = Hooks(wiring, self._interrupt, self._attempt)  # the mesh's hook exists before register
        self._loop: StepLoop | None = None  # from ctx.register on
        self._interrupt.install()
        wiring.watch_generations(self._interrupt.on_generation)

    # ---- identity and registered objects ----------------------------------------------------
    @property
    def rank(self) -> int:
        rank = self._wiring.formation.rank
        if rank < 0:
            raise UsageError("a hot spare has no rank until ctx.steps() gives it one: "
                             "read ctx.rank inside the step loop, not before it")
        return rank

    @property
    def world_size(self) -> int:
        return self._wiring.world_size

    @property
    def generation(self) -> int:
        """Generation of the process group this process is in (0: none yet)."""
        return self._wiring.machine.generation

    @property
    def committed(self) -> int:
        return self._training.committed if self._training is not None else -1

    @property
    def samples(self) -> int:
        """Samples the job consumed through the committed step (steps split by ``step.micro_batches``),
        over every world size it ran at: where the next step's samples start."""
        return self._training.samples if self._training is not None else 0

    @property
    def device(self) -> torch.device:
        return self._wiring.device

    @property
    def last_loss(self) -> float | None:
        """The global mean loss of the last step this process committed (None before the first)."""
        return self._loop.last_loss if self._loop is not None else None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The registered optimizer (built by its factory once the first process group exists)."""
        return self._training.optimizer if self._training is not None else None

    @property
    def scheduler(self) -> Any:
        return self._training.scheduler if self._training is not None else None

    def device_mesh(self, *, replicate: int | None = None, shard: int | None = None) -> Any:
        """The ``torch.distributed.DeviceMesh`` to shard the model on with FSDP2 (``fully_shard(module,
        mesh=mesh)``): 1-D (``shard`` = every rank) by default, HSDP with ``replicate`` > 1 (dims
        ``("replicate", "shard")``, ``shard`` ranks each, consecutive ranks in a shard group). ``shard``
        alone: HSDP with as many replica groups as the job has; an elastic job (scaling policy ``unit`` a
        multiple of ``shard``) shrinks and grows by whole replica groups, each rank keeping its shard: the
        replicate group's ``size()`` follows the generation, the ``DeviceMesh``'s own shape stays the one it
        was built with (use ``ctx.world_size``, not ``mesh.size()``, for the data-parallel degree). Its process
        groups are those of the current generation, re-formed with every generation
        (:mod:`hp.checkpointless.mesh`); a lost rank's shards come back from peers
        (:mod:`hp.checkpointless.fsdp`). The job's first process group forms here, and a hot spare waits
        here until it is given a rank (its shards depend on it). Call it once, before sharding the model
        and ``ctx.register``."""
        if self._wiring.link.mesh is None and self._training is not None:
            raise UsageError("call ctx.device_mesh() before ctx.register(...)")
        return self._wiring.device_mesh(replicate, shard, before=self._hooks.before_collective)

    def register(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | Callable | None = None,
                 scheduler: Any = None, extra: Any = None, checkpoint: ladder.JobCheckpoint | None = None, *,
                 scaler: Any = None, broadcast_buffers: bool = True, reduction: Reduction | None = None,
                 on_scale: Callable[[int, int], None] | None = None) -> None:
        """Declare the training state hp keeps consistent and copies to a replacement rank.

        ``optimizer`` may be a factory ``f(params) -> Optimizer`` (and then ``scheduler`` a factory
        ``g(optimizer)``): it is called once this process is in a process group, which a
        ``torch.distributed.optim.ZeroRedundancyOptimizer`` needs (a hot spare has none before it gets a
        rank); use ``ctx.optimizer``/``ctx.scheduler`` afterwards. A ZeroRedundancyOptimizer's shards are
        replicated to a buddy rank after every step (:mod:`hp.checkpointless.sharded`).
        ``extra``: anything with ``state_dict()``/``load_state_dict()`` returning JSON-able data.
        ``checkpoint``: the job-level rung (:class:`hp.checkpointless.ladder.JobCheckpoint`, e.g. over
        hp-tiered-ckpt): saved after the commits it says are due, restored when no peer holds the state
        or when the job starts again. ``scaler``: a ``torch.amp.GradScaler``; hp unscales the averaged
        gradients in :meth:`reduce` and steps and updates it in :meth:`commit` (don't call its
        ``unscale_``/``step``/``update`` yourself). ``broadcast_buffers`` (as DDP's): rank 0's buffers
        (BatchNorm running statistics) go to every rank at each step, so replicas stay identical.
        ``reduction``: how gradients are averaged (:mod:`hp.checkpointless.reduction`; exact mode is
        ``hp.elastic.ExactReduction()``). ``on_scale(old_world, new_world)``: called after a formation
        whose world size differs from the one the state is for, before the next step, on every rank
        alike (a survivor, a joiner that hydrated from one, a job restored from a checkpoint taken at
        another size), to change user state that depends on W (``hp.elastic.on_scale_lr``). A model
        sharded with FSDP2 (``fully_shard``) must be sharded on :meth:`device_mesh`; FSDP then reduces
        the gradients in backward, and ``reduction`` does not apply."""
        w = self._wiring
        st = TrainingState(model, optimizer, scheduler, extra, checkpoint, scaler, broadcast_buffers, mesh=w.link.mesh)
        if st.fsdp is not None and reduction is not None:
            raise UsageError("an FSDP2 model's gradients are reduced by FSDP: pass no reduction=")
        self._training = st
        st.premaps = Premaps(w.offers, w.token) if w.offers else None
        tx = StepTransaction(st, w.link.collective, reduction)
        self._hooks.attach(st, tx, on_scale)
        self._loop = StepLoop(w, st, tx, self._interrupt, self._hooks, Recovery(w, self._hooks, st, tx),
                              self._attempt, close=self.close)

    # ---- the step loop ------------------------------------------------------------------------
    def steps(self, total: int) -> Iterator[Step]:
        """Yield steps from the first uncommitted one to ``total - 1``; a step that failed is
        yielded again (same index, so the same batch) after recovery."""
        if self._loop is None:
            raise UsageError("call ctx.register(model, optimizer, ...) before ctx.steps()")
        yield from self._loop.steps(total, self._wiring.worker.generation)

    def reduce(self) -> None:
        """Average the step's gradients across ranks now (and unscale them, with a registered scaler),
        so the code before :meth:`commit` sees the global gradients: to clip them, say. Optional:
        ``commit`` reduces when this was not called."""
        if self._loop is None:
            raise UsageError("ctx.reduce() is called once per step, inside `with step:`, before ctx.commit(loss)")
        self._loop.reduce()

    def commit(self, loss: torch.Tensor | float | Sequence[torch.Tensor | float]) -> float:
        """Vote and apply the optimizer step (reducing gradients first if :meth:`reduce` was not called);
        returns the global mean loss. Raises :class:`CollectiveError` if a peer fails before the vote.
        ``loss``: this rank's loss; in a step split by :meth:`Step.micro_batches`, the list of its
        micro-batches' losses in order (the global mean is then the same bits at any world size), or
        their sum."""
        if self._loop is None:
            raise UsageError("ctx.commit(loss) is called once per step, inside `with step:`")
        return self._loop.commit(loss)

    def close(self) -> None:
        """Leave the job: stop the watch thread, destroy the process group. Idempotent."""
        self._wiring.close()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        """A failure that leaves the training function while the agent that started this process is dead
        has that for its cause (the store died with the agent, say): leave at once, as the watch thread
        would. Closes the context in any case."""
        try:
            if isinstance(exc, Exception):
                self._wiring.leave_if_orphaned()
        finally:
            self.close()
        return False


def recoverable(fn):
    """Decorator: run ``fn(ctx, *args, **kwargs)`` with a :class:`Context` under ``hp run``.

    Survivors of a failure stay inside ``fn``; the failed step is replayed by ``ctx.steps()``.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with Context() as ctx:
            return fn(ctx, *args, **kwargs)

    return wrapper

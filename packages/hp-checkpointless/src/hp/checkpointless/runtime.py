"""In-process recovery: the restart block around each training step, and the user's API to it.

A step is a transaction (:mod:`hp.checkpointless.transaction`): forward/backward (user code) →
gradient reduction → (clipping, AMP unscale) → commit vote → local optimizer step. A failure before
the vote rolls every survivor back to its last committed state (:mod:`hp.checkpointless.registry`)
and the step is replayed with the same batch. After re-forming the process group of a new generation
(:mod:`hp.checkpointless.formation`), ranks agree on the newest committed step and the ranks behind
it (a promoted spare, a restarted process, a rank that failed after the vote) pull the state from a
peer (:mod:`hp.checkpointless.hydration`). Survivors never re-import torch or rebuild anything.
Where a rank is in all this is the explicit state machine of :mod:`hp.checkpointless.recovery`.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch

from hp.checkpointless import ladder, membership
from hp.checkpointless.events import EventLog
from hp.checkpointless.faults import FaultPlan
from hp.checkpointless.formation import Formation
from hp.checkpointless.group import GroupLink
from hp.checkpointless.mesh import GenerationMesh, MeshLayout
from hp.checkpointless.premap import Premaps
from hp.checkpointless.recovery import CollectiveError, JobEnded, RankState, RecoveryMachine
from hp.checkpointless.reduction import Reduction
from hp.checkpointless.registry import TrainingState, warm_optimizer_imports
from hp.checkpointless.microbatch import micro_batch_seed
from hp.checkpointless.sampler import StepLoader
from hp.checkpointless.transaction import StepTransaction
from hp.core.auth import TOKEN_ENV
from hp.core.devices import pin_to_core
from hp.core.control_plane import ControlClient
from hp.core.errors import UsageError
from hp.core.fanout import Mirror
from hp.core.health import EXIT_UNHEALTHY, first_failure
from hp.core.plugins import backends, get_backend
from hp.core.protocol import AGENT_PID_ENV, FINISHED_KEY, Event, Plan
from hp.core.signed_values import Refusals, sealing

__all__ = ["CollectiveError", "Context", "JobEnded", "Step", "recoverable"]

EXIT_ORPHANED = 76  # the agent died: no one supervises this process
# Sent by the watch thread to the main thread to stop a step whose group is already dead. SIGUSR2,
# not SIGUSR1, which Slurm and Lightning use for requeue notices.
INTERRUPT_SIGNAL = signal.SIGUSR2


# the mesh collectives that reduce gradients (FSDP: reduce-scatter; HSDP also all-reduces)
REDUCTIONS = frozenset({"reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
                        "reduce_scatter_single", "reduce_scatter_single_coalesced", "allreduce"})


class Step(int):
    """A step index that is also the restart block of that step: ``with step: ...``."""

    _ctx: Context

    def __new__(cls, value: int, ctx: Context) -> Step:
        obj = super().__new__(cls, value)
        obj._ctx = ctx
        return obj

    def __enter__(self) -> Step:
        self._ctx._enter_step()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return self._ctx._end_step(self, exc)

    def micro_batches(self, loader: StepLoader) -> Iterator[Any]:
        """This rank's micro-batches of the step at the current world size (constant global batch).

        Run forward and ``backward()`` on each (do not divide the loss: hp divides the summed gradients
        by the step's micro-batch count) and pass the losses, one per micro-batch in order, to
        ``ctx.commit``. Before each micro-batch torch's global RNG is seeded from (seed, step,
        micro-batch), so dropout draws the same masks whichever rank computes it."""
        return self._ctx._micro_batches(self, loader)


class Context:
    """What a training function wrapped by :func:`recoverable` gets: identity, state registration,
    and the step loop. Read-only: ``rank``, ``world_size``, ``generation``, ``committed`` (last
    committed step, -1 before the first), ``device``, ``last_loss``, ``optimizer``, ``scheduler``. A
    hot spare runs the same code up to ``ctx.steps()``, where it waits for a rank: read ``rank``
    inside the loop."""

    def __init__(self, env=os.environ, pg_timeout: timedelta = timedelta(seconds=60)) -> None:
        if "HP_GENERATION" not in env:
            raise UsageError("hp.checkpointless needs `hp run` (HP_GENERATION is not set)")
        spare_id = env.get("HP_SPARE_ID") if env.get("HP_ROLE", "worker") == "spare" else None
        rank = int(env["RANK"]) if spare_id is None else -1
        self._env_world_size = int(env["WORLD_SIZE"])
        self._mesh_args: tuple[int | None, int | None] = (None, None)  # ctx.device_mesh()'s, once called
        self._start_generation = int(env["HP_GENERATION"])
        self.last_loss: float | None = None
        store_addr = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
        token = env.get(TOKEN_ENV, "")
        if not token:  # every value read from the store is sealed with it (hp.core.signed_values)
            raise UsageError(f"hp.checkpointless needs the job token in {TOKEN_ENV} (`hp run` sets it)")
        self._transport = get_backend("transport", env.get("HP_TRANSPORT", "gloo"))
        self._store = membership.connect_store(*store_addr)
        self._channel = Mirror.from_env(env)  # the node's relay of the membership (hp.core.fanout); None without
        log_dir = env.get("HP_LOG_DIR")
        self._offers = os.path.join(log_dir, "offers") if log_dir else None  # the node's (hp.checkpointless.premap)
        self.events = EventLog(os.path.join(log_dir, "events") if log_dir else None,
                               f"rank{rank}" if spare_id is None else f"spare-{spare_id}")
        self._faults = FaultPlan.from_env(lambda key: self._store.add(key, 1) == 1, env)
        self._publish = sealing(self._store.set, token)
        self._token = token  # also seals a spare's offer of its buffer (hp.checkpointless.premap)
        refusals = Refusals(self._refused)
        self._machine = RecoveryMachine()
        self._link = GroupLink(self._transport, self._store, self._machine, pg_timeout, self.events, self._detach)
        self._formation = Formation(
            rank=rank, spare_id=spare_id, node_rank=int(env.get("HP_NODE_RANK", "0")), holder=env.get("HP_HOLDER", ""),
            store=self._store, token=token, controller=ControlClient(env.get("HP_CONTROLLER", ""), token,
                                                                           node=env.get("HP_NODE_RANK", "0"),
                                                                           follow=self._follow(env, token)),
            machine=self._machine, link=self._link, events=self.events, fire=self._phase, refusals=refusals,
            channel=self._channel)
        self._training: TrainingState | None = None
        self._tx: StepTransaction | None = None
        self._step: Step | None = None
        self._step_done = False
        self._in_block = False  # the main thread is inside a `with step:` block (between __enter__ and __exit__)
        self._owned: list[int] = []  # the micro-batches this rank computes in the current step
        self._step_samples = 0  # samples the current step consumes (all ranks), when split in micro-batches
        self._reform_due = False  # the last vote said: re-form (a planned generation) before the next step
        self._finish_due = False  # the last vote said: the job ends after this step (hp finish)
        self._on_scale: Callable[[int, int], None] | None = None
        self._size_published = False
        self._reduction_fired = False  # the step's "allreduce" fault phase fired (FSDP: at its first reduce-scatter)
        self._can_interrupt = threading.current_thread() is threading.main_thread()
        if self._can_interrupt:
            signal.signal(INTERRUPT_SIGNAL, self._interrupt)
        self._watch = membership.Watch(lambda: membership.connect_store(*store_addr), env.get("HP_HEARTBEAT_FILE"),
                                       self._on_generation, on_orphaned=self._orphaned, token=token,
                                       refusals=refusals, channel=self._channel,
                                       agent_pid=int(env[AGENT_PID_ENV]) if env.get(AGENT_PID_ENV, "").isdigit()
                                       else None).start()

    # ---- identity and registered objects ----------------------------------------------------
    @property
    def rank(self) -> int:
        if self._formation.rank < 0:
            raise UsageError("a hot spare has no rank until ctx.steps() gives it one: "
                             "read ctx.rank inside the step loop, not before it")
        return self._formation.rank

    @property
    def world_size(self) -> int:
        return self._link.world_size or self._env_world_size

    @property
    def generation(self) -> int:
        """Generation of the process group this process is in (0: none yet)."""
        return self._machine.generation

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
        return torch.device(self._transport.device_for(int(os.environ.get("LOCAL_RANK", "0"))))

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
        mesh = self._link.mesh
        if mesh is not None:
            if self._mesh_args != (replicate, shard):
                raise UsageError(f"ctx.device_mesh() was called with replicate={self._mesh_args[0]}, "
                                 f"shard={self._mesh_args[1]}, now with replicate={replicate}, shard={shard}")
            return mesh.device_mesh
        if self._training is not None:
            raise UsageError("call ctx.device_mesh() before ctx.register(...)")
        MeshLayout.of(self._env_world_size, replicate, shard)  # bad arguments: one line, before a spare waits
        if self._formation.rank < 0:
            warm_optimizer_imports()  # a spare builds its model and optimizer once promoted: not the imports
        rank = self._formation.rank if self._formation.rank >= 0 else self._formation.assign(None)
        # a spare's mesh is of the generation it joins (an elastic job's size may have changed since it started)
        layout = MeshLayout.of(self._formation.assigned_world() or self._env_world_size, replicate, shard)
        device_type = torch.device(self._transport.device_for(0)).type
        self._mesh_args = (replicate, shard)
        self._link.mesh = GenerationMesh(layout, rank, device_type, before=self._before_collective)
        # torch's mesh needs a default group to shard on: the first generation forms now, and settles
        # (agreement, hydration) in ctx.steps()
        self._formation.enter_first(self._start_generation)
        return self._link.mesh.device_mesh

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
        mesh = self._link.mesh
        st = TrainingState(model, optimizer, scheduler, extra, checkpoint, scaler, broadcast_buffers, mesh=mesh)
        if st.fsdp is not None and reduction is not None:
            raise UsageError("an FSDP2 model's gradients are reduced by FSDP: pass no reduction=")
        self._training = st
        st.premaps = Premaps(self._offers, self._token) if self._offers else None
        self._tx = StepTransaction(st, self._link.collective, reduction)
        self._on_scale = on_scale
        if st.fsdp is not None:  # gradients land on the sharded parameters without hooks: backward starts here
            model.register_forward_hook(self._hook_output)
            return
        if st.params:  # the "backward" fault phase fires while the first parameter's gradient is accumulated
            st.params[0].register_post_accumulate_grad_hook(self._on_backward)
        for i, p in enumerate(st.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._on_gradient, index=i))

    # ---- the step loop ------------------------------------------------------------------------
    def steps(self, total: int) -> Iterator[Step]:
        """Yield steps from the first uncommitted one to ``total - 1``; a step that failed is
        yielded again (same index, so the same batch) after recovery."""
        st = self._training
        if st is None:
            raise UsageError("call ctx.register(model, optimizer, ...) before ctx.steps()")
        self._formation.join(st, self._tx, self._start_generation)
        self._formed()
        try:
            while st.committed + 1 < total and not self._finish_due:
                if self._reform_due:
                    self._rescale()
                step = self._step = Step(st.committed + 1, self)
                self._step_done = False
                self._machine.to(RankState.COMPUTING)
                self._tx.begin()
                self._step_samples = 0
                self._reduction_fired = False
                try:
                    self._phase(step, "forward")
                except Exception as exc:  # an injected fault: the step failed before the user's code ran
                    self._recover(step, exc)
                    continue
                yield step
                if not self._step_done:
                    raise UsageError("each step must end with ctx.commit(loss)")
            if self._finish_due:  # hp finish: every rank ends after this same step
                self.events.record(Event.FINISH_AGREED, rank=self.rank, step=st.committed, generation=self.generation)
            self._publish(FINISHED_KEY, str(st.committed))  # releases a joiner that would wait for us forever
            self.events.record(Event.FINAL_STATE, rank=self.rank, step=st.committed, digests=st.digests())
        finally:
            self.close()

    def _micro_batches(self, step: Step, loader: StepLoader) -> Iterator[Any]:
        if self._step is not step or self._machine.state is not RankState.COMPUTING:
            raise UsageError("step.micro_batches(loader) is called inside `with step:`, before ctx.commit")
        sampler, world = loader.sampler, self.world_size
        total = sampler.micro_batches_at(world)
        if self._training.fsdp is not None and total % world:  # FSDP reduces in each backward, on every rank
            raise UsageError(f"with an FSDP2 model every rank runs as many micro-batches as the others: "
                             f"{total} micro-batches per step do not divide among {world} ranks")
        self._tx.split(total)
        self._step_samples = sampler.samples_at(world)
        self._owned = sampler.owned(int(step), self.rank, world)
        for m, batch in zip(self._owned, loader.step(int(step), self.rank, world, self._training.samples)):
            self._check_interrupt("before a micro-batch")
            torch.manual_seed(micro_batch_seed(sampler.seed, int(step), m))
            yield batch
            self._tx.micro_batch_done(m)

    def reduce(self) -> None:
        """Average the step's gradients across ranks now (and unscale them, with a registered scaler),
        so the code before :meth:`commit` sees the global gradients: to clip them, say. Optional:
        ``commit`` reduces when this was not called."""
        if self._step is None or self._machine.state is not RankState.COMPUTING:
            raise UsageError("ctx.reduce() is called once per step, inside `with step:`, before ctx.commit(loss)")
        self._check_interrupt("before the reduction")
        self._machine.to(RankState.COMMITTING)  # from here on a failure surfaces in a collective, never midway
        if not self._reduction_fired:
            self._phase(self._step, "allreduce")
        self._tx.reduce(int(self._step), self.world_size)

    def commit(self, loss: torch.Tensor | float | Sequence[torch.Tensor | float]) -> float:
        """Vote and apply the optimizer step (reducing gradients first if :meth:`reduce` was not called);
        returns the global mean loss. Raises :class:`CollectiveError` if a peer fails before the vote.
        ``loss``: this rank's loss; in a step split by :meth:`Step.micro_batches`, the list of its
        micro-batches' losses in order (the global mean is then the same bits at any world size), or
        their sum."""
        if self._machine.state is RankState.COMPUTING:
            self.reduce()
        elif self._machine.state is not RankState.COMMITTING:
            raise UsageError("ctx.commit(loss) is called once per step, inside `with step:`")
        step, st = int(self._step), self._training
        self._phase(step, "commit")
        slots = self._loss_slots(loss)
        mean, skip, self._reform_due, self._finish_due = self._tx.vote(step, slots, self.world_size,
                                                                       self._machine.boundary_due(),
                                                                       self._machine.finishing)
        # committed: from here on, survivors finish the step whatever happens to peers
        self._machine.to(RankState.FINISHING)
        self._phase(step, "optimizer")
        self._tx.apply(step, skip)
        st.mark_committed(step)
        if st.premaps is not None:  # a step boundary: map a same-node spare's buffer before it is needed
            st.premaps.poll()
        st.samples += self._step_samples  # a skipped step (inf gradients) consumed its samples too
        self._step_done, self.last_loss = True, mean
        if skip:
            self.events.record(Event.STEP_SKIPPED, step=step, rank=self.rank, scale=st.scaler.get_scale())
        # loss: the global mean; local: this rank's own losses by vote slot (its rank, or its micro-batches)
        overlapped = getattr(self._tx.reduction, "overlapped", None)  # buckets started during backward
        self.events.record(Event.COMMIT, step=step, rank=self.rank, generation=self.generation, loss=mean.hex(),
                           local={str(k): float(v).hex() for k, v in slots.items()}, world=self.world_size,
                           samples=st.samples, **({} if overlapped is None else {"overlapped": overlapped}))
        if not self._size_published:  # after the first commit, when lazily created optimizer state exists
            self._size_published = True
            self._formation.publish_state_size(st)
        failure = self._share_shards() if st.sharded is not None else None
        if failure is not None:  # the step is committed here; only peers' copies need repair
            self._recover(self._step, failure)
        elif st.checkpoint is not None and st.checkpoint.due(step):
            ladder.save_or_warn(st, self.rank, step, self.events)
        return mean

    def _loss_slots(self, loss: Any) -> dict[int, float]:
        """This rank's losses by vote slot: its micro-batches' ids in a split step, else its rank."""
        if self._tx.micro_batches is None:
            return {self.rank: _number(loss)}
        if isinstance(loss, (list, tuple)):
            if len(loss) != len(self._owned):
                raise UsageError(f"ctx.commit got {len(loss)} losses for the {len(self._owned)} micro-batches "
                                 f"this rank computed")
            return {m: _number(v) for m, v in zip(self._owned, loss)}
        return {self._owned[0]: _number(loss)} if self._owned else {}

    def _rescale(self) -> None:
        """A planned generation (grow, graceful preemption) at a step boundary every rank agreed on in
        the last vote: leave this group cleanly and form the new one (nothing to roll back or replay)."""
        st = self._training
        self.events.record(Event.RESCALING, rank=self.rank, step=st.committed, generation=self.generation)
        self._reform_due = False
        self._link.release()
        self._machine.to(RankState.FORMING)
        self._formation.reform(st, self._tx, self.generation + 1)
        self._formed()

    def _share_shards(self) -> CollectiveError | None:
        """Sharded optimizer, after the local update: owners broadcast their partitions, then every
        shard is copied to its buddy. Returns the failure instead of raising it, outside any frame
        of the failed collective (see group.py)."""
        try:
            self._link.collective(self._training.sharded.sync_params)
            self._training.sharded.replicate(self.rank, self._link.collective)
        except CollectiveError as e:
            return e
        return None

    # ---- failures -----------------------------------------------------------------------------
    def _phase(self, step: int, phase: str) -> None:
        rank = self._formation.rank
        self._faults.fire(int(step), phase, rank, lambda f: self.events.record(
            Event.FAULT_INJECTED, kind=f.kind, phase=phase, step=int(step), rank=rank))

    def _enter_step(self) -> None:
        self._in_block = True  # the watch thread's interrupt may raise from here on (_interrupt)

    def _end_step(self, step: Step, exc: BaseException | None) -> bool:
        self._in_block = False
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, (UsageError, JobEnded)):
            return False
        self._recover(step, exc)
        self._step_done = True  # recovered: ctx.steps() yields the step again
        return True

    def _recover(self, step: Step, exc: Exception) -> None:
        if self._watch.orphaned():  # the peer that failed left because the agent died: so must this rank
            self._orphaned()
        failure = self._machine.failed(in_step=not isinstance(exc, CollectiveError))
        failed_generation = self.generation
        self.events.record(Event.FAILURE_DETECTED, step=int(step), rank=self.rank, generation=failed_generation,
                           error=f"{type(exc).__name__}: {exc}"[:300], in_step=failure.in_step, replay=failure.replay)
        _drop_frames(exc)
        self._link.release()
        self._check_health()
        self._tx.abort()
        self._training.rollback()
        if failure.report is not None:
            self._formation.report(failure.report, f"{type(exc).__name__}: {exc}")
        self._formation.reform(self._training, self._tx, failed_generation + 1,
                               on_slow=lambda: self._formation.report("collective", str(exc)))
        self._formed()

    def _check_health(self) -> None:
        """After a failure, before re-entering: this rank's device passes every health check that applies
        (:mod:`hp.core.health`, family ``health``), or the process leaves and a spare takes its rank."""
        if self._faults.unhealthy:  # the CPU stand-in for a device left unusable: no real check to run
            failed = ("injected", "an injected fault left this device unusable")
        else:
            failed = first_failure(backends("health").values(), str(self.device))
        if failed is None:
            return
        check, reason = failed
        self.events.record(Event.HEALTH_CHECK_FAILED, rank=self.rank, check=check, reason=reason[:300])
        print(f"hp: rank {self.rank}: health check {check!r} failed ({reason}); leaving for a spare",
              file=sys.stderr, flush=True)
        raise JobEnded(EXIT_UNHEALTHY)

    def _formed(self) -> None:
        """After every formation: state for another world size than the group's is the user's to adapt
        (``on_scale``), on every rank alike: a survivor's, a joiner's hydrated from a survivor, a job's
        restored from a checkpoint taken at another size. A rank pins itself to its core here when
        ``HP_PIN_CORES=1`` (benchmarks: a promoted spare takes the dead rank's core)."""
        if self._formation.rank >= 0:  # a process left out of the new group (a joiner not taken) has none
            pin_to_core(self._formation.rank)
        st, new_world = self._training, self._link.world_size
        if st.world and st.world != new_world and self._on_scale is not None:
            self._on_scale(st.world, new_world)
        st.world = new_world

    def _detach(self) -> None:
        """Whatever holds the failed group besides the transport lets go of it first: a sharded
        optimizer's reference alone would keep the group and its sockets alive."""
        if self._training is not None and self._training.sharded is not None:
            self._training.sharded.unbind()

    def _hook_output(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        """An FSDP model's forward returned ``output``: the gradient reaching it starts backward (the
        "backward" fault phase), the way FSDP's own pre-backward hook is placed."""
        for t in (output if isinstance(output, (tuple, list)) else (output,)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad: self._on_backward(None))
                return

    def _on_backward(self, _param: torch.Tensor | None) -> None:
        if self._step is not None and self._machine.state is RankState.COMPUTING:
            self._phase(self._step, "backward")

    def _on_gradient(self, _param: torch.Tensor, index: int) -> None:
        """Each accumulated gradient is a point where a step whose group already died stops.
        ``backward()`` is one call into C++ that takes most of a step, and the watch thread's interrupt
        is raised only between Python bytecodes: without these points a survivor that is in backward
        when a peer dies finishes it first (measured: 1.75 s of a 25 M-param model's recovery). It is
        also where an overlapping reduction starts a bucket (:meth:`StepTransaction.gradient_ready`)."""
        self._check_interrupt("during backward")
        if self._step is not None and self._machine.state is RankState.COMPUTING:
            self._tx.gradient_ready(index)

    def _before_collective(self, op: str) -> None:
        """Every collective on the device mesh (FSDP's all-gathers and reductions, DTensor's): a step
        whose generation is dead stops here, and the step's gradient reduction starts at its first
        reduce-scatter (the "allreduce" fault phase)."""
        self._check_interrupt("during the step")
        if (not self._reduction_fired and op in REDUCTIONS and self._step is not None
                and self._machine.state is RankState.COMPUTING):
            self._reduction_fired = True
            self._phase(self._step, "allreduce")

    def _on_generation(self, plan: Plan) -> None:
        """Watch thread: a newer generation means this rank's group is dead; stop a step that computes
        for nothing (without this, a peer that died at the start of a step is noticed only at its
        all-reduce, a whole step later). A planned one (grow, preemption) waits for a step boundary."""
        if self._machine.observe(plan.generation, plan.at_boundary, plan.finishing) and self._can_interrupt:
            signal.pthread_kill(threading.main_thread().ident, INTERRUPT_SIGNAL)

    def _follow(self, env: dict, token: str):
        """HA controller (``hp run --store etcd``): where reports go when the controller moves to
        another replica (:class:`hp.core.leader.LeaderResolver` on this process's store); else None."""
        if not env.get("HP_CONTROLLER_HA"):
            return None
        from hp.core.leader import LeaderResolver

        return LeaderResolver(self._store, token).wait_for_other

    def _refused(self, key: str, message: str) -> None:
        """A store value not sealed for its key was read (any thread): ignored, said at most every 30 s per key."""
        self.events.record(Event.STORE_VALUE_REFUSED, rank=self._formation.rank, key=key, error=message[:300])
        print(f"hp: rank {self._formation.rank}: warning: {message}; ignored", file=sys.stderr, flush=True)

    def _interrupt(self, signum: int, frame: Any) -> None:
        """Main thread, between two Python bytecodes (torch ops run to the end). Raises only inside the
        user's ``with step:`` block, which is what recovers from it: a signal that lands outside it (the
        ``ctx.steps()`` generator preparing a step, ``Step.__enter__``/``__exit__``, the user's own code
        before or after the block) is left to the step's next check point (a collective, a gradient, a
        micro-batch, ``ctx.reduce``); raised there, it would leave the user's loop and end the rank (seen:
        an HSDP rank interrupted while ``ctx.steps()`` cleared its gradients)."""
        if self._in_block and not at_block_edge(frame):
            self._check_interrupt("during the step")

    def _check_interrupt(self, where: str) -> None:
        """A check point inside the user's step: stop it if its generation is dead (at most once a step)."""
        if self._machine.take_interrupt():
            raise CollectiveError(f"{self._machine.superseded()} {where}")

    def _orphaned(self) -> None:
        """The agent that started this process is gone (SIGKILLed with its node's controller, say): seen
        by the watch thread, or by the main thread when a failure (a peer that left for this reason, the
        store gone with the agent) finds it gone first. Nobody can fence or replace this rank any more:
        leave at once."""
        self.events.record(Event.ORPHANED, rank=self._formation.rank, generation=self.generation)
        print(f"hp: rank {self._formation.rank}: the agent that started this process died; exiting",
              file=sys.stderr, flush=True)
        os._exit(EXIT_ORPHANED)

    def close(self) -> None:
        """Leave the job: stop the watch thread, destroy the process group. Idempotent."""
        if self._machine.state is not RankState.CLOSED:
            self._machine.to(RankState.CLOSED)
        self._watch.stop()
        if self._channel is not None:
            self._channel.close()
        self._link.close()
        self.events.close()


def _drop_frames(exc: BaseException) -> None:
    """The frames of a collective that failed inside torch (FSDP's, in backward) hold its group, in the
    exception's traceback and in those of the exceptions it was raised while handling (torch's logging
    wrapper raises a second one): they let go of it before the group is destroyed (group.py)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__context__ or exc.__cause__


def at_block_edge(frame: Any) -> bool:
    """Whether ``frame`` (where a signal handler runs) is in ``Step.__enter__`` or ``Step.__exit__``, or
    code they called: the edges of a ``with step:`` block, where :attr:`Context._in_block` does not yet
    (or still) say where the main thread is."""
    while frame is not None:
        if frame.f_code in _BLOCK_EDGES:
            return True
        frame = frame.f_back
    return False


_BLOCK_EDGES = frozenset({Step.__enter__.__code__, Step.__exit__.__code__})


def _number(value: Any) -> float:
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


def recoverable(fn):
    """Decorator: run ``fn(ctx, *args, **kwargs)`` with a :class:`Context` under ``hp run``.

    Survivors of a failure stay inside ``fn``; the failed step is replayed by ``ctx.steps()``.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ctx = Context()
        try:
            return fn(ctx, *args, **kwargs)
        except Exception:
            if ctx._watch.orphaned():  # e.g. the store died with the agent while this rank waited on it
                ctx._orphaned()
            raise
        finally:
            ctx.close()

    return wrapper

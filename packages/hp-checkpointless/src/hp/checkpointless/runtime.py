"""In-process recovery: the restart block around each training step and the step-commit protocol.

A step is a transaction: forward/backward (user code) → gradient all-reduce → commit vote →
optimizer step. A failure before the vote leaves every survivor at its last committed state (the
optimizer has not run) and the step is replayed with the same batch. After re-forming the process
group of a new generation, ranks agree on the newest committed step and the ranks behind it (a
promoted spare, a restarted process, a rank that failed after the vote) pull the state from a peer
that has it (:mod:`hp.checkpointless.state`). Survivors never re-import torch or rebuild anything.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.optim import ZeroRedundancyOptimizer

from hp.checkpointless import hydration, ladder, membership, sharded, state
from hp.checkpointless.rng import capture_rng, restore_rng
from hp.checkpointless.events import EventLog
from hp.checkpointless.faults import FaultPlan
from hp.core.auth import TOKEN_ENV
from hp.core.control_plane import ControlClient
from hp.core.errors import ControlPlaneError, UsageError
from hp.core.plugins import get_backend

EXIT_ESCALATED = 75  # EX_TEMPFAIL: this rank keeps failing; the agent replaces the process
EXIT_ORPHANED = 76  # the agent died: no one supervises this process
# Sent by the watch thread to the main thread to stop a step whose group is already dead. SIGUSR2,
# not SIGUSR1, which Slurm and Lightning use for requeue notices.
INTERRUPT_SIGNAL = signal.SIGUSR2


class CollectiveError(RuntimeError):
    """A collective of the current generation failed or was aborted."""


class JobEnded(SystemExit):
    """The controller ended the job, or fenced this process out; exits non-zero quietly."""


class Step(int):
    """A step index that is also the restart block of that step: ``with step: ...``."""

    _ctx: Context

    def __new__(cls, value: int, ctx: Context) -> Step:
        obj = super().__new__(cls, value)
        obj._ctx = ctx
        return obj

    def __enter__(self) -> Step:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return self._ctx._end_step(self, exc)


class Context:
    """What a training function wrapped by :func:`recoverable` gets: identity, state registration,
    and the step loop. Read-only attributes: ``rank``, ``world_size``, ``generation``, ``committed``
    (last committed step, -1 before the first), ``device``, ``last_loss``. A hot spare runs the
    same code up to ``ctx.steps()``, where it waits for a rank: read ``rank`` inside the loop."""

    def __init__(self, env=os.environ, pg_timeout: timedelta = timedelta(seconds=60)) -> None:
        if "HP_GENERATION" not in env:
            raise UsageError("hp.checkpointless needs `hp run` (HP_GENERATION is not set)")
        self.role = env.get("HP_ROLE", "worker")
        self.spare_id = env.get("HP_SPARE_ID")
        self._rank: int = int(env["RANK"]) if self.role == "worker" else -1
        self.world_size = int(env["WORLD_SIZE"])
        self.node_rank = int(env.get("HP_NODE_RANK", "0"))
        self.generation = 0  # of the process group this process is in (0: none yet)
        self.committed = -1
        self.last_loss: float | None = None
        self._start_generation = int(env["HP_GENERATION"])
        self.holder = env.get("HP_HOLDER", "")
        self._store_addr = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
        self._transport = get_backend("transport", env.get("HP_TRANSPORT", "gloo"))
        self._pg_timeout = pg_timeout
        self._store = membership.connect_store(*self._store_addr)
        self._controller = ControlClient(env.get("HP_CONTROLLER", ""), env.get(TOKEN_ENV, ""))
        log_dir = env.get("HP_LOG_DIR")
        name = f"rank{self._rank}" if self.role == "worker" else f"spare-{self.spare_id}"
        self.events = EventLog(os.path.join(log_dir, "events") if log_dir else None, name)
        self._faults = FaultPlan.from_env(env)
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: Any = None
        self._factories: tuple[Callable | None, Callable | None] | None = None  # built once a group exists
        self._sharded: sharded.ShardedOptimizer | None = None
        self._checkpoint: ladder.JobCheckpoint | None = None
        self._extra: Any = None
        self._grads: torch.Tensor | None = None  # one flat buffer, allocated once
        self._grads_step = -1  # the step whose averaged gradients `_grads` holds
        self._vote = torch.zeros(2, dtype=torch.float64)
        self._agree: torch.Tensor | None = None
        self._rng: dict | None = None
        self._receive_buffer: state.StateBuffer | None = None  # a spare's pre-faulted hydration buffer
        self._size_published = False
        self._pg_lock = threading.Lock()
        self._pg_live = False
        self._latest = 0  # newest generation the watch thread has seen
        self._step: Step | None = None
        self._step_done = False
        self._interruptible = False  # True only while user code of a step runs (never inside commit)
        self._interrupt_sent = 0  # generation the main thread was last interrupted for
        self._can_interrupt = threading.current_thread() is threading.main_thread()
        if self._can_interrupt:
            signal.signal(INTERRUPT_SIGNAL, self._interrupt)
        self._watch = membership.Watch(
            lambda: membership.connect_store(*self._store_addr), env.get("HP_HEARTBEAT_FILE"), self._on_generation,
            on_orphaned=self._orphaned,
        ).start()

    # ---- user API -----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        if self._rank < 0:
            raise UsageError("a hot spare has no rank until ctx.steps() gives it one: "
                             "read ctx.rank inside the step loop, not before it")
        return self._rank

    @property
    def device(self) -> torch.device:
        return torch.device(self._transport.device_for(int(os.environ.get("LOCAL_RANK", "0"))))

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The registered optimizer (built by its factory once the first process group exists)."""
        return self._optimizer

    @property
    def scheduler(self) -> Any:
        return self._scheduler

    def register(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | Callable | None = None,
                 scheduler: Any = None, extra: Any = None, checkpoint: ladder.JobCheckpoint | None = None) -> None:
        """Declare the training state hp keeps consistent and copies to a replacement rank.

        ``optimizer`` may be a factory ``f(params) -> Optimizer`` (and then ``scheduler`` a factory
        ``g(optimizer)``): it is called once this process is in a process group, which a
        ``torch.distributed.optim.ZeroRedundancyOptimizer`` needs (a hot spare has none before it gets a
        rank); use ``ctx.optimizer``/``ctx.scheduler`` afterwards. A ZeroRedundancyOptimizer's shards are
        replicated to a buddy rank after every step (:mod:`hp.checkpointless.sharded`).
        ``extra``: anything with ``state_dict()``/``load_state_dict()`` returning JSON-able data.
        ``checkpoint``: the job-level rung (:class:`hp.checkpointless.ladder.JobCheckpoint`, e.g. over
        hp-tiered-ckpt): saved after the commits it says are due, restored when no peer holds the state
        or when the job starts again."""
        self._checkpoint = checkpoint
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            self._factories, optimizer = (optimizer, scheduler), None
            scheduler = None
            # the first optimizer a process builds pays torch's lazy imports (torch._dynamo, ~1 s, 4 s
            # under load): pay them now, not while a spare is being promoted
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
        elif callable(scheduler) and not hasattr(scheduler, "state_dict"):
            raise UsageError("a scheduler factory needs an optimizer factory: pass optimizer=lambda params: ...")
        self._model, self._optimizer, self._scheduler, self._extra = model, optimizer, scheduler, extra
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            raise UsageError("pass a ZeroRedundancyOptimizer as a factory (optimizer=lambda params: "
                             "ZeroRedundancyOptimizer(params, ...)): hp builds it once the process group exists")
        trainable = [p for p in model.parameters() if p.requires_grad]
        if trainable:  # the "backward" fault phase fires while the first parameter's gradient is accumulated
            trainable[0].register_post_accumulate_grad_hook(self._on_backward)
        for p in trainable:
            p.register_post_accumulate_grad_hook(self._on_gradient)
        self._rng = capture_rng()

    def _on_backward(self, _param: torch.Tensor) -> None:
        if self._step is not None and self._interruptible:
            self._phase(self._step, "backward")

    def _on_gradient(self, _param: torch.Tensor) -> None:
        """Each accumulated gradient is a point where a step whose group already died stops.
        ``backward()`` is one call into C++ that takes most of a step, and the watch thread's interrupt
        is raised only between Python bytecodes: without these points a survivor that is in backward
        when a peer dies finishes it first (measured: 1.75 s of a 25 M-param model's recovery)."""
        if self._interruptible and self._latest > self.generation:
            self._interruptible = False
            raise CollectiveError(f"generation {self.generation} superseded by {self._latest} during backward")

    def _build_optimizer(self) -> None:
        make_optimizer, make_scheduler = self._factories
        self._factories = None
        self._optimizer = make_optimizer(list(self._model.parameters()))
        self._scheduler = make_scheduler(self._optimizer) if make_scheduler is not None else None
        if isinstance(self._optimizer, ZeroRedundancyOptimizer):
            self._sharded = sharded.ShardedOptimizer(
                self._optimizer, [p for p in self._model.parameters() if p.requires_grad])

    def steps(self, total: int) -> Iterator[Step]:
        """Yield steps from the first uncommitted one to ``total - 1``; a step that failed is
        yielded again (same index, so the same batch) after recovery."""
        if self._model is None:
            raise UsageError("call ctx.register(model, optimizer, ...) before ctx.steps()")
        self._join()
        try:
            while self.committed + 1 < total:
                self._step, self._step_done = Step(self.committed + 1, self), False
                try:
                    self._phase(self._step, "forward")
                except Exception as exc:  # an injected fault: the step failed before the user's code ran
                    self._recover(self._step, exc)
                    continue
                self._interruptible = True
                try:
                    yield self._step
                finally:
                    self._interruptible = False
                if not self._step_done:
                    raise UsageError("each step must end with ctx.commit(loss)")
        finally:
            self.close()

    def commit(self, loss: torch.Tensor) -> float:
        """Average gradients across ranks, vote, and apply the optimizer step; returns the global
        mean loss. Raises :class:`CollectiveError` if a peer fails before the vote completes."""
        step = self._step
        self._interruptible = False  # from here on a failure surfaces in a collective, never midway
        params = [p for p in self._model.parameters() if p.requires_grad]
        self._phase(step, "allreduce")
        grads = self._flat_grads(params)
        self._collective(dist.all_reduce, grads)
        grads.div_(self.world_size)
        self._grads_step = int(step)
        self._unflatten_grads(params, grads)
        self._phase(step, "commit")
        vote = self._vote
        vote[0], vote[1] = 1.0, float(loss.detach())
        self._collective(dist.all_reduce, vote)
        if int(vote[0]) != self.world_size:
            raise CollectiveError(f"commit vote of step {step}: {int(vote[0])}/{self.world_size}")
        # committed: from here on, survivors finish the step whatever happens to peers
        self._phase(step, "optimizer")
        if self._sharded is not None:
            self._sharded.local_step(int(step))
        elif self._optimizer is not None:
            self._optimizer.step()
        if self._optimizer is not None:
            self._optimizer.zero_grad(set_to_none=False)
        if self._scheduler is not None:
            self._scheduler.step()
        self.committed, self._step_done = int(step), True
        self.last_loss = float(vote[1]) / self.world_size
        self._rng = capture_rng()
        self.events.record("commit", step=int(step), rank=self._rank, generation=self.generation,
                           loss=self.last_loss.hex())
        if not self._size_published:
            self._publish_state_size()
        failure = self._share_shards() if self._sharded is not None else None
        if failure is not None:  # the step is committed here; only peers' copies need repair
            self._recover(step, failure)
        elif self._checkpoint is not None and self._checkpoint.due(int(step)):
            self._save_checkpoint(int(step))
        return self.last_loss

    def _share_shards(self) -> CollectiveError | None:
        """Sharded optimizer, after the local update: owners broadcast their partitions, then every
        shard is copied to its buddy. Returns the failure instead of raising it, outside any frame
        of the failed collective (see ``_collective``)."""
        try:
            self._collective(self._sharded.sync_params)
            self._sharded.replicate(self._rank, self._collective)
        except CollectiveError as e:
            return e
        return None

    # ---- step protocol internals --------------------------------------------------------
    def _flat_grads(self, params: list[torch.Tensor]) -> torch.Tensor:
        total = sum(p.numel() for p in params)
        self._grads_step = -1
        if self._grads is None or self._grads.numel() != total:
            self._grads = torch.zeros(total, dtype=params[0].dtype)
        offset = 0
        for p in params:
            n = p.numel()
            if p.grad is None:
                self._grads[offset:offset + n].zero_()
            else:
                self._grads[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n
        return self._grads

    @staticmethod
    def _unflatten_grads(params: list[torch.Tensor], flat: torch.Tensor) -> None:
        offset = 0
        for p in params:
            n = p.numel()
            view = flat[offset:offset + n].view_as(p)
            if p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)
            offset += n

    def _collective(self, fn: Callable, *args: Any) -> None:
        if self._latest > self.generation:
            raise CollectiveError(f"generation {self.generation} superseded by {self._latest}")
        try:
            fn(*args)
            return
        except (RuntimeError, ValueError) as e:  # gloo errors, state transfer errors, a destroyed group
            error = f"{getattr(fn, '__name__', 'transfer')} failed in generation {self.generation}: {e}"
        # raised outside the except block: the torch frames of the failed call (which hold the
        # process group) are gone, so destroying the group really closes its sockets
        raise CollectiveError(error)

    def _phase(self, step: int, phase: str) -> None:
        self._faults.fire(int(step), phase, self._rank, lambda f: self.events.record(
            "fault_injected", kind=f.kind, phase=phase, step=int(step), rank=self._rank))

    def _end_step(self, step: Step, exc: BaseException | None) -> bool:
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, (UsageError, JobEnded)):
            return False
        self._recover(step, exc)
        self._step_done = True  # recovered: ctx.steps() yields the step again
        return True

    # ---- recovery -----------------------------------------------------------------------
    def _on_generation(self, latest: int) -> None:
        """Watch thread: remember the newest generation, so that this rank does not enter another
        collective of a group that is already dead, and stop a step that is computing for nothing:
        without this, a peer that died at the start of a step is noticed only at its all-reduce, a
        whole step later."""
        self._latest = max(self._latest, latest)
        if (self._can_interrupt and self._interruptible and self._pg_live and latest > self.generation
                and self._interrupt_sent < latest):
            self._interrupt_sent = latest
            signal.pthread_kill(threading.main_thread().ident, INTERRUPT_SIGNAL)

    def _orphaned(self) -> None:
        """Watch thread: the agent that started this process is gone (SIGKILLed with its node's
        controller, say). Nobody can fence or replace this rank any more: leave at once."""
        self.events.record("orphaned", rank=self._rank, generation=self.generation)
        print(f"hp: rank {self._rank}: the agent that started this process died; exiting", file=sys.stderr, flush=True)
        os._exit(EXIT_ORPHANED)

    def _interrupt(self, signum: int, frame: Any) -> None:
        """Main thread, between two Python bytecodes of the user's step (torch ops run to the end)."""
        if self._interruptible and self._latest > self.generation:
            self._interruptible = False
            raise CollectiveError(f"generation {self.generation} superseded by {self._latest} during the step")

    def _release_pg(self) -> None:
        """Tear the failed group down through the transport (for gloo: destroy, which closes the
        sockets that peers still blocked in one of its collectives wait on). Every tensor handed to
        a collective is kept referenced from Python (grads, vote, agree buffers), so gloo's worker
        threads never need the GIL to free one while the teardown waits for them."""
        with self._pg_lock:
            if self._pg_live:
                self._pg_live = False
                if self._sharded is not None:  # its reference alone would keep the group and its sockets alive
                    self._sharded.unbind()
                self._transport.abort()
                self.events.record("released", generation=self.generation, rank=self._rank)

    def _recover(self, step: Step, exc: Exception) -> None:
        in_step = not isinstance(exc, CollectiveError)
        self.events.record("failure_detected", step=int(step), rank=self._rank, generation=self.generation,
                           error=f"{type(exc).__name__}: {exc}"[:300], in_step=in_step)
        self._release_pg()
        restore_rng(self._rng)
        if self._optimizer is not None:
            self._optimizer.zero_grad(set_to_none=False)
        failed_generation = self.generation
        if in_step:
            self._report("exception", f"{type(exc).__name__}: {exc}")
        self._reform(failed_generation + 1, on_slow=lambda: self._report("collective", str(exc)))

    def _report(self, reason: str, message: str) -> None:
        try:
            answer = self._controller.call("rank_failed", {
                "node_rank": self.node_rank, "generation": self.generation, "rank": self._rank,
                "reason": reason, "message": message[:500]})
        except ControlPlaneError as e:
            if e.status == 409:
                return  # someone already moved the job to a newer generation
            raise
        if answer.get("action") == "exit":
            self.events.record("escalated", rank=self._rank, reason=answer.get("reason"))
            raise JobEnded(EXIT_ESCALATED)

    def _join(self) -> None:
        if self.role == "spare":
            self._prepare_receive_buffer(self._store)  # now, if the job published its size: ready means ready
            cpu = os.times()
            self.events.record("spare_ready", spare=self.spare_id, cpu_s=round(cpu.user + cpu.system, 3))
            self._report_ready()
            self._rank, generation = membership.wait_for_assignment(self._store, self.spare_id,
                                                                    on_idle=self._prepare_receive_buffer)
            self.role = "worker"
            self.events.record("assigned", spare=self.spare_id, rank=self._rank, generation=generation)
            self._faults.armed = False
            self._reform(generation)
        else:
            self._reform(self._start_generation)

    def _report_ready(self) -> None:
        """Tell the controller this spare is ready, so that it goes before spares still starting.
        Best effort: a spare the controller never heard from is still promoted when none is ready."""
        try:
            self._controller.call("spare_ready", {"node_rank": self.node_rank, "spare": self.spare_id})
        except ControlPlaneError as e:
            self.events.record("spare_ready_unreported", spare=self.spare_id, error=str(e)[:300])

    def _prepare_receive_buffer(self, store: dist.Store) -> None:
        """Spare, while waiting: allocate and fault in the buffer a hydration will land in. Page faults
        into fresh memory cost several times the transfer itself (INFRA.md "Measured floors")."""
        if self._receive_buffer is not None or not store.check([membership.STATE_NBYTES_KEY]):
            return
        nbytes = int(store.get(membership.STATE_NBYTES_KEY))
        self._receive_buffer = state.StateBuffer(None, torch.zeros(nbytes + (nbytes >> 6), dtype=torch.uint8))
        self.events.record("receive_buffer_ready", nbytes=nbytes)

    def _publish_state_size(self) -> None:
        """Rank 0, after its first commit (when lazily created optimizer state exists)."""
        self._size_published = True
        if self._sharded is None and self._rank == 0:
            self._store.set(membership.STATE_NBYTES_KEY, str(state.wire_nbytes(self._capture())))

    def _reform(self, minimum: int, on_slow=None) -> None:
        """Form the newest generation >= ``minimum`` and bring this rank to the agreed step,
        retrying with the next generation if a peer fails meanwhile."""
        while True:
            plan = membership.wait_for_generation(self._store, minimum, on_slow=on_slow)
            if plan.state != "running":
                raise JobEnded(f"hp: job {plan.state}: {plan.reason}")
            try:
                self._form(plan)
                return
            except sharded.ShardLost as e:
                self._report("unrecoverable", str(e))
                raise JobEnded(f"hp: {e}") from None
            except (CollectiveError, membership.Superseded, state.StateTransferError, RuntimeError) as e:
                self.events.record("reform_failed", generation=plan.generation, rank=self._rank, error=str(e)[:300])
                self._release_pg()
                # a dead peer is reported by its agent; a failure every process survived (every rank
                # inside this re-form, none in a step) is reported by nobody else: ask when it is slow
                message = f"re-forming generation {plan.generation} failed: {e}"
                minimum, on_slow = plan.generation + 1, lambda message=message: self._report("collective", message)

    def _form(self, plan: membership.Plan) -> None:
        if plan.holders.get(self._rank) != self.holder:
            self.events.record("fenced_out", rank=self._rank, generation=plan.generation, holder=self.holder)
            raise JobEnded(f"hp: fenced out: rank {self._rank} of generation {plan.generation} is held by "
                           f"{plan.holders.get(self._rank)!r}, not by this process ({self.holder!r})")
        membership.arrive(self._store, plan.generation, plan.world_size)
        with self._pg_lock:
            self.generation = plan.generation
            self._transport.init_process_group(self._store, self._rank, plan.world_size, plan.generation,
                                               self._pg_timeout)
            self._pg_live = True
        self.world_size = plan.world_size
        self.events.record("pg_ready", generation=plan.generation, rank=self._rank)
        if self._factories is not None:
            self._build_optimizer()
        if self._sharded is not None:
            self._sharded.rebind(self._rank, plan.world_size)
        # every rank's committed step (row 0) and, with a sharded optimizer, its shard versions (rows 1-3)
        info = self._agree = torch.zeros(4, plan.world_size, dtype=torch.int64)  # kept: see _release_pg
        sh = self._sharded
        info[:, self._rank] = torch.tensor([self.committed, sh.version if sh else -1,
                                            sh.replica_version if sh else -1, self._grads_step])
        self._collective(dist.all_reduce, info)
        newest = int(info[0].max())
        source = int((info[0] == newest).nonzero()[0])
        behind = [r for r in range(plan.world_size) if info[0, r] < newest]
        if newest < 0 and self._restore("job start"):
            pass  # a job started again: the newest checkpoint, if there is one
        elif sh is None:
            hydration.replicated(self, behind, source, newest, plan.generation)
        else:
            try:
                hydration.sharded_optimizer(self, sharded.Versions(*info.tolist()), behind, source, newest,
                                            plan.generation)
            except sharded.ShardLost as e:  # no peer has it: down the ladder, if there is a checkpoint
                if not self._restore(str(e)):
                    raise
        self.events.record("resumed", rank=self._rank, step=self.committed, generation=plan.generation)

    def _restore(self, why: str) -> bool:
        """Job-level rung: every rank loads the newest checkpoint (a collective decision)."""
        found = ladder.restore(self) if self._checkpoint is not None else None
        if found is None:
            return False
        step, tier = found
        self.committed, self._rng = step, capture_rng()
        if self._sharded is not None:
            self._sharded.replicate(self._rank, self._collective)
        self.events.record("restored", rank=self._rank, step=step, tier=tier, why=why[:300], generation=self.generation)
        if self._rank == 0:
            print(f"hp: restored step {step} from the {tier} tier ({why})", file=sys.stderr, flush=True)
        return True

    def _save_checkpoint(self, step: int) -> None:
        """After a commit, when due. A failed save costs that checkpoint, never the training: storage
        trouble is not a peer failure, and a peer that died in DCP's collectives is caught by the next
        step's (the watch thread has seen the new generation by then)."""
        try:
            ladder.save(self, step)
            return
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            error = f"{type(e).__name__}: {str(e)[:300]}"
        self.events.record("checkpoint_failed", rank=self._rank, step=step, error=error)
        if self._rank == 0:
            print(f"hp: warning: checkpoint of step {step} failed, training goes on: {error}", file=sys.stderr, flush=True)

    def _capture(self) -> dict:
        extra = self._extra.state_dict() if self._extra is not None else None
        return state.capture(self._model, self._optimizer, self._scheduler, extra=extra)

    def close(self) -> None:
        """Leave the job: stop the watch thread, destroy the process group. Idempotent."""
        self._interruptible = False
        self._watch.stop()
        with self._pg_lock:
            if self._pg_live and dist.is_initialized():
                self._pg_live = False
                dist.destroy_process_group()
        self.events.close()


def recoverable(fn):
    """Decorator: run ``fn(ctx, *args, **kwargs)`` with a :class:`Context` under ``hp run``.

    Survivors of a failure stay inside ``fn``; the failed step is replayed by ``ctx.steps()``.
    """
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ctx = Context()
        try:
            return fn(ctx, *args, **kwargs)
        finally:
            ctx.close()

    return wrapper

"""NVIDIA's in-process restart (``nvidia-resiliency-ext``): the training script of the NVRx variant.

One process per rank, started as plain processes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` in the environment, as ``srun`` starts them): NVRx's examples say ``torchrun`` is not
fit for it, since torchrun tears every local worker down when one process dies, and then only
transient faults (exceptions) could be recovered in process. :mod:`hp.chaos.baselines.nvrx_bench`
launches ``nproc + 1`` processes; NVRx keeps ``nproc`` active and the last one idle as a spare
(``Compose(MaxActiveWorldSize(nproc), ShiftRanks())``, its documented way to pre-start spares).

The layout is NVRx's "optimal" example: what does not depend on the process group (the token cache,
the model, the optimizer, the scheduler, the application's TCPStore) is built once in :func:`main`;
only :func:`train`, wrapped by ``inprocess.Wrapper``, runs again after a fault, in the same process,
at the next restart iteration, with ``RANK``/``WORLD_SIZE`` renumbered by NVRx. It trains the model of
``hp demo`` on the same tokens, batches (a pure function of step, rank and world), seed, optimizer
and schedule as hp and :mod:`hp.chaos.baselines.torchrun_dcp`, with DDP over gloo.

NVRx never replaces a process and moves no state: a promoted spare starts with the initial weights
and an empty optimizer. So after a restart every active rank joins a broadcast from rank 0 (a
survivor: ShiftRanks keeps survivors first and the spare last): model parameters and buffers,
optimizer state, scheduler, step counter and the RNG state captured at the last commit, tensor by
tensor as an NVRx user writes it. Then the interrupted step is replayed.

On CPU gloo NVRx's abort must destroy the gloo group (:class:`GlooAbort`; its CUDA health check stays
off) and the gloo timeout is short: a rank blocked in a gloo collective takes NVRx's asynchronous
exception only once gloo returns. ``--nvrx`` (JSON, seconds) sets the ``Wrapper``'s intervals and
timeouts; missing ones keep NVRx's defaults.

Events (per-rank JSONL, :class:`hp.checkpointless.events.EventLog`, ``rank`` is the active rank,
``initial_rank`` the launch rank, ``iteration`` NVRx's restart iteration): ``started``, ``imported``,
``data_attached``, ``model_ready`` (once per process); ``fault_injected`` (the killed rank);
``failure_detected`` (``source``: ``nvrx_monitor`` when NVRx's monitor thread starts the abort,
``collective`` when a gloo call failed in the main thread); ``released`` (the abort destroyed the
group); ``step_failed`` (the main thread left the wrapped function); ``assigned`` (an iteration
begins after NVRx's barrier and rank assignment: ``mode`` active or inactive); ``pg_ready``;
``hydrated``; ``restored`` (back in the loop with the state of step ``step``); ``commit`` per step
(``loss``: the all-reduced mean as exact float hex, ``local``: this rank's own); ``final_state``.
"""

import argparse
import json
import os
import signal
from datetime import timedelta
from typing import Any

from hp.chaos.baselines.torchrun_dcp import add_model_args, corpus_key, process_start_time
from hp.core.protocol import Event

MODULE = "hp.chaos.baselines.nvrx_train"
JOB_ENV = "HP_NVRX_JOB"  # set by the launcher; NVRx's monitor daemons inherit it (how they are found)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--fault-step", type=int, default=-1, help="rank --fault-rank dies after this step (-1: never)")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--active", type=int, required=True, help="active ranks; the others are NVRx spares")
    p.add_argument("--log-dir", required=True, help="events/ and NVRx's monitor logs go here")
    p.add_argument("--nvrx-port", type=int, required=True, help="port of NVRx's own TCPStore")
    p.add_argument("--nvrx", default="{}", help="JSON: inprocess.Wrapper's timedelta arguments, in seconds")
    p.add_argument("--gloo-timeout", type=float, default=2.0, help="seconds")
    add_model_args(p)
    return p.parse_args(argv)


class Job:
    """What survives a restart in this process: built once, reused by every restart iteration."""

    def __init__(self, args: argparse.Namespace, events: Any, initial_rank: int) -> None:
        self.args, self.events, self.initial_rank = args, events, initial_rank
        self.rank: int | None = initial_rank  # the active rank (None while idle)
        self.iteration = 0
        self.committed = -1  # last step this process's state holds
        self.rng: Any = None  # torch RNG state at the last commit (a replayed step starts from it)
        self.ddp: Any = None  # held here, not in a frame a traceback keeps: a restart must free it
        self.model = self.optimizer = self.scheduler = self.batches = self.store = None

    def record(self, event: str, **fields: Any) -> None:
        fields.setdefault("rank", self.rank)
        self.events.record(event, initial_rank=self.initial_rank, iteration=self.iteration, **fields)


def _pin(rank: int) -> None:
    from hp.core.devices import pin_to_core

    pin_to_core(rank)


def _tag(x: Any) -> Any:
    """Tuples survive JSON as ``{"__tuple__": [...]}`` (an optimizer's ``betas`` must stay a tuple:
    the state is compared bit for bit, structure included)."""
    if isinstance(x, tuple):
        return {"__tuple__": [_tag(v) for v in x]}
    if isinstance(x, list):
        return [_tag(v) for v in x]
    if isinstance(x, dict):
        return {k: _tag(v) for k, v in x.items()}
    return x


def _untag(x: Any) -> Any:
    if isinstance(x, dict):
        return tuple(_untag(v) for v in x["__tuple__"]) if set(x) == {"__tuple__"} else {k: _untag(v) for k, v in x.items()}
    return [_untag(v) for v in x] if isinstance(x, list) else x


def _broadcast_json(obj: Any, rank: int, src: int) -> Any:
    """A JSON value from rank ``src`` to every rank: its length, then its UTF-8 bytes, as tensors (a
    peer's bytes are never unpickled, which ``broadcast_object_list`` would do)."""
    import torch
    import torch.distributed as dist

    data = json.dumps(_tag(obj)).encode() if rank == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == src else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=src)
    return _untag(json.loads(bytes(buf.numpy())))


def hydrate(job: Job, rank: int, src: int = 0) -> int:
    """Every active rank: rank ``src``'s model, optimizer, scheduler, step and RNG, by broadcast.

    Small things go as JSON (:func:`_broadcast_json`), tensors one ``broadcast`` each. Returns the
    bytes of tensors broadcast."""
    import torch
    import torch.distributed as dist

    model, optimizer, scheduler = job.model, job.optimizer, job.scheduler
    if rank == src:
        osd = optimizer.state_dict()
        layout = {str(pid): {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                             if torch.is_tensor(v) else v for k, v in s.items()} for pid, s in osd["state"].items()}
        meta = {"step": job.committed, "scheduler": scheduler.state_dict(), "rng": job.rng.tolist(),
                "param_groups": osd["param_groups"], "layout": layout}
        state = osd["state"]
    meta = _broadcast_json(meta if rank == src else None, rank, src)
    if rank != src:
        state = {int(pid): {k: torch.empty(v["shape"], dtype=getattr(torch, v["dtype"])) if isinstance(v, dict) else v
                            for k, v in s.items()} for pid, s in meta["layout"].items()}
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [state[pid][k] for pid in sorted(state) for k in sorted(state[pid]) if torch.is_tensor(state[pid][k])]
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t, src=src)
    if rank != src:
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        scheduler.load_state_dict(meta["scheduler"])
        job.committed = meta["step"]
    job.rng = torch.tensor(meta["rng"], dtype=torch.uint8)
    torch.set_rng_state(job.rng)
    return sum(t.numel() * t.element_size() for t in tensors)


def train(job: Job, call_wrapper: Any) -> None:
    """The function NVRx restarts: process group, (after a fault) hydration, the step loop."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from hp.checkpointless.registry import digest
    from torch.nn.parallel import DistributedDataParallel as DDP

    args = job.args
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # renumbered by NVRx
    it = call_wrapper.iteration
    job.rank, job.iteration = rank, it
    step = job.committed + 1
    try:
        job.ddp = None
        dist.init_process_group("gloo", store=dist.PrefixStore(f"iteration{it}", job.store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=args.gloo_timeout))
        job.record(Event.PG_READY, world=world)
        if it > 0:
            nbytes = hydrate(job, rank)
            job.record(Event.HYDRATED, step=job.committed, bytes=nbytes)
        job.ddp = DDP(job.model, init_sync=it == 0)  # after a restart the broadcast above synced it
        job.record(Event.RESTORED, step=job.committed)
        for step in range(job.committed + 1, args.steps):
            if it == 0 and rank == args.fault_rank and step == args.fault_step + 1:
                job.record(Event.FAULT_INJECTED, kind="kill", step=args.fault_step, at_step=step, phase="forward")
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = job.batches.get(step, rank, world)
            job.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(job.ddp(x).flatten(0, 1), y.flatten())
            loss.backward()
            local = loss.detach().item()
            votes = torch.zeros(world, dtype=torch.float64)  # every rank's loss in its slot, as hp's vote
            votes[rank] = local
            dist.all_reduce(votes)
            total = 0.0
            for v in votes.tolist():  # in slot order: the same bits on every rank
                total += v
            mean = total / world
            with call_wrapper.atomic():  # NVRx's guard: no restart may land inside the update
                job.optimizer.step()
                job.scheduler.step()
                job.committed, job.rng = step, torch.get_rng_state()
            job.record(Event.COMMIT, step=step, loss=mean.hex(), local=local.hex(), world=world)
        parts = {"params": dict(job.model.named_parameters()), "buffers": dict(job.model.named_buffers()),
                 "optimizer": job.optimizer.state_dict(), "scheduler": job.scheduler.state_dict()}
        job.record(Event.FINAL_STATE, step=job.committed, digests={k: digest(v) for k, v in parts.items()})
        dist.barrier()  # no rank closes its sockets while a peer still waits on the last collective
    except BaseException as e:  # noqa: BLE001  NVRx's RankShouldRestart is a BaseException: re-raised
        if "RankShouldRestart" not in type(e).__name__:
            job.record(Event.FAILURE_DETECTED, source="collective", step=step, error=f"{type(e).__name__}: {e}"[:300])
        job.record(Event.STEP_FAILED, step=step, error=type(e).__name__)
        raise


def wrapper(job: Job, settings: dict[str, Any]) -> Any:
    """``inprocess.Wrapper`` as this job configures it (``settings``: seconds, NVRx's names)."""
    import torch.distributed as dist
    from nvidia_resiliency_ext import inprocess

    class GlooAbort(inprocess.abort.Abort):
        """NVRx's abort for gloo: destroy the process group (a blocked gloo call returns at its timeout)."""

        def __call__(self, state: Any) -> Any:
            job.record(Event.FAILURE_DETECTED, source="nvrx_monitor")
            if dist.is_initialized():
                dist.destroy_process_group()
            job.record(Event.RELEASED)
            return state

    class Assigned(inprocess.initialize.Initialize):
        """Each iteration's start (after NVRx's barrier and rank assignment): record it, re-pin the core."""

        def __call__(self, state: Any) -> Any:
            job.iteration = state.iteration
            job.rank = state.active_rank
            _pin(state.active_rank if state.active_rank is not None else state.rank)
            job.record(Event.ASSIGNED, mode=state.mode.name.lower(), world=state.active_world_size)
            if state.mode.name == "INACTIVE":
                job.record(Event.SPARE_READY)
            return state

    assignment = inprocess.Compose(inprocess.rank_assignment.MaxActiveWorldSize(job.args.active),
                                   inprocess.rank_assignment.ShiftRanks())
    kwargs = {k: timedelta(seconds=v) for k, v in settings.items()}
    log_file = os.path.join(os.path.abspath(job.args.log_dir), "nvrx-monitor-{rank}.log")

    # NVRx hands its CallWrapper to the parameter annotated with that class (no string annotations here)
    def restartable(job, call_wrapper: inprocess.CallWrapper = None):
        return train(job, call_wrapper)

    return inprocess.Wrapper(store_kwargs={"port": job.args.nvrx_port, "timeout": timedelta(seconds=120)},
                             abort=GlooAbort(), initialize=Assigned(), health_check=None,
                             rank_assignment=assignment, monitor_process_logfile=log_file, **kwargs)(restartable)


def main(argv: list[str] | None = None) -> None:
    started = process_start_time()
    args = parse_args(argv)
    initial_rank = int(os.environ["RANK"])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _pin(initial_rank)

    from hp.checkpointless.events import EventLog

    job = Job(args, EventLog(os.path.join(args.log_dir, "events"), f"rank{initial_rank}"), initial_rank)
    job.record(Event.STARTED, at=started)
    import logging

    import torch
    import torch.distributed as dist
    from hp.checkpointless.data import Batches, TokenCache, synthetic_corpus, tokenize
    from hp.checkpointless.demo.model import build_model

    torch.set_num_threads(1)
    job.record(Event.IMPORTED)
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO)
    cache = TokenCache.open(corpus_key(args.corpus_mb, args.vocab, args.seed),
                            lambda: tokenize(synthetic_corpus(args.corpus_mb << 20, args.seed), args.vocab))
    job.batches = Batches(cache, args.seq, args.batch_size, args.seed)
    job.record(Event.DATA_ATTACHED)
    torch.manual_seed(args.seed)
    job.model = build_model(args.model_size, args.vocab, args.seq, args.dropout)
    job.optimizer = torch.optim.AdamW(job.model.parameters(), lr=3e-3)
    job.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(job.optimizer, T_max=args.steps)
    job.rng = torch.get_rng_state()
    # the application's store (process groups live under a per-iteration prefix of it), NVRx's on its own port
    job.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              world_size=int(os.environ["WORLD_SIZE"]), is_master=initial_rank == 0,
                              multi_tenant=True, wait_for_workers=True, use_libuv=True,
                              timeout=timedelta(seconds=120))
    job.record(Event.MODEL_READY)
    wrapper(job, json.loads(args.nvrx))(job)
    job.events.close()
    # as torchrun_dcp: leave without tearing torch down (a gloo group's destructor can deadlock)
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()

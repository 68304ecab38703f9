"""Elastic checkpoint-restart: the job ``hp bench elastic`` compares hp's in-process re-forms against.

    torchrun --nnodes 1:3 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT \\
        --rdzv-id RUN --max-restarts 20 --monitor-interval 0.1 \\
        -m hp.chaos.baselines.train_elastic_torchrun --steps 40 --global-batch 24 --micro-batch 4 \\
        --ckpt-every 5 --log-dir DIR

What an experienced user runs today when the job must survive faults and changing capacity:
``torchrun`` with an elastic ``c10d`` rendezvous, plain DDP on gloo, AdamW, and DCP
(``torch.distributed.checkpoint``) checkpoints. Any membership change ends every worker process;
the new ones re-import torch, re-form the process group at the new world size, load the newest
complete checkpoint and go on from there. The model, corpus and token cache are those of
``hp demo`` (:func:`hp.checkpointless.demo.model.build_model`, :mod:`hp.checkpointless.data`).

**Constant global batch.** A step is ``M = global_batch / micro_batch`` micro-batches; micro-batch
``m`` of step ``s`` is a pure function of ``(seed, s, m)`` (the samples at positions
``s*G + m*mb ...`` of the shuffled stream, and a dropout seed of its own), never of the world size;
rank ``r`` of ``W`` computes a contiguous block of them (the first ``M % W`` ranks one more), with
gradient accumulation under ``no_sync`` and each micro-batch's loss scaled by ``W / M`` so DDP's
average over ``W`` is the mean over the ``M`` micro-batches at any ``W`` (uneven splits included).
The same rules as :mod:`hp.elastic.ownership`, restated here: the baseline is plain torchrun + DDP
+ DCP, with no hp module in its processes. The learning rate does not change with ``W`` (the global batch does not).

**Checkpoints.** A synchronous ``dcp.save`` after every step ``s`` with ``s % ckpt_every == 0``
(s > 0) into ``<log-dir>/ckpt/step<s>``: at this model size a save takes tens of milliseconds, and
synchronous saves leave no in-flight checkpoint for a kill to tear (``async_save`` would hide the
save's cost but not change what a restart costs). On start every process loads the newest complete
one (DCP's coordinator writes ``.metadata`` last; a torn directory is skipped); DCP reshards a
checkpoint written at another world size on load.

**Graceful preemption** (``--save-on-sigterm``, on by default, as e.g. NeMo's PreemptionCallback
does): SIGTERM (torchrun sends it to its workers when its node is preempted, and when it restarts
them for a membership change) only sets a flag; after every step the ranks all-reduce the flags
with the step's loss, and if any rank was signalled, every rank saves a checkpoint of that step
and exits (code 143), so a graceful event loses no step. A SIGTERM before the step loop ends the
process at once. ``--no-save-on-sigterm`` gives the plain behaviour (a SIGTERM kills the worker;
the steps since the last periodic checkpoint are recomputed).

**Log.** Every rank appends JSON lines (:class:`hp.checkpointless.events.EventLog`) to
``<log-dir>/events/``: ``started`` (the process's exec time), ``pg_ready``, ``restored`` (the
checkpoint step loaded), one ``commit`` per step (``step``, ``world``, ``t`` from ``time.time()``,
the global mean loss as exact float hex), ``checkpoint_saved``, ``sigterm``, ``failure_detected``.
Each line carries the worker's ``pid``, its agent's ``agent_pid`` (the torchrun that started it),
``rank``, ``world``, ``group_rank`` and ``restart_count``, so the harness
(:mod:`hp.chaos.baselines.elastic_torchrun`) can compute pauses and lost steps from timestamps.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

from hp.chaos.baselines.torchrun_dcp import corpus_key, newest_checkpoint, process_start_time
from hp.checkpointless.demo.workload import add_workload_args

MODULE = "hp.chaos.baselines.train_elastic_torchrun"
SIGTERM_EXIT = 128 + signal.SIGTERM  # what a worker stopped by SIGTERM returns (after its save)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--global-batch", type=int, default=24, help="samples per step, at any world size")
    p.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch (divides --global-batch)")
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--save-on-sigterm", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--log-dir", required=True, help="events/ and ckpt/ go here")
    add_workload_args(p)  # --seq --vocab --model-size --dropout --corpus-mb --seed
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--pg-timeout", type=float, default=60.0, help="gloo collective timeout, seconds")
    args = p.parse_args(argv)
    if args.global_batch % args.micro_batch:
        p.error(f"--micro-batch {args.micro_batch} does not divide --global-batch {args.global_batch}")
    return args


def owned(m_total: int, rank: int, world: int) -> range:
    """Micro-batches of a step that ``rank`` of ``world`` computes: a contiguous block (hp.elastic.ownership)."""
    q, e = divmod(m_total, world)
    start = rank * q + min(rank, e)
    return range(start, start + q + (1 if rank < e else 0))


def micro_batch_seed(seed: int, step: int, m: int) -> int:
    """Dropout seed of micro-batch ``m`` of ``step``: W plays no part (hp.elastic.ownership's formula)."""
    digest = hashlib.blake2b(f"hp.elastic/{seed}/{step}/{m}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _Stop:
    """SIGTERM handling: before the step loop, exit at once; inside it, stop at the step's end."""

    def __init__(self, graceful: bool) -> None:
        self.graceful, self.in_loop, self.requested, self.at = graceful, False, False, None

    def handler(self, signum: int, frame: Any) -> None:
        if not (self.graceful and self.in_loop):
            os._exit(SIGTERM_EXIT)
        self.requested, self.at = True, time.time()


def main(argv: list[str] | None = None) -> None:
    started = process_start_time()
    args = parse_args(argv)
    stop = _Stop(args.save_on_sigterm)
    signal.signal(signal.SIGTERM, stop.handler)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ident = {"rank": rank, "world": world, "agent_pid": os.getppid(),
             "group_rank": int(os.environ.get("GROUP_RANK", "0")),
             "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    m_total = args.global_batch // args.micro_batch
    if world > m_total:
        raise SystemExit(f"world size {world} > {m_total} micro-batches per step: some rank would have no work")

    from hp.checkpointless.events import EventLog

    events = EventLog(os.path.join(args.log_dir, "events"), f"rank{rank}-w{world}")

    def record(event: str, **fields: Any) -> None:
        events.record(event, **ident, **fields)

    record("started", at=started)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from hp.checkpointless.data import Batches, TokenCache, synthetic_corpus, tokenize
    from hp.checkpointless.demo.model import build_model
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    record("imported")
    cache = TokenCache.open(corpus_key(args.corpus_mb, args.vocab, args.seed),
                            lambda: tokenize(synthetic_corpus(args.corpus_mb << 20, args.seed), args.vocab))
    micro = Batches(cache, args.seq, args.micro_batch, args.seed)  # get(s, m, M): micro-batch m of step s
    record("data_attached")

    # env:// as torchrun users write it: MASTER_ADDR/PORT name the TCPStore that the group-rank-0
    # agent hosts for its workers (shared across rendezvous rounds since torch 2.4).
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    record("pg_ready")

    torch.manual_seed(args.seed)
    model = DDP(build_model(args.model_size, args.vocab, args.seq, args.dropout))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    record("model_ready")

    def app_state(step: int) -> dict[str, Any]:
        msd, osd = get_state_dict(model, optimizer)
        return {"model": msd, "optim": osd, "sched": scheduler.state_dict(), "step": step}

    ckpt_dir = os.path.join(args.log_dir, "ckpt")

    def save(step: int, why: str) -> None:
        t0 = time.monotonic()
        dcp.save(app_state(step), checkpoint_id=os.path.join(ckpt_dir, f"step{step:08d}"))
        record("checkpoint_saved", step=step, why=why, duration_s=time.monotonic() - t0)

    start, newest = 0, newest_checkpoint(ckpt_dir)
    if newest is not None:
        t0 = time.monotonic()
        state = app_state(-1)
        dcp.load(state, checkpoint_id=newest[1])
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scheduler.load_state_dict(state["sched"])
        start = int(state["step"]) + 1
        record("restored", step=start - 1, checkpoint=newest[1], duration_s=time.monotonic() - t0)
    else:
        record("restored", step=-1, checkpoint=None, duration_s=0.0)

    mine = owned(m_total, rank, world)
    scale = world / m_total  # DDP averages over W: sum over ranks of (W/M) * loss_m / W = mean over M
    step = start
    stop.in_loop = True
    try:
        for step in range(start, args.steps):
            optimizer.zero_grad(set_to_none=True)
            local = 0.0
            for i, m in enumerate(mine):
                torch.manual_seed(micro_batch_seed(args.seed, step, m))
                x, y = micro.get(step, m, m_total)
                last = i == len(mine) - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                    (loss * scale).backward()
                local += loss.detach().item()
            optimizer.step()
            scheduler.step()
            # one small collective per step: the global mean loss, and whether any rank got SIGTERM
            flags = torch.tensor([local / m_total, 1.0 if stop.requested else 0.0], dtype=torch.float64)
            dist.all_reduce(flags)
            record("commit", step=step, loss=float(flags[0]).hex())
            saved = step > 0 and step % args.ckpt_every == 0
            if saved:
                save(step, "periodic")
            if flags[1] > 0:  # a graceful stop: keep this step, then leave for the next rendezvous
                if not saved:
                    save(step, "sigterm")
                record("stopped", step=step, signalled=stop.requested, signalled_at=stop.at)
                events.close()
                os._exit(SIGTERM_EXIT)
    except Exception as e:  # a peer died or left: gloo raises here; torchrun restarts the group
        record("failure_detected", step=step, error=f"{type(e).__name__}: {e}"[:300])
        events.close()
        traceback.print_exc()
        sys.stderr.flush()
        # no interpreter teardown: destroying a failed gloo group can deadlock (INFRA.md)
        os._exit(1)
    stop.in_loop = False
    # Leave without tearing torch down (as torchrun_dcp does); the barrier keeps a rank from
    # closing its sockets while a peer still waits on the last collective.
    dist.barrier()
    record("finished", step=step)
    events.close()
    os._exit(0)


if __name__ == "__main__":
    main()

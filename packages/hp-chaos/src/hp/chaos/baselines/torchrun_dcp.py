"""Traditional checkpoint-restart: plain DDP on gloo + DCP checkpoints, restarted by ``torchrun``.

    torchrun --nproc-per-node 4 --max-restarts 1 --monitor-interval 0.1 \\
        -m hp.chaos.baselines.torchrun_dcp --steps 14 --fault-step 12 --ckpt-every 10 --log-dir DIR

Why it exists: hp's recovery numbers only mean something next to what users do today on the
*same* job. So this trains the model of ``hp demo`` (:func:`hp.checkpointless.demo.model.build_model`)
on the same mmap-cached tokens and batches, with the same optimizer and schedule, and saves a DCP
checkpoint after every step ``s`` with ``s % ckpt_every == 0`` (s > 0). In attempt 0 the fault rank
SIGKILLs itself right after finishing ``--fault-step``; torchrun tears the group down and starts every
rank again, which re-imports torch, re-forms the process group, rebuilds the model, loads the newest
checkpoint and recomputes the steps after it.

Each rank appends timestamped events (``started`` at the process's exec time, ``imported``,
``data_attached``, ``pg_ready``, ``model_ready``, ``restored``, ``commit`` per step with the loss as
exact float hex, ``checkpoint_saved``, ``fault_injected``) to ``<log-dir>/events``, so
:mod:`hp.chaos.bench.recovery` can say where the downtime goes. Heavy imports happen inside
:func:`main`, after ``started`` is taken: they are part of what a restart costs.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta
from typing import Any

from hp.checkpointless.demo.workload import add_workload_args
from hp.core.devices import pin_to_core
from hp.core.protocol import Event

MODULE = "hp.chaos.baselines.torchrun_dcp"


def process_start_time() -> float:
    """Wall-clock time at which this process started (from /proc: clock ticks since boot).

    The interpreter's own start-up happens before any Python line runs; measuring from the kernel's
    start time charges it to the restart, where it belongs."""
    with open("/proc/self/stat") as f:
        after_comm = f.read().rsplit(")", 1)[1].split()
    start_ticks = int(after_comm[19])  # field 22 of proc(5); fields after "comm)" start at field 3
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--fault-step", type=int, default=-1, help="rank --fault-rank dies after this step (-1: never)")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--log-dir", required=True, help="events/ and ckpt/ go here")
    add_model_args(p)
    return p.parse_args(argv)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model and data every baseline script trains: the same shape, tokens and seed as hp's demo."""
    add_workload_args(p)  # --seq --vocab --model-size --dropout --corpus-mb --seed
    p.add_argument("--batch-size", type=int, default=8)


def corpus_key(corpus_mb: int, vocab: int, seed: int) -> str:
    """The token-cache key of ``hp.checkpointless.demo.train``: both jobs attach the same file."""
    return f"hp-demo-{corpus_mb}mb-v{vocab}-s{seed}"


def newest_checkpoint(ckpt_dir: str) -> tuple[int, str] | None:
    """(step, path) of the newest *complete* checkpoint: DCP's coordinator writes ``.metadata`` last."""
    found = []
    for name in os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []:
        path = os.path.join(ckpt_dir, name)
        if name.startswith("step") and os.path.exists(os.path.join(path, ".metadata")):
            found.append((int(name[4:]), path))
    return max(found) if found else None


def main(argv: list[str] | None = None) -> None:
    started = process_start_time()
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    from hp.checkpointless.events import EventLog

    events = EventLog(os.path.join(args.log_dir, "events"), f"rank{rank}-attempt{attempt}")

    def record(event: str, **fields: Any) -> None:
        events.record(event, rank=rank, attempt=attempt, **fields)

    record(Event.STARTED, at=started)
    pin_to_core(rank)  # HP_PIN_CORES=1 (hp bench recovery): one rank per core
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from hp.checkpointless.data import Batches, TokenCache, synthetic_corpus, tokenize
    from hp.checkpointless.demo.model import build_model
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    record(Event.IMPORTED)
    cache = TokenCache.open(corpus_key(args.corpus_mb, args.vocab, args.seed),
                            lambda: tokenize(synthetic_corpus(args.corpus_mb << 20, args.seed), args.vocab))
    batches = Batches(cache, args.seq, args.batch_size, args.seed)
    record(Event.DATA_ATTACHED)

    # torchrun's static rendezvous keeps one TCPStore across restarts: a restarted attempt must not
    # read the dead attempt's keys, so the process group lives under a per-attempt prefix
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    record(Event.PG_READY)

    torch.manual_seed(args.seed)
    model = DDP(build_model(args.model_size, args.vocab, args.seq, args.dropout))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    record(Event.MODEL_READY)

    def app_state(step: int) -> dict[str, Any]:
        msd, osd = get_state_dict(model, optimizer)
        return {"model": msd, "optim": osd, "sched": scheduler.state_dict(), "rng": torch.get_rng_state(),
                "step": step}

    ckpt_dir = os.path.join(args.log_dir, "ckpt")
    start, newest = 0, newest_checkpoint(ckpt_dir)
    if newest is not None:
        state = app_state(-1)
        dcp.load(state, checkpoint_id=newest[1])
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scheduler.load_state_dict(state["sched"])
        torch.set_rng_state(state["rng"])
        start = int(state["step"]) + 1
    record(Event.RESTORED, step=start - 1, checkpoint=newest[1] if newest else None)

    step = start
    try:
        for step in range(start, args.steps):
            x, y = batches.get(step, rank, world)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            record(Event.COMMIT, step=step, loss=loss.detach().item().hex())
            if step > 0 and step % args.ckpt_every == 0:
                t0 = time.monotonic()
                dcp.save(app_state(step), checkpoint_id=os.path.join(ckpt_dir, f"step{step:08d}"))
                record(Event.CHECKPOINT_SAVED, step=step, duration_s=time.monotonic() - t0)
            if attempt == 0 and rank == args.fault_rank and step == args.fault_step:
                record(Event.FAULT_INJECTED, kind="kill", step=step)
                os.kill(os.getpid(), signal.SIGKILL)
    except Exception as e:  # a peer died: gloo raises here; torchrun restarts the whole group anyway
        record(Event.FAILURE_DETECTED, step=step, error=f"{type(e).__name__}: {e}"[:300])
        raise
    # Leave without tearing torch down: destroying the DDP reducer's gloo group can deadlock (its
    # destructor joins a gloo thread while holding the GIL that thread needs, INFRA.md), and a hung
    # exit would be charged to nobody but still stall torchrun. The barrier keeps a rank from
    # closing its sockets while a peer still waits on the last collective.
    dist.barrier()
    events.close()
    os._exit(0)


if __name__ == "__main__":
    main()

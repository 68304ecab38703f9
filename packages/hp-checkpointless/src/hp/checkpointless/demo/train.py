"""The `hp demo` training job: a small GPT on the node's mmap-cached corpus, recoverable in process.

    hp run --nproc-per-node 4 --spares 1 -m hp.checkpointless.demo.train --steps 40
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

from hp.checkpointless import StepLoader, StepSampler, recoverable
from hp.checkpointless.overlap import OverlappedMeanReduction
from hp.checkpointless.data import Batches, TokenCache, Windows, synthetic_corpus, tokenize
from hp.checkpointless.demo.model import build_model, shard_model
from hp.checkpointless.demo.workload import add_workload_args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8)
    add_workload_args(p, choices=True)  # --seq --vocab --model-size --dropout --corpus-mb --seed
    p.add_argument("--threads", type=int, default=_default_threads(), metavar="N",
                   help="intra-op threads (torch.set_num_threads); default $OMP_NUM_THREADS, else 1: on more than one "
                        "thread PyTorch's CPU kernels are not bit-reproducible from run to run on a busy machine, and "
                        "this job's verdict is bit-identity (hp run sets 1 itself for several ranks per node)")
    add_checkpoint_args(p)
    p.add_argument("--overlap", action="store_true",
                   help="start the gradient all-reduce during backward (OverlappedMeanReduction)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="with --overlap: the buckets' size")
    p.add_argument("--zero", action="store_true",
                   help="shard the optimizer state (torch ZeroRedundancyOptimizer) instead of replicating it")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the model with FSDP2 (fully_shard) over every rank, on ctx.device_mesh()")
    p.add_argument("--hsdp", type=int, default=0, metavar="R",
                   help="HSDP: R replica groups, the model sharded with FSDP2 within each")
    p.add_argument("--micro-batches", type=int, default=0, metavar="M",
                   help="split each step in M micro-batches of --batch-size samples over every rank "
                        "(step.micro_batches, a constant global batch) instead of one batch per rank")
    p.add_argument("--scaler", action="store_true",
                   help="AMP: bfloat16 autocast around the forward and a torch.amp.GradScaler (its scale, inf/NaN "
                        "skips and state kept by hp; bfloat16 needs no scaling: the CPU stand-in for float16 on a GPU)")
    p.add_argument("--inf-step", type=int, default=None, metavar="K",
                   help="with --scaler: rank --inf-rank's scaled loss is inf at step K (every attempt): the job skips K")
    p.add_argument("--inf-rank", type=int, default=0)
    p.add_argument("--ulp-after-recovery", type=int, default=None, metavar="RANK",
                   help="harness self-test: after the last step, the process holding RANK, if it joined by a "
                        "recovery, moves one weight by one ulp (hp demo must then report the state unequal)")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    return args


def _default_threads() -> int:
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", metavar="NAMESPACE", default=None,
                   help="job-level rung: checkpoint into hp-tiered-ckpt's tiers (daemon from HP_CKPT_DAEMON)")
    p.add_argument("--checkpoint-every", type=int, default=2)
    p.add_argument("--checkpoint-persist-every", type=int, default=None, metavar="N",
                   help="also persist every N steps to HP_CKPT_URL (uploaded by the daemon; only when that is set)")


def job_checkpoint(args: argparse.Namespace):
    """The job-level rung the flags of :func:`add_checkpoint_args` ask for (None: none)."""
    if not args.checkpoint:
        return None
    from hp.tiered_ckpt import TieredConfig  # the "tiered" extra: hp-checkpointless does not depend on hp-tiered-ckpt
    from hp.tiered_ckpt.rung import TieredRung

    persist = {} if args.checkpoint_persist_every is None else {"persist_every": args.checkpoint_persist_every}
    return TieredRung(TieredConfig.from_env(args.checkpoint, memory_every=args.checkpoint_every, **persist))


@recoverable
def main(ctx) -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    corpus_key = f"hp-demo-{args.corpus_mb}mb-v{args.vocab}-s{args.seed}"
    cache = TokenCache.open(corpus_key, lambda: tokenize(synthetic_corpus(args.corpus_mb << 20, args.seed), args.vocab))
    ctx.events.record("data_attached", built=cache.built, open_s=cache.open_s)
    batches = Batches(cache, args.seq, args.batch_size, args.seed)
    loader = None
    if args.micro_batches:
        windows = Windows(cache, args.seq)
        loader = StepLoader(windows, StepSampler(len(windows), micro_batch=args.batch_size,
                                                 micro_batches=args.micro_batches, seed=args.seed))

    # FSDP2/HSDP: the mesh first (a hot spare waits there for its rank: its shards depend on it)
    mesh = ctx.device_mesh(replicate=max(args.hsdp, 1)) if args.fsdp or args.hsdp else None
    torch.manual_seed(args.seed)
    device = ctx.device  # the transport's device for this process (cpu on gloo, cuda:LOCAL_RANK on nccl)
    model = build_model(args.model_size, args.vocab, args.seq, args.dropout).to(device)
    def make_scheduler(optimizer):
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)

    checkpoint = job_checkpoint(args)
    # growth every 3 clean steps: the scale moves within a short job (a state that must be kept exactly)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 12, growth_interval=3) if args.scaler else None
    if mesh is not None:
        shard_model(model, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ctx.register(model, optimizer, make_scheduler(optimizer), checkpoint=checkpoint, scaler=scaler)
    elif args.zero:  # built by hp once the process group exists (a spare has none yet)
        ctx.register(model, lambda params: ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=3e-3),
                     make_scheduler, checkpoint=checkpoint, scaler=scaler)  # with a scaler: refused in one line
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ctx.register(model, optimizer, make_scheduler(optimizer), checkpoint=checkpoint, scaler=scaler,
                     reduction=OverlappedMeanReduction(args.bucket_mb) if args.overlap else None)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16) if scaler is not None else contextlib.nullcontext():
            return model(x)

    def backward(loss: torch.Tensor, step: int) -> None:
        if scaler is None:
            return loss.backward()
        scaled = scaler.scale(loss)
        if step == args.inf_step and ctx.rank == args.inf_rank:
            scaled = scaled * float("inf")  # an overflow in this rank's backward: inf/NaN in every reduced shard
        scaled.backward()

    replacement = os.environ.get("HP_ROLE") == "spare" or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    for step in ctx.steps(args.steps):
        with step:
            if loader is None:
                x, y = (t.to(device) for t in batches.get(step, ctx.rank, ctx.world_size))
                loss = F.cross_entropy(forward(x).flatten(0, 1).float(), y.flatten())
                backward(loss, step)
            else:
                loss = []
                for x, y in step.micro_batches(loader):
                    micro = F.cross_entropy(forward(x.to(device)).flatten(0, 1).float(), y.to(device).flatten())
                    backward(micro, step)
                    loss.append(micro)
            ctx.commit(loss)
            if step == args.steps - 1 and ctx.rank == args.ulp_after_recovery and replacement:
                with torch.no_grad():  # after the last commit: only the final state shows it
                    w = next(model.parameters())
                    w = (w.to_local() if hasattr(w, "to_local") else w).view(-1)
                    w[0] = torch.nextafter(w[0], w[0] + 1)
        if ctx.rank == 0 and ctx.committed == step:
            print(f"step {step:3d} loss {ctx.last_loss:.4f} (generation {ctx.generation})", flush=True)


if __name__ == "__main__":
    main()

"""The elastic demo job: the `hp demo` GPT with a constant global batch, at whatever world size it is given.

    hp run --nnodes 1:2 --nproc-per-node 2 --scaling-policy policy.yaml -m hp.elastic.demo.train --exact

The diff from the fixed-size job (hp.checkpointless.demo.train) is the data (a StepLoader over the
step's micro-batches instead of one batch per rank), the loop over ``step.micro_batches(loader)``, the
per-micro-batch losses given to ``commit``, and the optional exact reduction and LR rule.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

from hp.checkpointless import StepLoader, StepSampler, recoverable
from hp.checkpointless.data import TokenCache, Windows, synthetic_corpus, tokenize
from hp.checkpointless.demo.model import build_model, shard_model
from hp.checkpointless.demo.train import add_checkpoint_args, job_checkpoint
from hp.checkpointless.demo.workload import add_workload_args
from hp.core.protocol import SCALING_POLICY_ENV
from hp.elastic.lr import on_scale_lr
from hp.elastic.policy import ScalingPolicy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--policy", default=os.environ.get(SCALING_POLICY_ENV), help="ScalingPolicy YAML (default: hp run's)")
    add_workload_args(p, choices=True)  # --seq --vocab --model-size --dropout --corpus-mb --seed
    p.add_argument("--exact", action="store_true", help="exact mode: bit-identical at any world size")
    p.add_argument("--zero", action="store_true",
                   help="shard the optimizer state (ZeroRedundancyOptimizer), resharded at every scale event")
    p.add_argument("--hsdp-shard", type=int, default=0, metavar="S",
                   help="shard the model with FSDP2 over shard groups of S ranks, replicated across them (HSDP, "
                        "ctx.device_mesh(shard=S)): the job shrinks and grows by whole replica groups (policy unit S)")
    add_checkpoint_args(p)  # a preempted job saves its last committed step there
    return p.parse_args(argv)


@recoverable
def main(ctx) -> None:
    args = parse_args()
    policy = ScalingPolicy.from_yaml(args.policy)
    key = f"hp-demo-{args.corpus_mb}mb-v{args.vocab}-s{args.seed}"
    cache = TokenCache.open(key, lambda: tokenize(synthetic_corpus(args.corpus_mb << 20, args.seed), args.vocab))
    sampler = StepSampler(len(Windows(cache, args.seq)), geometry=policy, seed=args.seed)
    loader = StepLoader(Windows(cache, args.seq), sampler)

    mesh = ctx.device_mesh(shard=args.hsdp_shard) if args.hsdp_shard else None  # a joiner waits here for its rank
    torch.manual_seed(args.seed)
    model = build_model(args.model_size, args.vocab, args.seq, args.dropout)
    if mesh is not None:
        shard_model(model, mesh)
    # the LR of the world size the job starts at (a joiner's is replaced by its peers' when it hydrates)
    start_world = ctx.world_size if policy.allows(ctx.world_size) else policy.min_replicas
    lr = policy.lr_for(start_world) if policy.lr is not None or policy.lr_table else 3e-3
    if args.zero:  # built by hp once the process group exists (a joiner has none before it gets a rank)
        optimizer = lambda params: ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=lr)  # noqa: E731
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def on_scale(old: int, new: int) -> None:  # the LR the policy gives the new world size, scheduler included
        if policy.lr is not None or policy.lr_table:
            on_scale_lr(policy, ctx.optimizer, ctx.scheduler, old, new)

    reduction = None
    if args.exact:
        from hp.elastic import ExactReduction

        reduction = ExactReduction()
    ctx.register(model, optimizer, checkpoint=job_checkpoint(args), reduction=reduction, on_scale=on_scale)

    for step in ctx.steps(args.steps):
        with step:
            losses = []
            for x, y in step.micro_batches(loader):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                losses.append(loss)
            ctx.commit(losses)
        if ctx.rank == 0 and ctx.committed == step:
            print(f"step {step:3d} loss {ctx.last_loss:.4f} world {ctx.world_size} (generation {ctx.generation})",
                  flush=True)


if __name__ == "__main__":
    main()

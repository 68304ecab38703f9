"""The same training as train_hp.py, elastic: constant global batch at any world size (diff the two files).

    hp run --nnodes 1:2 --nproc-per-node 2 --rdzv-endpoint HOST:PORT --scaling-policy examples/policy.yaml \
        examples/train_elastic.py --steps 30
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from hp.checkpointless import StepLoader, StepSampler, recoverable
from hp.checkpointless.data import TokenCache, Windows, synthetic_corpus, tokenize
from hp.checkpointless.demo.model import build_model
from hp.elastic import ExactReduction, ScalingPolicy


@recoverable
def main(ctx) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--policy", default="examples/policy.yaml")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    policy = ScalingPolicy.from_yaml(args.policy)
    cache = TokenCache.open(f"examples-8mb-s{args.seed}", lambda: tokenize(synthetic_corpus(8 << 20, args.seed)))
    data = Windows(cache, args.seq)
    loader = StepLoader(data, StepSampler(len(data), geometry=policy, seed=args.seed))
    torch.manual_seed(args.seed)
    model = build_model("tiny", vocab=256, seq=args.seq, dropout=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ctx.register(model, optimizer, reduction=ExactReduction())  # exact: bit-identical at any world size

    for step in ctx.steps(args.steps):
        with step:
            losses = []
            for x, y in step.micro_batches(loader):  # this rank's share of the constant global batch
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                losses.append(loss)
            ctx.commit(losses)
        if ctx.rank == 0 and ctx.committed == step:
            print(f"step {step:3d} loss {ctx.last_loss:.4f} on {ctx.world_size} ranks", flush=True)
    if ctx.rank == 0:
        print(f"done: {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()

"""The same FSDP2 / HSDP training as train_fsdp.py, recoverable in process by hp (diff the two files).

    hp run --nproc-per-node 4 --spares 1 examples/train_fsdp_hp.py --steps 30 --replicate 2   # HSDP: 2 x 2
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from hp.checkpointless import recoverable
from hp.checkpointless.data import Batches, TokenCache, synthetic_corpus, tokenize
from hp.checkpointless.demo.model import build_model


@recoverable
def main(ctx) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicate", type=int, default=1, help="HSDP replica groups (1: FSDP over every rank)")
    args = p.parse_args()

    mesh = ctx.device_mesh(replicate=args.replicate)
    cache = TokenCache.open(f"examples-8mb-s{args.seed}", lambda: tokenize(synthetic_corpus(8 << 20, args.seed)))
    batches = Batches(cache, args.seq, args.batch_size, args.seed)
    torch.manual_seed(args.seed)
    model = build_model("tiny", vocab=256, seq=args.seq, dropout=0.1)
    for layer in model.blocks.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ctx.register(model, optimizer)

    for step in ctx.steps(args.steps):
        with step:
            x, y = batches.get(step, ctx.rank, ctx.world_size)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            ctx.commit(loss)
        if ctx.rank == 0 and ctx.committed == step:
            print(f"step {step:3d} loss {ctx.last_loss:.4f}", flush=True)
    if ctx.rank == 0:
        print(f"done: {args.steps} steps on {ctx.world_size} ranks", flush=True)


if __name__ == "__main__":
    main()

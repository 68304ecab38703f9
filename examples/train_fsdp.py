"""Plain FSDP2 / HSDP training as torchtitan shards a model, launchable unchanged by `torchrun` or `hp run`.

    hp run --nproc-per-node 4 examples/train_fsdp.py --steps 30 --replicate 2   # HSDP: 2 x 2
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hp.checkpointless.data import Batches, TokenCache, synthetic_corpus, tokenize
from hp.checkpointless.demo.model import build_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicate", type=int, default=1, help="HSDP replica groups (1: FSDP over every rank)")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = (init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)) if args.replicate == 1 else
            init_device_mesh("cpu", (args.replicate, world // args.replicate), mesh_dim_names=("replicate", "shard")))
    cache = TokenCache.open(f"examples-8mb-s{args.seed}", lambda: tokenize(synthetic_corpus(8 << 20, args.seed)))
    batches = Batches(cache, args.seq, args.batch_size, args.seed)
    torch.manual_seed(args.seed)
    model = build_model("tiny", vocab=256, seq=args.seq, dropout=0.1)
    for layer in model.blocks.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    for step in range(args.steps):
        x, y = batches.get(step, rank, world)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step:3d} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        print(f"done: {args.steps} steps on {world} ranks", flush=True)


if __name__ == "__main__":
    main()

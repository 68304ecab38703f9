"""Plain DDP training, launchable unchanged by `torchrun` or `hp run`.

    hp run --nproc-per-node 4 examples/train_ddp.py --steps 30
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from model import TinyGPT, batch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DDP(TinyGPT(vocab=args.vocab, seq=args.seq))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    for step in range(args.steps):
        x, y = batch(step, rank, world, args.seed, args.batch_size, args.seq, args.vocab)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step:3d} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        print(f"done: {args.steps} steps on {world} ranks (pid {os.getpid()})", flush=True)


if __name__ == "__main__":
    main()

"""Test worker: joins the generation's process group via hp and all-reduces its rank."""

import os

import torch
import torch.distributed as dist

from hp.core import WorkerContext

ctx = WorkerContext.from_env()
ctx.init_process_group()
t = torch.tensor([float(ctx.rank)])
dist.all_reduce(t)
with open(os.path.join(os.environ["HP_TEST_DIR"], f"rank{ctx.rank}.sum"), "w") as f:
    f.write(f"{t.item()} {ctx.world_size} {ctx.node_rank} {ctx.generation}\n")
dist.destroy_process_group()

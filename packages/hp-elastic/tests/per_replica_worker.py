"""The job of test_per_replica.py, under ``hp run --scaling-policy``: a per-replica batch (the global batch
follows the world size) read through ``step.micro_batches``, an LR that follows the policy's rule, a
scheduler. After every committed step each rank records ``test_samples``: the dataset indices it trained
on in that step (its own micro-batches, in order), the world size and its LR, so the test can check that
the committed steps read the sample stream in order, none skipped and none repeated, through 4 -> 3 -> 4.

    hp run --nnodes 1:1 --nproc-per-node 4 --scaling-policy P per_replica_worker.py --steps 60
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from hp.checkpointless import StepLoader, StepSampler, recoverable
from hp.core.protocol import SCALING_POLICY_ENV
from hp.core.worker_env import WorkerEnv
from hp.elastic import ScalingPolicy, on_scale_lr

FEATURES = 6
REPLACEMENT_START_S = 2.0


class Indexed(torch.utils.data.Dataset):
    """Sample i: features that are a pure function of i, a target, and i itself (what the test checks)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.sin(torch.arange(1, FEATURES + 1, dtype=torch.float32) * (i + 1) * 0.37)
        return x, x.sum().reshape(1), i


@recoverable
def main(ctx) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--samples", type=int, default=200, help="dataset size (a run spans several epochs)")
    p.add_argument("--sleep", type=float, default=0.1, help="seconds per step: time for the regrown process")
    args = p.parse_args()
    policy = ScalingPolicy.from_yaml(os.environ[SCALING_POLICY_ENV])
    loader = StepLoader(Indexed(args.samples), StepSampler(args.samples, geometry=policy, seed=5))
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    start_world = ctx.world_size if policy.allows(ctx.world_size) else policy.min_replicas
    ctx.register(model, lambda params: torch.optim.SGD(params, lr=policy.lr_for(start_world), momentum=0.9),
                 lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5),
                 on_scale=lambda old, new: on_scale_lr(policy, ctx.optimizer, ctx.scheduler, old, new))
    for step in ctx.steps(args.steps):
        with step:
            losses, seen = [], []
            for x, y, index in step.micro_batches(loader):
                loss = F.mse_loss(model(x), y)
                loss.backward()
                losses.append(loss)
                seen += index.tolist()
            time.sleep(args.sleep)
            ctx.commit(losses)
        if ctx.committed == step:
            ctx.events.record("test_samples", step=int(step), rank=ctx.rank, world=ctx.world_size, indices=seen,
                              samples=ctx.samples, lr=ctx.optimizer.param_groups[0]["lr"])


if __name__ == "__main__":
    if WorkerEnv.from_env().spare_id is not None:
        # the process that takes the freed slot starts as a new process would on a cluster (seconds, not
        # the fork server's milliseconds): the job must train at 3 first (fc17: a replacement ready in 25 ms
        # superseded the shrink before it formed, and the job went 4 -> 4)
        time.sleep(REPLACEMENT_START_S)
    main()

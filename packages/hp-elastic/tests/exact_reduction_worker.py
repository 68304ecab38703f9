"""One rank of the ExactReduction tests: python exact_reduction_worker.py SCENARIO RANK WORLD PORT OUTDIR.

Trains a small MLP the way the step transaction does: the parameters' ``.grad`` are views of one flat
buffer, a step is M micro-batches of which rank r of W computes ``owned(M, r, W)``, each with the
global RNG seeded by ``micro_batch_seed`` (data and dropout), then ``Reduction.reduce`` and AdamW.

- ``train``: 4 processes; for W = 1..4 the ranks < W (a subgroup, the default group for W=4) train
  M=12 micro-batches for STEPS steps with ExactReduction and with MeanReduction; every rank saves its
  parameters and optimizer state to ``{mode}_w{W}_r{rank}.pt``.
- ``edge``: 4 processes, M=3 (rank 3 owns nothing): exact training at W=1 and W=4 (saved as above);
  a NaN in micro-batch 1 (rank 1's) at W=4, every rank writes whether its mean came out all NaN to ``nan{rank}.txt``;
  a plain step (no micro_batch_done) at W=4, every rank saves its reduced buffer to ``plain{rank}.pt``.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hp.checkpointless.reduction import MeanReduction
from hp.elastic.exact import ExactReduction
from hp.elastic.ownership import micro_batch_seed, owned

SEED, STEPS, SAMPLES = 7, 4, 4  # SAMPLES per micro-batch


def build() -> tuple[nn.Module, torch.Tensor, torch.optim.Optimizer]:
    """The model (same init everywhere), its flat gradient buffer with ``.grad`` views, AdamW."""
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 3))
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return model, flat, torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def micro_batch(model: nn.Module, step: int, m: int) -> None:
    torch.manual_seed(micro_batch_seed(SEED, step, m))
    x, y = torch.randn(SAMPLES, 8), torch.randint(0, 3, (SAMPLES,))
    nn.functional.cross_entropy(model(x), y).backward()


def train(reduction, m_total: int, rank: int, world: int, group, steps: int = STEPS) -> dict[str, torch.Tensor]:
    model, flat, opt = build()
    ptrs = [p.grad.data_ptr() for p in model.parameters()]

    def collective(fn, *args, **kwargs):
        fn(*args, group=group, **kwargs)

    for step in range(steps):
        reduction.begin()
        flat.zero_()
        for m in owned(m_total, rank, world):
            micro_batch(model, step, m)
            reduction.micro_batch_done(flat, m)
        reduction.reduce(flat, m_total, collective)
        assert [p.grad.data_ptr() for p in model.parameters()] == ptrs, "backward replaced a .grad view"
        opt.step()
    params = list(model.parameters())
    state = [opt.state[p] for p in params]
    return {"params": torch.cat([p.detach().reshape(-1) for p in params]),
            "exp_avg": torch.cat([s["exp_avg"].reshape(-1) for s in state]),
            "exp_avg_sq": torch.cat([s["exp_avg_sq"].reshape(-1) for s in state]),
            "step": torch.stack([torch.as_tensor(s["step"], dtype=torch.float32) for s in state])}


def scenario_train(rank: int, groups: dict, out: Path) -> None:
    for w, group in groups.items():
        if rank < w:
            for mode, reduction in (("exact", ExactReduction()), ("mean", MeanReduction())):
                torch.save(train(reduction, 12, rank, w, group), out / f"{mode}_w{w}_r{rank}.pt")


def scenario_edge(rank: int, world: int, groups: dict, out: Path) -> None:
    for w in (1, world):
        if rank < w:
            torch.save(train(ExactReduction(), 3, rank, w, groups[w]), out / f"exact_w{w}_r{rank}.pt")
    model, flat, _ = build()
    reduction = ExactReduction()
    reduction.begin()
    for m in owned(3, rank, world):
        micro_batch(model, 0, m)
        if m == 1:
            flat[5] = float("nan")
        reduction.micro_batch_done(flat, m)
    reduction.reduce(flat, 3, lambda fn, *a, **kw: fn(*a, **kw))
    (out / f"nan{rank}.txt").write_text("all NaN" if bool(flat.isnan().all()) else "not all NaN")
    reduction.begin()  # the replay: a plain step, one contribution per rank
    flat.zero_()
    micro_batch(model, 1, rank)
    mine = flat.clone()
    reduction.reduce(flat, world, lambda fn, *a, **kw: fn(*a, **kw))
    torch.save({"mine": mine, "reduced": flat}, out / f"plain{rank}.pt")


def main() -> None:
    scenario, out, rank, world, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    groups = {w: dist.new_group(list(range(w))) for w in range(1, world)}  # every rank calls new_group
    groups[world] = None
    if scenario == "train":
        scenario_train(rank, groups, out)
    else:
        scenario_edge(rank, world, groups, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The training job of test_transaction.py, run under ``hp run``: the step-transaction API end to end.

    hp run --nproc-per-node 3 --spares 1 ... transaction_worker.py --steps 10 --model bn --scaler

A step is ``accum`` micro-batches of ``MICRO`` samples (a :class:`StepSampler`); each rank runs the
micro-batches it owns, accumulates their gradients, and the runtime averages them (``ctx.reduce()``,
explicit only with ``--clip``, which needs the averaged gradients; otherwise ``ctx.commit`` does it).
Besides the runtime's own events, the job records after every committed step an event
``test_step`` (rank, step, sha256 of the parameters, buffers and optimizer state, the AMP scale)
and, at the end, writes ``--dump DIR/rank{r}.pt``: every tensor of its final state, for a
byte-for-byte comparison that does not rely on the runtime's ``final_state`` digests.

AMP (``--scaler``): ``torch.autocast("cpu", dtype=torch.bfloat16)`` around the forward pass and a CPU
``torch.amp.GradScaler``. bfloat16 would not need loss scaling, but the scaler is what the runtime
must keep consistent (its scale, the inf/NaN check carried by the vote, skipped steps), and CPU has
no float16 autocast worth using, so bfloat16 + scaler is the CPU stand-in for float16 AMP on a GPU.

``--inf-step K --inf-rank R`` puts an inf into one gradient of rank R at step K, on every attempt of
that step (a replay and the fault-free reference get it too): the whole job must skip step K.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os

import torch
import torch.nn.functional as F
from torch import nn

from hp.checkpointless import StepLoader, StepSampler, recoverable

FEATURES, HIDDEN, CLASSES = 8, 32, 4
MICRO = 4  # samples per micro-batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--model", choices=("bn", "mlp"), default="bn",
                   help="bn: Linear-BatchNorm1d-ReLU-Dropout(0.2)-Linear; mlp: the same without BatchNorm and Dropout")
    p.add_argument("--clip", type=float, default=None, metavar="MAXNORM",
                   help="clip the averaged gradients (calls ctx.reduce() explicitly first)")
    p.add_argument("--scaler", action="store_true", help="bfloat16 autocast + CPU GradScaler")
    p.add_argument("--inf-step", type=int, default=None)
    p.add_argument("--inf-rank", type=int, default=0)
    p.add_argument("--accum", type=int, default=3, help="micro-batches per step (global)")
    p.add_argument("--dataset", action="store_true",
                   help="read a map-style Dataset through StepLoader (a DataLoader with 2 workers)")
    p.add_argument("--samples", type=int, default=512, help="size of the dataset")
    p.add_argument("--no-broadcast-buffers", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump", default=None, metavar="DIR", help="write DIR/rank{r}.pt with the final state")
    return p.parse_args(argv)


def build_model(kind: str) -> nn.Module:
    if kind == "bn":
        return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Dropout(0.2),
                             nn.Linear(HIDDEN, CLASSES))
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def seed_of(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def labels(x: torch.Tensor) -> torch.Tensor:
    """A learnable target: the quadrant of the first two features."""
    return (x[..., 0] > 0).long() + 2 * (x[..., 1] > 0).long()


class Synthetic(torch.utils.data.Dataset):
    """Map-style dataset: sample i is a pure function of (seed, i), computed on access (in a worker)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(seed_of(self.seed, "sample", int(i))))
        return x, labels(x)


def generated(sampler: StepSampler, seed: int, step: int, rank: int, world: int) -> list:
    """Without a dataset: micro-batch m of step s drawn from a generator seeded by (seed, s, m)."""
    out = []
    for m in sampler.owned(step, rank, world):
        g = torch.Generator().manual_seed(seed_of(seed, int(step), int(m)))
        x = torch.randn(MICRO, FEATURES, generator=g)
        out.append((x, labels(x)))
    return out


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for _, v in sorted(s.items()) if isinstance(v, torch.Tensor)]


def final_state(model: nn.Module, opt, sched, scaler, committed: int) -> dict:
    return {
        "step": committed,
        "pid": os.getpid(),
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "buffers": {k: v.detach().clone() for k, v in model.named_buffers()},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
    }


@recoverable
def main(ctx) -> None:
    args = parse_args()
    torch.manual_seed(args.seed)  # the same on every rank (like the demo): dropout masks follow the step
    model = build_model(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if args.scaler else None
    ctx.register(model, opt, sched, scaler=scaler, broadcast_buffers=not args.no_broadcast_buffers)
    sampler = StepSampler(args.samples, micro_batch=MICRO, micro_batches=args.accum, seed=args.seed)
    loader = StepLoader(Synthetic(args.samples, args.seed), sampler, num_workers=2) if args.dataset else None
    params = list(model.parameters())

    for step in ctx.steps(args.steps):
        n = grad_norm = None
        with step:
            if loader is not None:
                micro = loader.step(step, ctx.rank, ctx.world_size)
            else:
                micro = generated(sampler, args.seed, step, ctx.rank, ctx.world_size)
            n = len(micro)
            total = torch.zeros((), dtype=torch.float32)
            for x, y in micro:
                amp = torch.autocast("cpu", dtype=torch.bfloat16) if args.scaler else contextlib.nullcontext()
                with amp:
                    loss = F.cross_entropy(model(x), y) / n
                (scaler.scale(loss) if scaler is not None else loss).backward()
                total += loss.detach().float()
            if step == args.inf_step and ctx.rank == args.inf_rank:
                with torch.no_grad():
                    params[0].grad.view(-1)[0] = float("inf")
            if args.clip is not None:
                ctx.reduce()
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, args.clip)).hex()
            ctx.commit(total)
        if ctx.committed == step:
            ctx.events.record(
                "test_step", step=int(step), rank=ctx.rank, generation=ctx.generation, micro=n, grad_norm=grad_norm,
                params=digest(params), buffers=digest(model.buffers()), optimizer=digest(optimizer_tensors(opt)),
                lr=float(opt.param_groups[0]["lr"]).hex(),
                scale=scaler.get_scale() if scaler is not None else None)

    try:
        rank = ctx.rank
    except Exception:  # a spare that was never promoted has no rank and no state of a rank
        return
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        path = os.path.join(args.dump, f"rank{rank}.pt")
        torch.save(final_state(model, opt, sched, scaler, ctx.committed), path + ".tmp")
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()

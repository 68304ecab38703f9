"""One rank of the exact-mode test: python exact_worker.py RANK WORLD PORT OUTDIR.

Joins a gloo group of 4 on 127.0.0.1:PORT; for every W in 1..4 the ranks < W form a subgroup (W=4 uses
the default group) and reduce their owned micro-batches of the same M=12 gradients with exact_mean and
with a plain float all-reduce; rank 0 of each W saves both. Then a NaN / inf case on the default group:
every rank saves the error it got.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from exact_cases import M, micro_grads
from hp.elastic.exact import NonFiniteGradientError, exact_mean
from hp.elastic.ownership import owned


def main() -> None:
    out, rank, world, port = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    grads = micro_grads()
    groups = {w: dist.new_group(list(range(w))) for w in range(1, world)}  # every rank calls new_group
    groups[world] = None
    for w, group in groups.items():
        if rank >= w:
            continue
        mine = owned(M, rank, w)
        exact = exact_mean([grads[m] for m in mine], M, group, numel=grads[0].numel(), micro_ids=mine)
        partial = torch.zeros_like(grads[0])
        for m in mine:
            partial += grads[m]
        dist.all_reduce(partial, group=group)
        if rank == 0:
            torch.save({"exact": exact, "float": partial / M}, out / f"w{w}.pt")
    for kind, value in (("nan", float("nan")), ("inf", float("inf"))):
        bad = [g.clone() for g in grads]
        bad[7][3] = value
        mine = owned(M, rank, world)
        try:
            exact_mean([bad[m] for m in mine], M, micro_ids=mine)
            (out / f"{kind}{rank}.txt").write_text("no error")
        except NonFiniteGradientError as e:
            (out / f"{kind}{rank}.txt").write_text(f"NonFiniteGradientError: {e}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

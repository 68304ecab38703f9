"""Test launcher: WORLD ranks (forked after one torch import) form generation 1's gloo group on the etcd
store, all-reduce, and publish ``formed/<rank>`` = their pid. Rank 0 then waits to be killed. The others
wait for ``rank0_killed``, drop the broken group, check the store still takes writes and reads from each
of them, and form generation 2 (WORLD - 1 ranks) on the same store: ``reformed/<new rank>`` = its sum.

    python etcd_group.py HOST PORT JOB WORLD RESULT_JSON
"""

import json
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hp.core.etcd_store import connect
from hp.core.plugins import get_backend

HOST, PORT, JOB, WORLD, RESULT = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
TIMEOUT = timedelta(seconds=60)


def rank_main(rank: int) -> None:
    code = 1
    try:
        torch.set_num_threads(1)
        gloo = get_backend("transport", "gloo")
        store = connect(HOST, PORT, TIMEOUT, job=JOB)
        gloo.init_process_group(store, rank, WORLD, 1, TIMEOUT)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        assert t.item() == sum(range(WORLD)), t
        store.set(f"formed/{rank}", str(os.getpid()))
        if rank == 0:
            time.sleep(120)  # until the test kills it
            return
        store.wait(["rank0_killed"])
        gloo.abort()  # the group of generation 1 lost a rank: tear it down
        store.set(f"after/{rank}", f"rank {rank} writes after rank 0 died")
        store.wait([f"after/{r}" for r in range(1, WORLD)])
        assert store.get(f"after/{WORLD - rank}").startswith(b"rank ")  # reads what another survivor wrote
        store.add("survivors", 1)
        new_rank = rank - 1
        gloo.init_process_group(store, new_rank, WORLD - 1, 2, TIMEOUT)
        t = torch.ones(1)
        dist.all_reduce(t)
        store.set(f"reformed/{new_rank}", str(int(t.item())))
        code = 0
    except BaseException as e:  # noqa: BLE001
        print(f"rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    finally:
        os._exit(code)


if __name__ == "__main__":
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=rank_main, args=(r,)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=150)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    with open(RESULT, "w") as f:
        json.dump({"exitcodes": codes}, f)

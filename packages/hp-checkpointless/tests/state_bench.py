"""Throughput of the peer-hydration wire for a ~100 MB state on 2 local gloo ranks (not a test).

    python packages/hp-checkpointless/tests/state_bench.py [MB]   # spawns its 2 ranks itself
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hp.checkpointless import state as st
from hp.checkpointless import transfer


def make_state(mb: int) -> dict:
    n = mb * 2**20 // 4 // 25  # 25 big float32 tensors + many small ones, like params + AdamW moments
    return {"big": [torch.randn(n) for _ in range(25)], "small": {i: torch.randn(64) for i in range(500)}}


def timed(fn, reps: int = 3) -> float:
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def rank_main(rank: int, port: int, mb: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    state = make_state(mb)
    nbytes = sum(t.numel() * t.element_size() for t in st.flatten(state)[1])
    skeleton = st.flatten(state)[0]
    if rank == 0:
        buf = st.StateBuffer.for_layout(skeleton, prefault=True)
        rows = {
            "pack into fresh buffer": timed(lambda: st.StateBuffer.for_layout(skeleton).pack(st.flatten(state)[1])),
            "pack into reused buffer": timed(lambda: buf.pack(st.flatten(state)[1])),
            "checksum (crc32)": timed(lambda: st.checksum(buf.flat)),
        }
        rows["send_state fresh"] = timed(lambda: transfer.send_state(state, 1))
        rows["send_state reused"] = timed(lambda: transfer.send_state(state, 1, buffer=buf))
        for k, v in rows.items():
            print(f"{k:28s} {v * 1e3:8.1f} ms  {nbytes / v / 1e9:6.2f} GB/s", flush=True)
    else:
        timed(lambda: None), timed(lambda: None), timed(lambda: None)
        fresh = timed(lambda: transfer.recv_state(0))
        buf = st.StateBuffer.for_layout(skeleton, prefault=True)
        warm = timed(lambda: transfer.recv_state(0, template=state, buffer=buf))
        time.sleep(0.5)
        for k, v in (("recv_state fresh (e2e)", fresh), ("recv_state template+reused", warm)):
            print(f"{k:28s} {v * 1e3:8.1f} ms  {nbytes / v / 1e9:6.2f} GB/s  ({nbytes / 2**20:.0f} MiB)", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) > 2:
        rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    else:
        from hp.testing import free_port

        port, mb = free_port(), int(sys.argv[1]) if len(sys.argv) > 1 else 100
        procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), str(mb)], env=os.environ)
                 for r in range(2)]
        sys.exit(max(p.wait() for p in procs))

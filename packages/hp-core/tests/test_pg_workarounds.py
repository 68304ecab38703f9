"""A plain DDP script that destroys its group and returns exits, forked or cold (hp.core.pg_workarounds).

The hang it guards against is a race in torch (a gloo worker thread that needs the GIL while the
``Reducer``'s destructor joins it with the GIL held). Here the race is made certain rather than likely: a
callback on the group's last all-reduce, attached before the all-reduce ends (so it runs on the group's
worker thread), keeps that thread busy without the GIL for a second, so the thread needs the GIL back while
the script's DDP module is freed. The DDP module is freed on return only if
``torch._dynamo`` was imported before it was built (otherwise a cycle keeps it to the next collection): hp's
fork server preloads it, a script using ``torch.compile`` imports it, torchrun's workers of
``examples/train_ddp.py`` import it only later (with the optimizer). Without the workaround both cases hang
(the worker never ends); with it both exit 0."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing import Std

from hp.core import forkserver
from hp.testing import free_port
from hp.core.workers import python_command

SCRIPT = """
import sys, threading, time
import torch, torch.distributed as dist
import torch._dynamo  # imported before DDP is built (torch.compile, hp's fork server): no cycle keeps DDP alive
from torch.nn.parallel import DistributedDataParallel as DDP

ran = []

def late(_):  # on a gloo thread: busy for a second without the GIL, then needs it back
    if threading.current_thread() is not threading.main_thread():
        time.sleep(1.0)
    ran.append(threading.current_thread().name)

def main():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
    model = DDP(torch.nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    for _ in range(1000):  # until the callback is attached before the all-reduce ends (else it runs right here)
        ran.clear()
        dist.all_reduce(torch.ones(1), async_op=True).get_future().then(late)
        if not ran:
            break
    dist.destroy_process_group()
    print("destroyed with a late gloo thread", flush=True)
    # returning frees `model`: its Reducer drops the group's last reference unless hp holds one

main()
print("returned", flush=True)
"""

HANG_S = 60  # a hang guard: the script ends in ~1 s once imported


def test_a_forked_ddp_worker_that_destroys_its_group_exits(tmp_path: Path):
    script = tmp_path / "ddp_exit.py"
    script.write_text(SCRIPT)
    w = forkserver.ForkedWorker(0, 0, python_command(str(script), [str(free_port())], False), str(tmp_path), Std.ALL)
    w.start({"OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + HANG_S
    try:
        while (status := w.poll()) is None:
            assert time.monotonic() < deadline, "the forked DDP worker hung at exit"
            time.sleep(0.05)
    finally:
        if w.poll() is None:
            w.kill_hung()
    out = (tmp_path / w.name / "attempt_0" / "stdout.log").read_text()
    assert status.ok and out.splitlines() == ["destroyed with a late gloo thread", "returned"], out


def test_a_cold_ddp_worker_that_destroys_its_group_exits(tmp_path: Path):
    script = tmp_path / "ddp_exit.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "hp.core.worker_main", str(script), str(free_port())],
                         capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0 and out.stdout.splitlines() == ["destroyed with a late gloo thread", "returned"], out.stdout + out.stderr

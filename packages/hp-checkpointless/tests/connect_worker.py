"""One process of test_group.py's connect-bound tests (``role`` ``port`` ``rank``).

``victim`` (with a generation argument): publishes its gloo address for that generation, then is
SIGKILLed before it connects. ``survivor``: forms generations 1-3, each with a victim (60 s group
timeout, 2 s connect bound), and reports how each ended; then forms generation 4 with ``fresh``. Which
side of a pair connects is gloo's choice (the higher port): a survivor that connects is refused at once
(or, connected a moment before the victim died, fails its first collective); one that waits for the
victim's connect waited 5x the group's timeout before the bound. Three rounds make that case likely.
``late0``/``late1``: form a group with a 0.5 s connect bound; rank 1 arrives 1.5 s late at each
collective and transfer, which must wait the group's 60 s timeout, not the 0.1 s init timeout."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hp.checkpointless import transfer
from hp.checkpointless.group import FormingStore
from hp.core import get_backend

role, port = sys.argv[1], int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
gloo = get_backend("transport", "gloo")
timeout = timedelta(seconds=60)
out: dict = {}


class DiesAfterPublishing(FormingStore):
    def set(self, key: str, value: str | bytes) -> None:
        super().set(key, value)
        os.kill(os.getpid(), signal.SIGKILL)


if role == "victim":
    victim = DiesAfterPublishing(store, lambda: None, timeout)  # referenced: the group's init reads it
    gloo.init_process_group(victim, 1, 2, int(sys.argv[3]), timeout, connect_timeout=timedelta(seconds=2))
elif role == "survivor":
    out["rounds"] = []
    for generation in (1, 2, 3):
        forming = FormingStore(store, lambda: None, timeout)
        start = time.monotonic()
        try:
            gloo.init_process_group(forming, 0, 2, generation, timeout, connect_timeout=timedelta(seconds=2))
            try:
                dist.all_reduce(torch.ones(2))
                outcome = "a collective with a dead peer succeeded"
            except RuntimeError:
                outcome = "formed, first collective failed"
            dist.destroy_process_group()
        except RuntimeError as e:
            outcome = "connect refused" if "refused" in str(e) else "gave up"
        out["rounds"].append([outcome, time.monotonic() - start])
    store.set("survived", "1")
if role in ("survivor", "fresh"):
    if role == "fresh":
        store.wait(["survived"])
    second = FormingStore(store, lambda: None, timeout)
    gloo.init_process_group(second, 0 if role == "survivor" else 1, 2, 4, timeout)
    x = torch.ones(2)
    dist.all_reduce(x)
    out["sum"] = x.tolist()
    dist.destroy_process_group()
if role.startswith("late"):
    rank = int(role[-1])
    forming = FormingStore(store, lambda: None, timeout)
    gloo.init_process_group(forming, rank, 2, 3, timeout, connect_timeout=timedelta(seconds=0.5))
    done = []
    for name in ("all_reduce", "broadcast", "all_gather", "state"):
        if rank == 1:
            time.sleep(1.5)
        x = torch.full((4,), float(rank))
        if name == "all_reduce":
            dist.all_reduce(x)
        elif name == "broadcast":
            dist.broadcast(x, 1)
        elif name == "all_gather":
            rows = [torch.zeros(4) for _ in range(2)]
            dist.all_gather(rows, x)
            x = torch.cat(rows)
        elif rank == 1:
            transfer.send_state({"x": x + 7}, 0)
        else:
            x = transfer.recv_state(1)["x"]
        done.append([name, x.tolist()])
    out["done"] = done
    dist.destroy_process_group()
print(json.dumps(out))

"""One process of test_group.py: ``abandon`` first fails to form generation 1 (its peer never comes; the
group is given up after 0.5 s as the watch thread would on a newer generation), then forms generation 2
with a fresh process (``fresh``), which must rendezvous under the same group name."""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hp.checkpointless.group import FormingStore
from hp.checkpointless.recovery import CollectiveError
from hp.core import get_backend

role, port = sys.argv[1], int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
gloo = get_backend("transport", "gloo")
timeout = timedelta(seconds=60)
out: dict = {}
if role == "abandon":
    start = time.monotonic()
    gone = lambda: "generation 1 superseded by 2" if time.monotonic() - start > 0.5 else None  # noqa: E731
    try:
        gloo.init_process_group(FormingStore(store, gone, timeout), 0, 2, 1, timeout)
    except CollectiveError as e:
        out["abandoned_after_s"], out["error"] = time.monotonic() - start, str(e)
    store.set("abandoned", "1")
else:
    store.wait(["abandoned"])
rank = 0 if role == "abandon" else 1
gloo.init_process_group(FormingStore(store, lambda: None, timeout), rank, 2, 2, timeout)
x = torch.ones(2)
dist.all_reduce(x)
out["sum"] = x.tolist()
dist.destroy_process_group()
print(json.dumps(out))

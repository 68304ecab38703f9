"""The ``local`` scheduler backend: this host only; jobs are submitted with TorchX's ``local_cwd`` scheduler."""

from __future__ import annotations

import os
import socket

from hp.core.hookspecs import hookimpl
from hp.core.schedulers.api import Capacity, SchedulerBackend


class LocalScheduler(SchedulerBackend):
    """This host only; jobs are submitted with TorchX's ``local_cwd`` scheduler."""

    name = "local"
    torchx_scheduler = "local_cwd"

    def hosts(self) -> list[str]:
        return [socket.gethostname()]

    def capacity(self, source: str | None = None) -> Capacity:
        """``source``: a file holding the number of ranks the job may use (what a user or a test sets, so
        every elastic path runs on one machine); missing or unreadable: no figure."""
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return Capacity(hosts=1, slots_per_host=gpus or (os.cpu_count() or 1), replicas=_read_count(source))


def _read_count(path: str | None) -> int | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            text = f.read(32).strip()  # a number of ranks: anything longer is not one
    except OSError:
        return None
    return int(text) if text.isdigit() and len(text) <= 9 else None


@hookimpl
def hp_scheduler_backends() -> list[SchedulerBackend]:
    return [LocalScheduler()]

"""Scheduler backends: where a job's processes run and how capacity changes.

Schedulers that TorchX already drives (local_cwd, slurm, kubernetes) submit through TorchX's
runner; hp adds what TorchX does not model: host lists and capacity signals for elastic decisions.
``local`` is here; ``slurm`` is :mod:`hp.core.slurm`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hp.core.hookspecs import hookimpl

if TYPE_CHECKING:
    from torchx.specs import AppDef, AppStatus


@dataclass(frozen=True)
class Capacity:
    """What the scheduler can give right now."""

    hosts: int  # hosts the job could run on
    slots_per_host: int  # worker processes one host can hold
    preemption_requested: bool = False  # the scheduler wants capacity back
    replicas: int | None = None  # ranks an elastic job may use now (None: the scheduler does not say)
    quota_hosts: int | None = None  # hosts the job's quota lets it hold (None: no quota applies)


class SchedulerBackend:
    """Base class of schedulers. ``torchx_scheduler`` names the TorchX scheduler used to submit."""

    name: str = ""
    torchx_scheduler: str = ""

    def hosts(self) -> list[str]:
        """Host names currently allocated to the job."""
        raise NotImplementedError

    def capacity(self, source: str | None = None) -> Capacity:
        """Current capacity signal. ``source``: where the backend reads it (``hp run --capacity-file``)."""
        raise NotImplementedError

    _runner = None

    def _torchx_runner(self):
        # One runner per backend: closing a TorchX runner stops the apps its local scheduler started.
        if self._runner is None:
            from torchx.runner import get_runner

            self._runner = get_runner()
        return self._runner

    def submit(self, app: AppDef, cfg: dict | None = None) -> str:
        """Submit ``app`` through TorchX; returns the TorchX app handle."""
        return self._torchx_runner().run(app, scheduler=self.torchx_scheduler, cfg=cfg or {})

    def wait(self, handle: str, poll_s: float = 0.5) -> AppStatus | None:
        """Block until the app is in a terminal state; returns its final status."""
        return self._torchx_runner().wait(handle, wait_interval=poll_s)

    def cancel(self, handle: str) -> None:
        self._torchx_runner().cancel(handle)

    def close(self) -> None:
        """Release the TorchX runner (for the local scheduler this stops its apps)."""
        if self._runner is not None:
            self._runner.close()
            self._runner = None


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
    from hp.core.k8s.backend import KubernetesScheduler  # the client itself is imported on first use
    from hp.core.slurm import SlurmScheduler  # imports this module

    return [LocalScheduler(), SlurmScheduler(), KubernetesScheduler()]

"""The scheduler contract: what every scheduler backend gives the agent and the controller.

Schedulers that TorchX already drives (local_cwd, slurm, kubernetes) submit through TorchX's
runner; hp adds what TorchX does not model: host lists and capacity signals for elastic decisions.
Backends live one per module beside this one (:mod:`.local`, :mod:`.slurm`, :mod:`.k8s`) and register
under the ``hp`` entry-point group like any third-party scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

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

"""Health checks a rank passes before it re-enters training after a failure (family ``health``).

A survivor of a failure releases its process group and, before it joins the next generation, runs
every check that applies to its device (:meth:`HealthCheck.applies`). A failing check (a CUDA context
that died with an illegal memory access, a device without the memory to go on) makes the process
leave with :data:`EXIT_UNHEALTHY`: its agent reports it like any dead worker and a spare takes its
rank, instead of a rank that would fail the job's next collective. The first collective of the new
generation (its agreement all-reduce) is the check of the transport itself: a communicator that
cannot form or reduce fails the re-form, which is retried and reported.

Built in: ``cuda`` (for ``cuda:N`` devices: the context runs a small kernel to completion and the
device has ``HP_HEALTH_MIN_FREE_MB`` MiB free, default 256). More come from plugins (``hp_health_checks``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from hp.core.errors import UsageError
from hp.core.backends.api import HealthCheck
from hp.core.hookspecs import hookimpl

EXIT_UNHEALTHY = 74  # EX_IOERR: this process's device failed a health check; the agent replaces it
MIN_FREE_ENV = "HP_HEALTH_MIN_FREE_MB"


class CudaHealth(HealthCheck):
    name = "cuda"

    def applies(self, device: str) -> bool:
        return device.startswith("cuda")

    def run(self, device: str) -> str | None:
        import torch

        try:
            if not torch.cuda.is_available():
                return "CUDA is not available any more"
            with torch.cuda.device(device):
                x = torch.ones(256, 256, device=device)
                if float((x @ x).sum()) != 256.0 ** 3:  # the kernel ran and its result came back
                    return f"a small matmul on {device} gave a wrong result"
                torch.cuda.synchronize(device)
                free, _total = torch.cuda.mem_get_info(device)
        except RuntimeError as e:  # a sticky CUDA error (illegal address, ECC): this context is done
            return f"{device}: {str(e).splitlines()[0][:200]}"
        need = min_free_mb(os.environ) << 20
        if free < need:
            return f"{device} has {free >> 20} MiB free, less than {need >> 20} MiB"
        return None


def min_free_mb(env) -> int:
    """``HP_HEALTH_MIN_FREE_MB`` (default 256); :class:`UsageError` (one line) unless a non-negative integer.
    ``hp run`` checks it before anything starts, so a rank never meets it first in a recovery."""
    raw = env.get(MIN_FREE_ENV, "256")
    if not raw.isdigit():
        raise UsageError(f"{MIN_FREE_ENV} must be a non-negative integer (MiB), got {raw!r}")
    return int(raw)


def first_failure(checks: Iterable[HealthCheck], device: str) -> tuple[str, str] | None:
    """(check name, reason) of the first check for ``device`` that fails, else None."""
    for check in checks:
        if check.applies(device):
            reason = check.run(device)
            if reason is not None:
                return check.name, reason
    return None


@hookimpl
def hp_health_checks() -> list[HealthCheck]:
    return [CudaHealth()]

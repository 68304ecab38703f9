"""Slurm for hp jobs: the ``slurm`` scheduler backend and elastic jobs made of a base and scaling units.

================= ===========================================================================================
module            one idea
================= ===========================================================================================
:mod:`.backend`   :class:`SlurmScheduler` (hosts, capacity, submit/cancel through Slurm's own commands)
:mod:`.quota`     how many nodes a job's QOS lets it hold (pure)
:mod:`.job`       :class:`SlurmJobSpec`: the base ``sbatch`` job and its one-node unit jobs
:mod:`.units`     the base job's agents and the :class:`UnitKeeper` that keeps unit jobs queued (pure decision)
:mod:`.cli`       ``hp slurm submit|capacity|base|agent``
================= ===========================================================================================

This module is the backend's entry point (``hp`` group): it imports nothing of the backend until the
``scheduler`` family is listed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hp.core.hookspecs import hookimpl

if TYPE_CHECKING:
    from hp.core.schedulers.api import SchedulerBackend


@hookimpl
def hp_scheduler_backends() -> list[SchedulerBackend]:
    from hp.core.schedulers.slurm.backend import SlurmScheduler

    return [SlurmScheduler()]

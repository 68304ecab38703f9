"""Schedulers: where a job's processes run and how its capacity changes.

One contract (:mod:`.api`: :class:`Capacity`, :class:`SchedulerBackend`) and one module per backend, each its
own entry point in the ``hp`` group, found by name through :func:`hp.core.plugins.get_backend`
(``get_backend("scheduler", "slurm")``): :mod:`.local` (this host), :mod:`.slurm`, :mod:`.k8s`. A
third-party scheduler is one more module that implements ``hp_scheduler_backends``.
"""

from hp.core.schedulers.api import Capacity, SchedulerBackend

__all__ = ["Capacity", "SchedulerBackend"]

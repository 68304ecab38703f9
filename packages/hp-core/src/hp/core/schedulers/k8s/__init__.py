"""Kubernetes for hp jobs: manifests (JobSet or Volcano, Kueue labels), the ``kubernetes`` scheduler backend,
the pure fold of watch events into scale decisions, and the watcher that acts on them in a running job.

========================== ============================================================================
module                     one idea
========================== ============================================================================
:mod:`.names`              the API server's rules for names, label values, quantities, image references
:mod:`.manifest`           :class:`ManifestConfig` and :func:`manifests`: the objects of one job (pure)
:mod:`.volcano`            the worker groups as a Volcano Job
:mod:`.schemas`            the vendored CRD schemas (``crds/``) and strict validation against them
:mod:`.watch`              :class:`JobWatch`: Pod/Node/Workload watch events -> ScaleEvent, Capacity
:mod:`.rbac`               the watcher's ServiceAccount, Role(Binding), ClusterRole(Binding)
:mod:`.backend`            :class:`KubernetesScheduler`, the ``kubernetes`` scheduler backend
:mod:`.operator`           ``hp k8s watch``: the watches, and :class:`Reactions` to the decisions
:mod:`.cli`                ``hp k8s manifest``; :mod:`.watch_cli`: ``hp k8s watch``
========================== ============================================================================

Names are imported on first use: nothing here imports the ``kubernetes`` client until a backend talks to
a cluster. This module is the backend's entry point (``hp`` group).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hp.core.hookspecs import hookimpl

if TYPE_CHECKING:
    from hp.core.schedulers.api import SchedulerBackend

_EXPORTS = {
    "K8sConfigError": "hp.core.schedulers.k8s.names",
    "ManifestConfig": "hp.core.schedulers.k8s.manifest", "manifests": "hp.core.schedulers.k8s.manifest", "DEFAULT_IMAGE": "hp.core.schedulers.k8s.manifest",
    "volcano_job": "hp.core.schedulers.k8s.volcano",
    "SchemaError": "hp.core.schedulers.k8s.schemas",
    "JobWatch": "hp.core.schedulers.k8s.watch", "Phase": "hp.core.schedulers.k8s.watch", "Decision": "hp.core.schedulers.k8s.watch",
    "WatchEventError": "hp.core.schedulers.k8s.watch", "PodRef": "hp.core.schedulers.k8s.watch",
    "Reactions": "hp.core.schedulers.k8s.operator",
    "KubernetesScheduler": "hp.core.schedulers.k8s.backend", "KubernetesError": "hp.core.schedulers.k8s.backend",
    "parse_handle": "hp.core.schedulers.k8s.backend",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hp.core.schedulers.k8s' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


@hookimpl
def hp_scheduler_backends() -> list[SchedulerBackend]:
    from hp.core.schedulers.k8s.backend import KubernetesScheduler  # the client itself is imported on first use

    return [KubernetesScheduler()]

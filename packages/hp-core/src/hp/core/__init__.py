"""hp-core: plugins, the per-node agent (``hp run``), the job controller and the coordination store.

Names are imported on first use: a worker that needs only the contracts of :mod:`hp.core.protocol`
does not load the controller, pluggy or the backends.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Endpoint": "hp.core.config", "RunConfig": "hp.core.config", "parse_endpoint": "hp.core.config",
    "Controller": "hp.core.controller", "ControllerConfig": "hp.core.controller",
    "ElasticController": "hp.core.controller", "RecoveryPolicy": "hp.core.controller",
    "BackendUnavailableError": "hp.core.errors", "ControlPlaneError": "hp.core.errors", "HpError": "hp.core.errors",
    "UnknownBackendError": "hp.core.errors", "UsageError": "hp.core.errors",
    "hookimpl": "hp.core.hookspecs", "hookspec": "hp.core.hookspecs",
    "BackendInfo": "hp.core.plugins", "backends": "hp.core.plugins", "get_backend": "hp.core.plugins",
    "get_plugin_manager": "hp.core.plugins", "list_backends": "hp.core.plugins", "PluginError": "hp.core.plugins",
    "GENERATION_KEY": "hp.core.protocol", "STATE_NBYTES_KEY": "hp.core.protocol", "Decision": "hp.core.protocol",
    "Event": "hp.core.protocol", "FailureAction": "hp.core.protocol", "JobState": "hp.core.protocol",
    "Plan": "hp.core.protocol", "ProtocolError": "hp.core.protocol", "SpareAssignment": "hp.core.protocol",
    "Verb": "hp.core.protocol", "arrive_prefix": "hp.core.protocol", "node_service_key": "hp.core.protocol",
    "plan_key": "hp.core.protocol", "spare_holder": "hp.core.protocol", "spare_id": "hp.core.protocol",
    "spare_key": "hp.core.protocol", "worker_holder": "hp.core.protocol",
    "Capacity": "hp.core.schedulers.api", "SchedulerBackend": "hp.core.schedulers.api",
    "StoreBackend": "hp.core.backends.api", "StoreServer": "hp.core.backends.api",
    "TransportBackend": "hp.core.backends.api", "generation_prefix": "hp.core.transport",
    "HealthCheck": "hp.core.backends.api", "DeviceSlots": "hp.core.devices",
    "WorkerContext": "hp.core.worker", "WorkerEnv": "hp.core.worker_env",
    "CONTROLLER_KEY": "hp.core.protocol", "ControllerReplica": "hp.core.leader", "LeaderResolver": "hp.core.leader",
    "Lease": "hp.core.leader", "StateKeeper": "hp.core.leader",
    "Relay": "hp.core.fanout", "Mirror": "hp.core.fanout",
    "SlurmScheduler": "hp.core.schedulers.slurm.backend", "SlurmCli": "hp.core.schedulers.slurm.backend",
    "SlurmError": "hp.core.schedulers.slurm.backend", "FailureReport": "hp.core.node_failure",
    "KubernetesScheduler": "hp.core.schedulers.k8s.backend", "KubernetesError": "hp.core.schedulers.k8s.backend",
    "ManifestConfig": "hp.core.schedulers.k8s.manifest", "JobWatch": "hp.core.schedulers.k8s.watch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hp.core' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

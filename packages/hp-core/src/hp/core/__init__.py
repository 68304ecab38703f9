"""hp-core: plugins, the per-node agent (``hp run``), the job controller and the coordination store."""

from hp.core.config import Endpoint, RunConfig, parse_endpoint
from hp.core.controller import Controller, ControllerConfig, JobState
from hp.core.errors import BackendUnavailableError, ControlPlaneError, HpError, UnknownBackendError, UsageError
from hp.core.hookspecs import hookimpl, hookspec
from hp.core.plugins import BackendInfo, backends, get_backend, get_plugin_manager, list_backends
from hp.core.scheduler import Capacity, SchedulerBackend
from hp.core.store import StoreBackend, StoreServer
from hp.core.transport import TransportBackend, generation_prefix
from hp.core.worker import WorkerContext

__all__ = [
    "BackendInfo", "BackendUnavailableError", "Capacity", "ControlPlaneError", "Controller",
    "ControllerConfig", "Endpoint", "HpError", "JobState", "RunConfig", "SchedulerBackend",
    "StoreBackend", "StoreServer", "TransportBackend", "UnknownBackendError", "UsageError",
    "WorkerContext", "backends", "generation_prefix", "get_backend", "get_plugin_manager",
    "hookimpl", "hookspec", "list_backends", "parse_endpoint",
]

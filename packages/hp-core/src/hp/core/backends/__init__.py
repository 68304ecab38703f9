"""The contracts of hp-core's backend families (:mod:`hp.core.backends.api`)."""

from hp.core.backends.api import (HealthCheck, NodeContext, NodeService, RunningService, ServiceError, StoreBackend,
                                  StoreServer, TransportBackend)

__all__ = ["HealthCheck", "NodeContext", "NodeService", "RunningService", "ServiceError", "StoreBackend",
           "StoreServer", "TransportBackend"]

"""Moved: the elastic controller is :mod:`hp.core.controller.elastic` (``from hp.core.controller import
ElasticController``). This name stays only until the agent's import follows; nothing else uses it."""

from hp.core.controller.elastic import ElasticController, ElasticPolicy

__all__ = ["ElasticController", "ElasticPolicy"]

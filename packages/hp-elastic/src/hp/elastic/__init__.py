"""hp elastic training: scaling policy, constant or per-replica batch, LR per world size, exact mode.

:class:`ScalingPolicy` (sizes, batch geometry, LR rules; YAML; a ``StepSampler``'s geometry),
:func:`decide` (pure scaling decisions, which the hp-core controller gets through this package's
plugin), :func:`owned` / :func:`owner` (micro-batch ownership at any world size), :func:`on_scale_lr`
(the policy's LR at a new size, scheduler included) and :class:`ExactReduction` / :func:`exact_mean`
(the W-independent gradient reduction of exact mode). The runtime that re-forms a job at a new world
size is hp-checkpointless's.

Names are imported on first use: ``import hp.elastic`` must not import torch (the ``hp`` CLI and the
policy loader do not need it).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ScalingPolicy": "hp.elastic.policy", "WorldOverride": "hp.elastic.policy",
    "ScaleAction": "hp.elastic.decide", "ScaleDecision": "hp.elastic.decide", "decide": "hp.elastic.decide",
    "Failure": "hp.elastic.decide", "Preemption": "hp.elastic.decide", "CapacityChanged": "hp.elastic.decide",
    "owned": "hp.elastic.ownership", "owner": "hp.elastic.ownership",
    "micro_batch_seed": "hp.elastic.ownership",
    "exact_mean": "hp.elastic.exact", "quantize": "hp.elastic.exact", "dequantize": "hp.elastic.exact",
    "scale_shift": "hp.elastic.exact", "precision_bits": "hp.elastic.exact",
    "NonFiniteGradientError": "hp.elastic.exact",
    "rescale_lr": "hp.elastic.lr", "on_scale_lr": "hp.elastic.lr", "ExactReduction": "hp.elastic.exact",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hp.elastic' has no attribute {name!r}")

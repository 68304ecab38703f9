"""hp-checkpointless: in-process recovery of a training job with hot spares and peer hydration.

Wrap the training function with :func:`recoverable`, register the training state on the
:class:`Context` it receives and run each step inside ``with step:`` ending in ``ctx.commit(loss)``.

Names are imported on first use: the ``hp`` CLI loads this package's plugin on every call and must
not pay for torch and torch.distributed.checkpoint (seconds) to print its help.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CollectiveError": "hp.checkpointless.recovery", "Context": "hp.checkpointless.runtime",
    "JobEnded": "hp.checkpointless.recovery", "Step": "hp.checkpointless.runtime",
    "recoverable": "hp.checkpointless.runtime", "FaultPlan": "hp.checkpointless.faults",
    "InjectedFault": "hp.checkpointless.faults", "JobCheckpoint": "hp.checkpointless.ladder",
    "ShardLost": "hp.checkpointless.sharded", "RankState": "hp.checkpointless.recovery",
    "RecoveryMachine": "hp.checkpointless.recovery", "StepSampler": "hp.checkpointless.sampler",
    "StepLoader": "hp.checkpointless.sampler", "TrainingState": "hp.checkpointless.registry",
    "BatchGeometry": "hp.checkpointless.sampler", "ConstantBatch": "hp.checkpointless.sampler",
    "MeanReduction": "hp.checkpointless.reduction", "OverlappedMeanReduction": "hp.checkpointless.overlap",
}

__all__ = sorted(_EXPORTS)
# the modules behind these names: what a node's fork server imports before it forks workers (cli.py)
RUNTIME_MODULES = tuple(sorted(set(_EXPORTS.values())))


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hp.checkpointless' has no attribute {name!r}")

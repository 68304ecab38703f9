"""hp tiered checkpointing: node memory tier with cross-node replicas, async fsspec persistence in DCP format.

``save(state_dict, step, cfg)`` costs the training loop one copy into the node daemon's staging
memory; the daemon checksums, replicates to peer daemons and uploads to S3 / a shared filesystem in
standard DCP layout. ``load(state_dict, cfg)`` restores the newest complete step from the fastest
tier holding a good copy; ``latest(cfg)`` says which step and tier that is.

Torch-dependent names (``save``, ``load``, ``latest``, ``TieredWriter``, ``TieredReader``) are
imported lazily so that the ``hp`` CLI and the daemon start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from hp.tiered_ckpt.config import TieredConfig

_LAZY = {
    "save": "hp.tiered_ckpt.api", "load": "hp.tiered_ckpt.api", "latest": "hp.tiered_ckpt.api",
    "TieredWriter": "hp.tiered_ckpt.writer", "TieredReader": "hp.tiered_ckpt.reader",
    "CheckpointRef": "hp.tiered_ckpt.reader", "CheckpointCorruptError": "hp.tiered_ckpt.reader",
    "NoCheckpointError": "hp.tiered_ckpt.reader", "find_latest": "hp.tiered_ckpt.reader",
    "sources_for": "hp.tiered_ckpt.sources", "PersistentTier": "hp.tiered_ckpt.persist",
    "DaemonClient": "hp.tiered_ckpt.client", "Daemon": "hp.tiered_ckpt.daemon",
    "DaemonConfig": "hp.tiered_ckpt.daemon", "UnsafeItemError": "hp.tiered_ckpt.fmt",
}

__all__ = ["TieredConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hp.tiered_ckpt' has no attribute {name!r}")

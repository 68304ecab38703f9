"""hp-tiered-ckpt's storage tiers (plugin family ``storage``), fastest first by ``rank``.

Each tier turns a :class:`~hp.tiered_ckpt.config.TieredConfig` into the read sources it stands
for (none when the config does not use it). Readers list the family through the plugin manager,
so a third-party tier (say, a local NVMe cache) slots in by entry point with its own ``rank``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hp.core.hookspecs import hookimpl
from hp.tiered_ckpt.config import TieredConfig


@dataclass(frozen=True)
class MemoryTier:
    """This node's daemon: shards written here and replicas received from peers."""

    name: str = "memory"
    rank: int = 0

    def sources(self, cfg: TieredConfig) -> list:
        from hp.tiered_ckpt.client import DaemonClient
        from hp.tiered_ckpt.sources import DaemonSource

        return [DaemonSource(self.name, [DaemonClient(cfg.daemon_addr(), cfg.token, timeout=10)], cfg.namespace)]


@dataclass(frozen=True)
class PeerTier:
    """Other nodes' daemons (their shards and the replicas they hold of ours)."""

    name: str = "peer"
    rank: int = 1

    def sources(self, cfg: TieredConfig) -> list:
        from hp.tiered_ckpt.client import DaemonClient
        from hp.tiered_ckpt.sources import DaemonSource

        if not cfg.peers:
            return []
        return [DaemonSource(self.name, [DaemonClient(a, cfg.token, timeout=10) for a in cfg.peer_addrs()],
                             cfg.namespace)]


@dataclass(frozen=True)
class FsspecTier:
    """The persistent tier: any fsspec URL (s3://, file://, a mounted FSx for Lustre path)."""

    name: str = "persistent"
    rank: int = 2

    def sources(self, cfg: TieredConfig) -> list:
        from hp.tiered_ckpt.persist import PersistentTier
        from hp.tiered_ckpt.sources import PersistentSource

        return [PersistentSource(PersistentTier(cfg.persist_url, cfg.namespace, cfg.token))] if cfg.persist_url else []


@hookimpl
def hp_storage_tiers() -> list[object]:
    return [MemoryTier(), PeerTier(), FsspecTier()]

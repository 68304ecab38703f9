"""Where a checkpoint can be read from, fastest first: this node's daemon (``memory``), other nodes'
daemons (``peer``), the persistent tier (``persistent``).

Each source answers which steps it holds *complete* (metadata and every rank's file, checksummed;
for the persistent tier: the commit marker), the step's metadata and file manifests, and byte
ranges of files. An unreachable source simply holds nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hp.tiered_ckpt import wire
from hp.tiered_ckpt.client import DaemonClient
from hp.tiered_ckpt.config import TieredConfig
from hp.tiered_ckpt.persist import PersistentTier

log = logging.getLogger("hp.tiered_ckpt")


class Source:
    tier: str

    def complete_steps(self) -> list[int]:
        raise NotImplementedError

    def manifest(self, step: int) -> tuple[dict, dict[int, dict]]:
        """(DCP metadata as JSON, rank → {"nbytes", "items": [[offset, length, crc]]})."""
        raise NotImplementedError

    def fetch(self, step: int, rank: int, offset: int, length: int) -> bytes:
        raise NotImplementedError


@dataclass
class DaemonSource(Source):
    """One or more daemons holding one tier: a file may be on any of them (shards + replicas)."""

    tier: str
    clients: list[DaemonClient]
    ns: str

    def _listings(self) -> list[tuple[DaemonClient, list[dict]]]:
        out = []
        for c in self.clients:
            try:
                out.append((c, c.steps(self.ns)))
            except (OSError, wire.WireError) as e:
                log.info("%s daemon %s unreachable: %s", self.tier, c, e)
        return out

    def complete_steps(self) -> list[int]:
        have: dict[int, tuple[int, set[int], bool]] = {}
        for _, steps in self._listings():
            for s in steps:
                world, ranks, meta = have.get(s["step"], (s["world"], set(), False))
                have[s["step"]] = (world, ranks | set(s["ranks"]), meta or s["has_meta"])
        return sorted(s for s, (w, ranks, meta) in have.items() if meta and ranks >= set(range(w)))

    def manifest(self, step: int) -> tuple[dict, dict[int, dict]]:
        meta, files, self._where = None, {}, {}
        for c in self.clients:
            try:
                m = c.manifest(self.ns, step)
            except (OSError, wire.WireError):
                continue
            meta = meta or m["meta"]
            for r, f in m["files"].items():
                files.setdefault(int(r), f)
                self._where.setdefault(int(r), []).append(c)
        if meta is None:
            raise FileNotFoundError(f"step {step}: no metadata in the {self.tier} tier")
        return meta, files

    def fetch(self, step: int, rank: int, offset: int, length: int) -> bytes:
        errors = []
        for c in getattr(self, "_where", {}).get(rank, self.clients):
            try:
                return c.fetch(self.ns, step, rank, offset, length)
            except (OSError, wire.WireError) as e:
                errors.append(f"{c}: {e}")
        raise OSError(f"rank {rank} file of step {step} unreadable from the {self.tier} tier: {errors}")


@dataclass
class PersistentSource(Source):
    tier_obj: PersistentTier
    tier: str = "persistent"

    def complete_steps(self) -> list[int]:
        try:
            return self.tier_obj.committed()
        except Exception as e:  # an outage makes the tier hold nothing for now, it is not fatal
            log.warning("persistent tier %s unreachable: %s", self.tier_obj.url, e)
            return []

    def manifest(self, step: int) -> tuple[dict, dict[int, dict]]:
        return self.tier_obj.manifest(step)

    def fetch(self, step: int, rank: int, offset: int, length: int) -> bytes:
        return self.tier_obj.fetch(step, rank, offset, length)


def sources_for(cfg: TieredConfig) -> list[Source]:
    """The job's sources in read order: every ``storage`` tier plugin, fastest (lowest rank) first."""
    from hp.core.plugins import backends

    tiers = sorted(backends("storage").values(), key=lambda t: t.rank)
    return [src for t in tiers for src in t.sources(cfg)]

"""Where a checkpoint can be read from, fastest first: this node's daemon (``memory``), other nodes'
daemons (``peer``), the persistent tier (``persistent``).

Each source answers which steps it holds *complete* (metadata and every rank's file of one save,
checksummed; for the persistent tier: a verified commit marker) and of which save, the step's
metadata and file manifests, and byte ranges of files. An unreachable source simply holds nothing.
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

    def complete_steps(self) -> dict[int, str]:
        """Step → the save id of its complete copy here."""
        raise NotImplementedError

    def manifest(self, step: int, save_id: str) -> tuple[dict, dict[int, dict]]:
        """(DCP metadata as JSON, rank → {"nbytes", "items": [[offset, length, crc]]}) of that save."""
        raise NotImplementedError

    def fetch(self, step: int, rank: int, offset: int, length: int, save_id: str) -> bytes:
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

    def complete_steps(self) -> dict[int, str]:
        """A step is complete when, for one save, some daemon has its metadata and the daemons
        together hold every rank's file of it (shards here, replicas there); the newest such save."""
        metas: dict[int, dict[str, int]] = {}          # step -> save id of a metadata -> world
        files: dict[tuple[int, str], set[int]] = {}    # (step, save id) -> ranks held somewhere
        for _, steps in self._listings():
            for s in steps:
                if s["has_meta"] and s.get("save_id"):
                    metas.setdefault(s["step"], {})[s["save_id"]] = s["world"]
                for r, sid in s.get("files", {}).items():
                    files.setdefault((s["step"], sid), set()).add(int(r))
        out = {}
        for step, ids in metas.items():
            whole = [sid for sid, world in ids.items() if files.get((step, sid), set()) >= set(range(world))]
            if whole:
                out[step] = max(whole)
        return out

    def manifest(self, step: int, save_id: str) -> tuple[dict, dict[int, dict]]:
        meta, files, self._where = None, {}, {}
        for c in self.clients:
            try:
                m = c.manifest(self.ns, step)
            except (OSError, wire.WireError):
                continue
            if m.get("save_id") == save_id:
                meta = meta or m["meta"]
            for r, f in m["files"].items():
                if f.get("save_id") == save_id:
                    files.setdefault(int(r), f)
                    self._where.setdefault(int(r), []).append(c)
        if meta is None:
            raise FileNotFoundError(f"step {step}: no metadata of save {save_id} in the {self.tier} tier")
        return meta, files

    def fetch(self, step: int, rank: int, offset: int, length: int, save_id: str) -> bytes:
        errors = []
        for c in getattr(self, "_where", {}).get(rank, self.clients):
            try:
                return c.fetch(self.ns, step, rank, offset, length, save_id)
            except (OSError, wire.WireError) as e:
                errors.append(f"{c}: {e}")
        raise OSError(f"rank {rank} file of step {step} unreadable from the {self.tier} tier: {errors}")


@dataclass
class PersistentSource(Source):
    tier_obj: PersistentTier
    tier: str = "persistent"

    def complete_steps(self) -> dict[int, str]:
        try:
            return {s: doc["save_id"] for s, doc in self.tier_obj.commits().items() if doc is not None}
        except Exception as e:  # an outage makes the tier hold nothing for now, it is not fatal
            log.warning("persistent tier %s unreachable: %s", self.tier_obj.url, e)
            return {}

    def manifest(self, step: int, save_id: str) -> tuple[dict, dict[int, dict]]:
        return self.tier_obj.manifest(step, save_id)

    def fetch(self, step: int, rank: int, offset: int, length: int, save_id: str) -> bytes:
        return self.tier_obj.fetch(step, rank, offset, length)


def sources_for(cfg: TieredConfig) -> list[Source]:
    """The job's sources in read order: every ``storage`` tier plugin, fastest (lowest rank) first."""
    from hp.core.plugins import backends

    tiers = sorted(backends("storage").values(), key=lambda t: t.rank)
    return [src for t in tiers for src in t.sources(cfg)]

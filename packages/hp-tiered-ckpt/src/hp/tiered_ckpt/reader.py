"""DCP ``StorageReader`` over every tier: the newest complete step, each item read from the fastest
tier holding it and checked against that tier's per-item CRC32. A mismatch or a short read falls
back to the next tier with a warning; when no tier has a good copy the load fails loudly
(:class:`CheckpointCorruptError`) rather than loading bad bytes.
"""

from __future__ import annotations

import io
import logging
import zlib
from torch.futures import Future
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from hp.core.errors import HpError
from hp.tiered_ckpt import fmt
from hp.tiered_ckpt.sources import Source

log = logging.getLogger("hp.tiered_ckpt")


class CheckpointCorruptError(HpError):
    """No tier holds a copy of an item whose checksum matches."""


class NoCheckpointError(HpError):
    """No tier holds a complete checkpoint (for the step asked for)."""


@dataclass(frozen=True)
class CheckpointRef:
    """The newest complete checkpoint of a namespace: its step, save and the fastest tier holding it."""

    step: int
    tier: str
    tiers: tuple[str, ...]  # every tier holding that save complete, fastest first
    save_id: str = ""


def find_latest(sources: list[Source], step: int | None = None, below: int | None = None,
                save_id: str | None = None) -> CheckpointRef:
    """Newest complete step in any tier (or ``step`` itself; or the newest older than ``below``),
    with the tiers that hold it. Tiers may hold different saves of one step (a retried step): the
    newest save wins (or ``save_id``), and only tiers holding that one are used."""
    held = {s.tier: s.complete_steps() for s in sources}
    if save_id is not None:
        held = {t: {k: v for k, v in h.items() if v == save_id} for t, h in held.items()}
    candidates = set().union(*held.values()) if held else set()
    if step is not None:
        candidates &= {step}
    if below is not None:
        candidates = {s for s in candidates if s < below}
    if not candidates:
        what = f"step {step}" if step is not None else "any step" if below is None else f"a step before {below}"
        raise NoCheckpointError(f"no complete checkpoint of {what} in tiers {[s.tier for s in sources]}")
    best = max(candidates)
    newest = max(h[best] for h in held.values() if best in h)
    tiers = tuple(s.tier for s in sources if held[s.tier].get(best) == newest)
    return CheckpointRef(best, tiers[0], tiers, newest)


def find_readable(sources: list[Source], step: int | None = None, below: int | None = None) -> CheckpointRef:
    """:func:`find_latest`, narrowed to the tiers whose manifests of that save verify (signatures,
    the digests the commit marker pins); a step no tier can vouch for is passed over, with a warning,
    for the next older one (unless ``step`` was asked for)."""
    passed_over: CheckpointCorruptError | None = None
    while True:
        try:
            ref = find_latest(sources, step, below)
        except NoCheckpointError:
            if passed_over is None:
                raise
            raise passed_over from None  # nothing older: say why the newest was refused
        good, problems = [], []
        for src in sources:
            if src.tier in ref.tiers:
                try:
                    src.manifest(ref.step, ref.save_id)
                    good.append(src.tier)
                except Exception as e:  # noqa: BLE001  unsigned, altered, of another save, unreachable
                    problems.append(f"{src.tier}: {e}")
        if good:
            return CheckpointRef(ref.step, good[0], tuple(good), ref.save_id)
        error = CheckpointCorruptError(f"step {ref.step}: no tier's manifests verify: " + "; ".join(problems))
        if step is not None:
            raise error
        log.warning("%s; trying an older step", error)
        passed_over, below = passed_over or error, ref.step


def _safe_bytes(data: bytes, fqn: str) -> io.BytesIO:
    """The item re-saved from its safely decoded value: DCP's planner unpickles what it is handed
    with ``weights_only=False``, so it gets bytes hp wrote from plain values, never the stored ones."""
    try:
        value = fmt.load_bytes_item(data, fqn)
    except ValueError as e:
        raise CheckpointCorruptError(str(e)) from None
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return buf


class TieredReader(StorageReader):
    def __init__(self, sources: list[Source], step: int | None = None, save_id: str | None = None) -> None:
        super().__init__()
        self.ref = find_latest(sources, step, save_id=save_id)
        self.sources = [s for s in sources if s.tier in self.ref.tiers]
        self._manifests: dict[str, dict[int, dict]] = {}
        self.tiers_used: set[str] = set()
        self.fallbacks: list[str] = []
        self.skipped: list[str] = []  # whole steps skipped before this one (api.load)

    @property
    def step(self) -> int:
        return self.ref.step

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args, **kwargs) -> Metadata:
        errors = []
        for src in self.sources:
            try:
                meta, files = src.manifest(self.step, self.ref.save_id)
            except Exception as e:
                errors.append(f"{src.tier}: {e}")
                continue
            self._manifests[src.tier] = {r: {(o, n): c for o, n, c in f["items"]} for r, f in files.items()}
            return fmt.metadata_from_json(meta)
        raise NoCheckpointError(f"metadata of step {self.step} unreadable: {errors}")

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _crcs(self, src: Source, rank: int) -> dict:
        if src.tier not in self._manifests:
            _, files = src.manifest(self.step, self.ref.save_id)
            self._manifests[src.tier] = {r: {(o, n): c for o, n, c in f["items"]} for r, f in files.items()}
        return self._manifests[src.tier].get(rank, {})

    def read_item(self, relative_path: str, offset: int, length: int) -> bytes:
        rank = int(relative_path.split("_")[2])
        problems = []
        for src in self.sources:
            try:
                want = self._crcs(src, rank).get((offset, length))
                data = src.fetch(self.step, rank, offset, length, self.ref.save_id)
            except Exception as e:
                problems.append(f"{src.tier}: {e}")
            else:
                if want is None:
                    problems.append(f"{src.tier}: no checksum for {relative_path}@{offset}")
                elif len(data) != length:
                    problems.append(f"{src.tier}: {relative_path}@{offset} short read {len(data)}/{length} (truncated)")
                elif zlib.crc32(data) != want:
                    problems.append(f"{src.tier}: {relative_path}@{offset}+{length} checksum mismatch")
                else:
                    self.tiers_used.add(src.tier)
                    return data
            log.warning("step %d: %s; trying the next tier", self.step, problems[-1])
            self.fallbacks.append(problems[-1])
        raise CheckpointCorruptError(f"step {self.step}: no tier has a good copy of {relative_path}@{offset}: "
                                     + "; ".join(problems))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            data = self.read_item(info.relative_path, info.offset, info.length)
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, _safe_bytes(data, req.storage_index.fqn))
                continue
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                tensor = tensor.narrow(dim, offset, length)  # the requested chunk of the saved tensor
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise CheckpointCorruptError(f"{req.storage_index.fqn}: size {tuple(tensor.size())} in the "
                                             f"checkpoint, {tuple(target.size())} expected")
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

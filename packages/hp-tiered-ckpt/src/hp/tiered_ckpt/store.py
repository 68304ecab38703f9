"""The node daemon's memory store: staging slots, sealed files, replicas and metadata, by namespace.

Files live under a directory on a tmpfs (``/dev/shm`` by default) so they survive the crash of the
worker that wrote them. Each rank has a small pool of *slot* files that are allocated once and
reused (a fresh page costs ~4x a copy into a warm one); a slot that holds one of the newest
``keep`` steps, or that is being checksummed, replicated or uploaded, is never handed out.

A step may be saved more than once (a retried step after a recovery): each save has its own id
(:mod:`hp.tiered_ckpt.signed`). A step is complete only when its metadata and every rank's file are
of one save; a file or metadata of an older save than one already seen for the step is refused.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from hp.core.config import NAME_RE
from hp.core.privfs import open_private, private_dir
from hp.tiered_ckpt import fmt, signed


@dataclass
class FileRec:
    """One rank's ``.distcp`` file of one step."""

    rank: int
    path: str
    nbytes: int
    spans: list[list[int]]                 # [offset, length] of every item
    save_id: str
    items: list[list[int]] | None = None   # [offset, length, crc32] once checksummed
    primary: bool = True                   # written on this node (False: a replica from a peer)
    busy: int = 0                          # replication/upload in flight: the slot must not be reused

    def manifest(self) -> dict:
        return {"rank": self.rank, "nbytes": self.nbytes, "items": self.items, "save_id": self.save_id}


@dataclass
class StepRec:
    step: int
    world: int
    files: dict[int, FileRec] = field(default_factory=dict)
    meta_json: dict | None = None
    meta_pickle: bytes | None = None       # DCP's own .metadata, opaque bytes here: never unpickled
    meta_primary: bool = False             # committed by this node's coordinator rank
    save_id: str | None = None             # the save the metadata belongs to
    latest_id: str = ""                    # the newest save of this step seen here (older ones are refused)
    persist_url: str | None = None
    persisted: bool = False
    pinned: int = 0                        # metadata upload queued or in flight: keep the record

    def ready_ranks(self) -> list[int]:
        """Ranks whose file is checksummed and of the same save as the metadata."""
        return sorted(r for r, f in self.files.items() if f.items is not None and f.save_id == self.save_id)

    def complete(self) -> bool:
        return self.meta_json is not None and self.ready_ranks() == list(range(self.world))

    def admit(self, save_id: str) -> None:
        """Refuse a message of an older save than one already seen for this step (a late replica,
        a worker of a superseded generation); remember a newer one. Caller holds the store's lock."""
        if not signed.is_save_id(save_id):
            raise ValueError(f"bad save id {save_id!r}")
        if save_id < self.latest_id:
            raise ValueError(f"step {self.step}: save {save_id} is older than save {self.latest_id}: stale, refused")
        self.latest_id = save_id


class MemoryStore:
    def __init__(self, root: Path, keep: int = 2) -> None:
        self.root = root
        self.keep = keep
        self.lock = threading.Condition()
        self.steps: dict[str, dict[int, StepRec]] = {}
        self.slots: dict[tuple[str, int], list[int | None]] = {}   # (ns, rank) -> step held by slot k
        private_dir(root)  # the job's weights: no other local user may read them or plant a slot

    def _ns_dir(self, ns: str) -> Path:
        if not NAME_RE.fullmatch(ns or "") or ns in (".", ".."):  # a name from the wire becomes a directory
            raise ValueError(f"bad namespace {ns!r}")
        return private_dir(self.root / ns)

    def slot_path(self, ns: str, rank: int, k: int) -> Path:
        return self._ns_dir(ns) / "slots" / f"rank{rank}.{k}.buf"

    def step_rec(self, ns: str, step: int, world: int) -> StepRec:
        rec = self.steps.setdefault(ns, {}).get(step)
        if rec is None:
            rec = self.steps[ns][step] = StepRec(step, world)
        return rec

    def _kept_steps(self, ns: str) -> set[int]:
        """The newest ``keep`` complete steps and every step newer than them (still being written):
        evicting for a save in progress must never leave the node without a complete step."""
        recs = self.steps.get(ns, {})
        done = sorted((s for s, r in recs.items() if r.complete()), reverse=True)[:max(self.keep, 1)]
        floor = min(done) if done else -1
        return {s for s in recs if s >= floor and (s in done or s > done[0])} if done else set(recs)

    def acquire_slot(self, ns: str, rank: int, step: int, nbytes: int, timeout: float = 600.0) -> str:
        """A staging file of at least ``nbytes`` for (rank, step); waits while every slot is pinned."""
        with self.lock:
            pool = self.slots.setdefault((ns, rank), [])
            ok = self.lock.wait_for(lambda: self._pick(ns, rank, step, pool) is not None, timeout)
            if not ok:
                raise TimeoutError(f"no free staging slot for rank {rank} (all pinned by uploads)")
            k = self._pick(ns, rank, step, pool)
            old = pool[k] if k < len(pool) else None
            if old is not None:
                self._drop_file(ns, old, rank)
            if k == len(pool):
                pool.append(None)
            pool[k] = step
            path = self.slot_path(ns, rank, k)
        private_dir(path.parent)
        fd = open_private(path, os.O_RDWR | os.O_CREAT)
        try:
            if os.fstat(fd).st_size < nbytes:
                os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        return str(path)

    def _pick(self, ns: str, rank: int, step: int, pool: list[int | None]) -> int | None:
        kept = self._kept_steps(ns) - {step}
        # a slot of this step is reused, unless an earlier save of it is still being uploaded from it
        free = [k for k, s in enumerate(pool) if s is None or (s == step and not self._busy(ns, s, rank))]
        if free:
            return free[0]
        if len(pool) < self.keep + 3:  # kept steps + one being uploaded + the newest queued upload + this save
            return len(pool)
        evictable = [(s, k) for k, s in enumerate(pool)
                     if s not in kept and not self._busy(ns, s, rank)]
        return min(evictable)[1] if evictable else None

    def _busy(self, ns: str, step: int | None, rank: int) -> bool:
        rec = self.steps.get(ns, {}).get(step) if step is not None else None
        f = rec.files.get(rank) if rec else None
        return bool(f and (f.busy or f.items is None))

    def _drop_file(self, ns: str, step: int, rank: int) -> None:
        rec = self.steps.get(ns, {}).get(step)
        if rec is not None:
            rec.files.pop(rank, None)
            if not rec.files and not rec.meta_primary:
                self.steps[ns].pop(step, None)

    def seal(self, ns: str, rank: int, step: int, world: int, path: str, nbytes: int,
             spans: list[list[int]], persist_url: str | None, save_id: str) -> FileRec:
        with self.lock:
            # only the slot this daemon handed out for (rank, step): a client cannot make the
            # daemon read, replicate or upload any other file
            pool = self.slots.get((ns, rank), [])
            if not any(held == step and path == str(self.slot_path(ns, rank, k)) for k, held in enumerate(pool)):
                raise ValueError(f"{path!r} is not the staging slot of rank {rank} step {step}")
            size = os.path.getsize(path)
            if not 0 < nbytes <= size or not all(
                    isinstance(o, int) and isinstance(n, int) and 0 <= o and 0 <= n and o + n <= nbytes
                    for o, n in spans):
                raise ValueError(f"item spans or size ({nbytes}) outside the {size}-byte slot")
            if world < 1 or not 0 <= rank < world:
                raise ValueError(f"rank {rank} outside world {world}")
            rec = self.step_rec(ns, step, world)
            rec.admit(save_id)
            rec.persist_url = persist_url or rec.persist_url
            f = rec.files[rank] = FileRec(rank, path, nbytes, spans, save_id)
            self.lock.notify_all()
            return f

    def checksum(self, f: FileRec) -> None:
        """CRC32 of every item: done here, off the training loop."""
        with open(f.path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            mv = memoryview(mm)
            try:
                items = [[o, n, zlib.crc32(mv[o:o + n])] for o, n in f.spans]
            finally:
                mv.release()
        with self.lock:
            f.items = items
            for ns, recs in self.steps.items():
                if any(fr is f for r in recs.values() for fr in r.files.values()):
                    self.trim(ns)
            self.lock.notify_all()

    def put_replica(self, ns: str, step: int, world: int, rank: int, items: list[list[int]], nbytes: int,
                    save_id: str, write) -> None:
        """Store a peer's file: written to a temporary name, renamed only once complete and verified,
        so a peer dying mid-transfer leaves the copies we already had untouched."""
        with self.lock:  # refuse a stale save before receiving it (the record is made once it is whole)
            rec = self.steps.get(ns, {}).get(step)
            StepRec(step, world, latest_id=rec.latest_id if rec else "").admit(save_id)
        d = private_dir(self._ns_dir(ns) / "replicas" / fmt.step_dir(step))
        final = d / f"{fmt.rank_file(rank)}.{save_id}"  # a late copy of another save never overwrites this one
        tmp = d / f"{fmt.rank_file(rank)}.{save_id}.partial{threading.get_ident()}"
        try:
            with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as out:
                write(out)
            if tmp.stat().st_size != nbytes:
                raise ValueError(f"replica is {tmp.stat().st_size} bytes, header said {nbytes}")
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        with self.lock:
            rec = self.step_rec(ns, step, world)
            old = rec.files.get(rank)
            if save_id < rec.latest_id:
                return  # a newer save of the step arrived meanwhile
            rec.latest_id = save_id
            if old is not None and old.primary and old.save_id == save_id:
                return  # our own copy of this save is here
            if old is not None and not old.primary and old.path != str(final):
                Path(old.path).unlink(missing_ok=True)
            rec.files[rank] = FileRec(rank, str(final), nbytes, [i[:2] for i in items], save_id, items, primary=False)
            self.trim(ns)
            self.lock.notify_all()

    def put_meta(self, ns: str, step: int, world: int, meta_json: dict, meta_pickle: bytes,
                 primary: bool, save_id: str) -> StepRec:
        with self.lock:
            rec = self.step_rec(ns, step, world)
            rec.admit(save_id)
            rec.meta_json, rec.meta_pickle, rec.save_id, rec.world = meta_json, meta_pickle, save_id, world
            rec.meta_primary = rec.meta_primary or primary
            self.trim(ns)
            self.lock.notify_all()
            return rec

    def trim(self, ns: str) -> None:
        """Retention: steps older than the kept ones go, unless an upload or a replication still
        reads them (then they go when it ends). Replica files are deleted; primary slot files stay
        allocated (marked free) for the next save to reuse. Caller holds ``lock``."""
        kept = self._kept_steps(ns)
        for step, rec in list(self.steps.get(ns, {}).items()):
            if step in kept or rec.pinned or any(f.busy or f.items is None for f in rec.files.values()):
                continue
            self._forget(ns, step)

    def _forget(self, ns: str, step: int) -> None:
        rec = self.steps[ns].pop(step)
        for f in rec.files.values():
            if not f.primary:
                Path(f.path).unlink(missing_ok=True)
        for (n, _), pool in self.slots.items():
            if n == ns:
                for k, held in enumerate(pool):
                    if held == step:
                        pool[k] = None
        shutil.rmtree(self._ns_dir(ns) / "replicas" / fmt.step_dir(step), ignore_errors=True)

    def gc(self, ns: str, keep: int) -> list[int]:
        """Keep the newest ``keep`` *complete* steps and every step after the oldest of them (saves
        still arriving); forget older ones. A step still being uploaded or read stays. ``keep`` 0
        forgets everything (job end); with no complete step nothing goes: an incomplete newer step
        never pushes out the only complete one. Slot files stay allocated for reuse."""
        with self.lock:
            recs = self.steps.get(ns, {})
            steps = sorted(recs, reverse=True)
            if keep > 0:
                kept = [s for s in steps if recs[s].complete()][:keep]
                steps = [s for s in steps if kept and s < min(kept)]
            gone = [s for s in steps if not recs[s].pinned and not any(f.busy for f in recs[s].files.values())]
            for s in gone:
                self._forget(ns, s)
            self.lock.notify_all()
            return sorted(gone)

    def listing(self, ns: str) -> list[dict]:
        with self.lock:
            return [{"step": s, "world": r.world, "ranks": r.ready_ranks(), "has_meta": r.meta_json is not None,
                     "complete": r.complete(), "persisted": r.persisted, "save_id": r.save_id,
                     "files": {str(k): f.save_id for k, f in r.files.items() if f.items is not None}}
                    for s, r in sorted(self.steps.get(ns, {}).items())]

    def manifest(self, ns: str, step: int) -> dict:
        with self.lock:
            rec = self.steps.get(ns, {}).get(step)
            if rec is None:
                raise KeyError(f"step {step} of namespace {ns!r} is not in memory here")
            return {"world": rec.world, "meta": rec.meta_json, "save_id": rec.save_id,
                    "files": {str(r): f.manifest() for r, f in rec.files.items() if f.items is not None}}

    def file(self, ns: str, step: int, rank: int, save_id: str | None = None) -> FileRec:
        """The checksummed file of (step, rank), of ``save_id`` if given."""
        with self.lock:
            f = self.steps.get(ns, {}).get(step, StepRec(step, 0)).files.get(rank)
            if f is None or f.items is None or (save_id is not None and f.save_id != save_id):
                raise KeyError(f"rank {rank} file of step {step} ({ns!r}"
                               f"{', save ' + save_id if save_id else ''}) is not in memory here")
            return f

    def namespaces(self) -> list[str]:
        with self.lock:
            return sorted(self.steps)

    def write_index(self) -> None:
        """A JSON summary next to the files, for people looking at /dev/shm."""
        for ns in self.namespaces():
            (self._ns_dir(ns) / "index.json").write_text(json.dumps(self.listing(ns)))

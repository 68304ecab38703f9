"""The thin helpers most training scripts need: ``save(state_dict, step)``, ``load(state_dict)``,
``latest()``. Both go through ``torch.distributed.checkpoint`` with hp's writer/reader, so the
script's state dict (model, optimizer, DTensor/FSDP shards, extra objects) is whatever DCP accepts.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from hp.core.errors import HpError
from hp.tiered_ckpt.config import TieredConfig
from hp.tiered_ckpt.fmt import UnsafeItemError
from hp.tiered_ckpt.reader import (
    CheckpointCorruptError, CheckpointRef, NoCheckpointError, TieredReader, find_latest, find_readable,
)
from hp.tiered_ckpt.sources import sources_for
from hp.tiered_ckpt.writer import TieredWriter

log = logging.getLogger("hp.tiered_ckpt")


def save(state_dict: dict, step: int, cfg: TieredConfig, force: bool = False) -> bool:
    """Checkpoint ``state_dict`` as ``step`` if the config's frequencies say so (``force``: whatever they
    say, persisted too where a persistent tier is configured: a preempted job's last save); returns
    whether it did.

    Blocks only for the copy into the node daemon's staging memory (plus DCP's planning
    collectives); persistence happens later, in the daemon.
    """
    persist = cfg.persist_url is not None and (force or step % cfg.persist_every == 0)
    if step % cfg.memory_every != 0 and not persist and not force:
        return False
    try:
        # no plan caching: DCP's cache is per process, so after a rank was replaced (checkpointless
        # recovery) the coordinator's "plan unchanged" sends a fresh process to a cache it lacks (KeyError)
        dcp.save(state_dict, storage_writer=TieredWriter(cfg, step, persist=persist),
                 planner=DefaultSavePlanner(enable_plan_caching=False))
    except CheckpointException as e:
        _reraise(e, f"save of step {step} to the node daemon at {cfg.daemon} failed")
    return True


def latest(cfg: TieredConfig, step: int | None = None, below: int | None = None) -> CheckpointRef:
    """The newest complete checkpoint of ``cfg.namespace`` in any tier (older than ``below`` if given),
    and which tier holds it (fastest first): the job-level rung of the recovery ladder starts here."""
    return find_latest(sources_for(cfg), step, below)


def _agreed_step(cfg: TieredConfig, step: int | None, below: int | None = None) -> tuple[int, str]:
    """Every rank must load the same save: rank 0 picks the newest one whose manifests verify and
    broadcasts (step, save id) as a tensor (numbers need no pickle); -1 tells the others rank 0 has
    none, so that every rank raises, not only rank 0."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        ref = find_readable(sources_for(cfg), step, below)
        return ref.step, ref.save_id
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    chosen, error = [-1] + [0] * 32, None
    if dist.get_rank() == 0:
        try:
            ref = find_readable(sources_for(cfg), step, below)
            chosen = [ref.step] + list(ref.save_id.encode().ljust(32, b"\0"))
        except Exception as e:  # none, or the tiers unreadable: the others must not wait for rank 0
            error = e
    box = torch.tensor(chosen, dtype=torch.int64, device=device)
    dist.broadcast(box, src=0)
    if error is not None:
        raise error
    got = box.tolist()
    if got[0] < 0:
        raise NoCheckpointError(f"no checkpoint of {cfg.namespace} to load: rank 0 found none or could not "
                                f"read the tiers (its own error says which)")
    return got[0], bytes(got[1:]).rstrip(b"\0").decode()


def load(state_dict: dict, cfg: TieredConfig, step: int | None = None, below: int | None = None) -> TieredReader:
    """Load the newest complete checkpoint (older than ``below`` if given; or ``step``) into
    ``state_dict`` in place, resharding to the current world size. Returns the reader: ``.step``, ``.ref.tier``, ``.tiers_used``,
    ``.fallbacks`` (tiers skipped item by item) and ``.skipped`` (steps skipped whole).

    With no ``step`` asked for, a step of which no tier holds a good copy of some item (corrupt,
    truncated, or refused because it would need unpickling) is skipped for the next older complete
    one, with a warning: every item of the older step is loaded, so nothing of the bad one remains.
    DCP raises a failed read on every rank, so all ranks skip together. With none left, the newest
    step's error is raised."""
    skipped: list[str] = []
    first: HpError | None = None
    while True:
        try:
            chosen, save_id = _agreed_step(cfg, step, below)
        except NoCheckpointError:
            if first is None:
                raise
            raise first from None
        reader = TieredReader(sources_for(cfg), chosen, save_id)
        try:
            dcp.load(state_dict, storage_reader=reader)
        except CheckpointException as e:
            bad = next((c for c, _ in e.failures.values() if isinstance(c, (CheckpointCorruptError, UnsafeItemError))),
                       None)
            if step is not None or bad is None:
                _reraise(e, f"load of step {chosen} failed")
            log.warning("step %d has no good copy (%s); trying an older step", chosen, bad)
            skipped.append(f"step {chosen}: {bad}")
            first, below = first or bad, chosen
            continue
        reader.skipped = skipped
        return reader


def _reraise(e: CheckpointException, what: str):
    """DCP wraps every rank's exception; surface hp's own (corrupt / missing) as themselves."""
    causes = [exc for exc, _ in e.failures.values()]
    for exc in causes:
        if isinstance(exc, HpError):
            raise exc from e
    raise HpError(f"{what}: " + "; ".join(f"{type(c).__name__}: {c}" for c in causes)) from e


__all__ = ["save", "load", "latest"]

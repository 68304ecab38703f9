"""hp-tiered-ckpt as the job-level rung of hp-checkpointless's recovery ladder.

``ctx.register(..., checkpoint=TieredRung(TieredConfig.from_env("my-job", memory_every=5)))``: the
runtime saves after the commits :meth:`due` names (one copy into the node daemon's staging memory)
and, when no peer holds a piece of state or the job starts again, loads the newest complete step
from the fastest tier holding it (node memory → peer memory → persistent) and says which.
Implements :class:`hp.checkpointless.ladder.JobCheckpoint` by shape; neither package imports the other.
"""

from __future__ import annotations

import torch

from hp.tiered_ckpt import api
from hp.tiered_ckpt.config import TieredConfig
from hp.tiered_ckpt.fmt import UnsafeItemError
from hp.tiered_ckpt.reader import CheckpointCorruptError, NoCheckpointError


class TieredRung:
    unusable = (CheckpointCorruptError, UnsafeItemError)  # no good copy of a step in any tier

    def __init__(self, cfg: TieredConfig) -> None:
        self.cfg = cfg

    def due(self, step: int) -> bool:
        return step % self.cfg.memory_every == 0 or (
            self.cfg.persist_url is not None and step % self.cfg.persist_every == 0)

    def save(self, state_dict: dict[str, torch.Tensor], step: int, urgent: bool = False) -> None:
        api.save(state_dict, step, self.cfg, force=urgent)

    def load(self, state_dict: dict[str, torch.Tensor], step: int | None = None,
             below: int | None = None) -> tuple[int, str] | None:
        """Load ``step``, or (None) the newest step (older than ``below``) some tier holds a good copy of
        — an older one when every copy of the newest is bad (``api.load`` agrees on the step across
        ranks and falls back); None when there is no checkpoint at all."""
        try:
            reader = api.load(state_dict, self.cfg, step, below=below)
        except NoCheckpointError:
            if step is not None:
                raise
            return None
        return reader.step, "+".join(sorted(reader.tiers_used)) or reader.ref.tier

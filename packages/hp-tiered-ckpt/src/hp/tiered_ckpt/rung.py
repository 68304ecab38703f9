"""hp-tiered-ckpt as the job-level rung of hp-checkpointless's recovery ladder.

``ctx.register(..., checkpoint=TieredRung(TieredConfig.from_env("my-job", memory_every=5)))``: the
runtime saves after the commits :meth:`due` names (one copy into the node daemon's staging memory)
and, when no peer holds a piece of state or the job starts again, loads the newest complete step
from the fastest tier holding it (node memory → peer memory → persistent) and says which.
Implements :class:`hp.checkpointless.ladder.JobCheckpoint` by shape; neither package imports the other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hp.tiered_ckpt import api
from hp.tiered_ckpt.config import TieredConfig
from hp.tiered_ckpt.reader import NoCheckpointError


class TieredRung:
    def __init__(self, cfg: TieredConfig) -> None:
        self.cfg = cfg

    def due(self, step: int) -> bool:
        return step % self.cfg.memory_every == 0 or (
            self.cfg.persist_url is not None and step % self.cfg.persist_every == 0)

    def save(self, state_dict: dict[str, torch.Tensor], step: int, urgent: bool = False) -> None:
        api.save(state_dict, step, self.cfg, force=urgent)

    def load(self, state_dict: dict[str, torch.Tensor], step: int | None = None) -> tuple[int, str] | None:
        if step is None:
            step = self._newest()
            if step < 0:
                return None
        reader = api.load(state_dict, self.cfg, step)
        return reader.step, "+".join(sorted(reader.tiers_used)) or reader.ref.tier

    def _newest(self) -> int:
        """Rank 0 looks, every rank learns the answer (-1: none), so that all load the same step or none."""
        newest = torch.tensor([-1], dtype=torch.int64)
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                newest[0] = api.latest(self.cfg).step
            except NoCheckpointError:
                pass
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(newest, 0)
        return int(newest[0])

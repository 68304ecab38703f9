"""The job-level rung of the recovery ladder: a checkpoint to fall back on when no peer holds the state.

In-process recovery needs every piece of state alive in some peer. When that fails (a sharded
optimizer's shard lost with its buddy), or when a job starts again after a total failure, the
runtime restores the newest complete checkpoint of a :class:`JobCheckpoint`, e.g. hp-tiered-ckpt's
tiers (node memory → peer memory → S3/FSx), and replays from there; it says which step and tier.

What is saved is what a hydration sends (:mod:`hp.checkpointless.state`): per part one JSON skeleton
and one flat buffer, as uint8 tensors under fixed keys, plus their sizes, so a fresh process can
allocate before it loads and nothing is pickled by hp. The replicated part is one key every rank
writes (DCP stores it once); RNG states and a sharded optimizer's shard are one key per rank.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Protocol

import torch

from hp.checkpointless import state

if TYPE_CHECKING:
    from hp.checkpointless.runtime import Context


class JobCheckpoint(Protocol):
    """What the runtime needs of a checkpoint store; every method is called by all ranks together."""

    def due(self, step: int) -> bool:
        """Whether committed step ``step`` is to be checkpointed."""

    def save(self, state_dict: dict[str, torch.Tensor], step: int) -> None:
        """Save ``state_dict`` (a torch.distributed.checkpoint state dict) as ``step``."""

    def load(self, state_dict: dict[str, torch.Tensor], step: int | None = None) -> tuple[int, str] | None:
        """Load the newest complete checkpoint (or ``step``) into ``state_dict`` in place; returns
        ``(step, tier it came from)``, or None when there is no checkpoint."""


def _parts(ctx: Context) -> dict[str, dict]:
    """The replicated state (identical on every rank, so one key) and this rank's own: its RNG
    states (a job may seed ranks differently) and its optimizer shard."""
    if ctx._sharded is None:
        replicated = ctx._capture()
        own = {"rng": replicated.pop("rng")}
    else:
        from hp.checkpointless.hydration import _replicated_state

        replicated = {**_replicated_state(ctx), "model": dict(ctx._model.state_dict())}
        own = {"rng": replicated.pop("rng"), "shard": ctx._sharded.shard()}
    return {"hp.state": replicated, f"hp.rank{ctx._rank}": own}


def save(ctx: Context, step: int) -> None:
    out: dict[str, torch.Tensor] = {}
    for key, part in _parts(ctx).items():
        skeleton, tensors = state.flatten(part)
        meta = torch.frombuffer(bytearray(json.dumps(skeleton, separators=(",", ":")).encode()), dtype=torch.uint8)
        flat = state.StateBuffer(skeleton).pack(tensors)
        out.update({f"{key}.sizes": torch.tensor([meta.numel(), flat.numel()]), f"{key}.json": meta,
                    f"{key}.data": flat})
    ctx._checkpoint.save(out, step)


def restore(ctx: Context) -> tuple[int, str] | None:
    """Load the newest checkpoint into every registered object; returns (step, tier) or None."""
    keys = list(_parts(ctx))
    sizes = {f"{k}.sizes": torch.zeros(2, dtype=torch.int64) for k in keys}
    found = ctx._checkpoint.load(sizes)
    if found is None:
        return None
    step, _ = found
    bufs: dict[str, torch.Tensor] = {}
    for k in keys:
        json_len, nbytes = sizes[f"{k}.sizes"].tolist()
        bufs[f"{k}.json"] = torch.zeros(json_len, dtype=torch.uint8)
        bufs[f"{k}.data"] = torch.zeros(nbytes, dtype=torch.uint8)
    step, tier = ctx._checkpoint.load(bufs, step)
    parts = {}
    for k in keys:
        skeleton = json.loads(bufs[f"{k}.json"].numpy().tobytes())
        buffer = state.StateBuffer(skeleton, bufs[f"{k}.data"])
        parts[k] = state.unflatten(skeleton, buffer.unpack())  # views: the loaded buffer is never reused
    own = parts[f"hp.rank{ctx._rank}"]
    replicated = {**parts["hp.state"], "rng": own["rng"]}
    if ctx._sharded is None:
        extra = state.restore(replicated, ctx._model, ctx._optimizer, ctx._scheduler)
        if ctx._extra is not None and extra:
            ctx._extra.load_state_dict(extra)
    else:
        from hp.checkpointless.hydration import _load_replicated_state

        ctx._model.load_state_dict(replicated["model"])
        _load_replicated_state(ctx, replicated)
        ctx._sharded.load_shard(own["shard"])
    return step, tier

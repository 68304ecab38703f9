"""The job-level rung of the recovery ladder: a checkpoint to fall back on when no peer holds the state.

In-process recovery needs every piece of state alive in some peer. When that fails (a sharded
optimizer's shard lost with its buddy), or when a job starts again after a total failure, the
runtime restores the newest complete checkpoint of a :class:`JobCheckpoint`, e.g. hp-tiered-ckpt's
tiers (node memory → peer memory → S3/FSx), and replays from there; it says which step and tier.

What is saved is what a hydration sends (:mod:`hp.checkpointless.state`): per part one JSON skeleton
and one flat buffer, as uint8 tensors under fixed keys, plus their sizes, so a fresh process can
allocate before it loads and nothing is pickled by hp. The replicated part is one key every rank
writes (DCP stores it once); RNG states, a sharded optimizer's shard and an FSDP2 rank's shard (parameters
and optimizer state as local tensors, as a hydration sends them) are one key per rank.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Protocol

import torch
from torch.distributed.checkpoint.api import CheckpointException

from hp.checkpointless import sharded, state
from hp.checkpointless.events import EventLog
from hp.core.protocol import Event

if TYPE_CHECKING:
    from hp.checkpointless.registry import TrainingState


class JobCheckpoint(Protocol):
    """What the runtime needs of a checkpoint store; every method is called by all ranks together."""

    def due(self, step: int) -> bool:
        """Whether committed step ``step`` is to be checkpointed."""

    def save(self, state_dict: dict[str, torch.Tensor], step: int, urgent: bool = False) -> None:
        """Save ``state_dict`` (a torch.distributed.checkpoint state dict) as ``step``. ``urgent``: the job
        is preempted: save whatever :meth:`due` says, into the most durable tier there is."""

    #: exceptions :meth:`load` raises, on every rank alike, when no tier holds a good copy of ``step``
    #: (corrupt, truncated, refused): the runtime then restores an older step instead
    unusable: tuple[type[BaseException], ...]

    def load(self, state_dict: dict[str, torch.Tensor], step: int | None = None,
             below: int | None = None) -> tuple[int, str] | None:
        """Load the newest complete checkpoint (older than ``below`` if given; or ``step`` itself) into
        ``state_dict`` in place; returns ``(step, tier it came from)``, or None when there is none."""


def _parts(st: TrainingState, rank: int) -> dict[str, dict]:
    """The replicated state (identical on every rank, so one key) and this rank's own: its RNG
    states (a job may seed ranks differently) and its optimizer shard; with an FSDP2 model, its shard
    of the parameters and of the optimizer state, and the mesh's shape that shard belongs to."""
    if st.fsdp is not None:
        replicated = st.replicated_part()
        own = {"rng": replicated.pop("rng"), "fsdp": st.fsdp.shard(st.optimizer),
               "mesh": list(st.fsdp.mesh.layout.sizes)}
    elif st.sharded is None:
        replicated = st.capture()
        own = {"rng": replicated.pop("rng")}
    else:
        replicated = {**st.replicated_part(), "model": dict(st.model.state_dict())}
        own = {"rng": replicated.pop("rng"), "shard": st.sharded.shard(), "world": st.sharded.world_size}
    own["samples"] = st.samples  # where the next step's samples start (StepSampler)
    own["state_world"] = st.world  # the world size the state is for: a restart at another one calls on_scale
    return {"hp.state": replicated, f"hp.rank{rank}": own}


def save(st: TrainingState, rank: int, step: int, urgent: bool = False) -> None:
    out: dict[str, torch.Tensor] = {}
    for key, part in _parts(st, rank).items():
        skeleton, tensors = state.flatten(part)
        meta = torch.frombuffer(bytearray(json.dumps(skeleton, separators=(",", ":")).encode()), dtype=torch.uint8)
        flat = state.StateBuffer(skeleton).pack(tensors)
        out.update({f"{key}.sizes": torch.tensor([meta.numel(), flat.numel()]), f"{key}.json": meta,
                    f"{key}.data": flat})
    st.checkpoint.save(out, step, urgent)


def save_or_warn(st: TrainingState, rank: int, step: int, events: EventLog) -> None:
    """After a commit, when due. A failed save costs that checkpoint, never the training: storage
    trouble is not a peer failure, and a peer that died in DCP's collectives is caught by the next
    step's (the watch thread has seen the new generation by then)."""
    try:
        save(st, rank, step)
        return
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        error = f"{type(e).__name__}: {str(e)[:300]}"
    events.record(Event.CHECKPOINT_FAILED, rank=rank, step=step, error=error)
    if rank == 0:
        print(f"hp: warning: checkpoint of step {step} failed, training goes on: {error}", file=sys.stderr, flush=True)


def _load(st: TrainingState, keys: list[str]) -> tuple[int, str, dict[str, torch.Tensor]] | None:
    """The newest step whose every part loads: sizes first (to allocate), then the parts; a step whose
    parts have no good copy anywhere is passed over for the next older one (all ranks alike)."""
    below = None
    while True:
        sizes = {f"{k}.sizes": torch.zeros(2, dtype=torch.int64) for k in keys}
        found = st.checkpoint.load(sizes, below=below)
        if found is None:
            return None
        step, _ = found
        bufs: dict[str, torch.Tensor] = {}
        for k in keys:
            json_len, nbytes = sizes[f"{k}.sizes"].tolist()
            bufs[f"{k}.json"] = torch.zeros(json_len, dtype=torch.uint8)
            bufs[f"{k}.data"] = torch.zeros(nbytes, dtype=torch.uint8)
        try:
            step, tier = st.checkpoint.load(bufs, step)
        except st.checkpoint.unusable as e:
            print(f"hp: warning: checkpoint of step {step} has no good copy ({e}); trying an older one",
                  file=sys.stderr, flush=True)
            below = step
            continue
        return step, tier, bufs


def restore(st: TrainingState, rank: int) -> tuple[int, str] | None:
    """Load the newest usable checkpoint into every registered object; returns (step, tier) or None."""
    keys = list(_parts(st, rank))
    found = _load(st, keys)
    if found is None:
        return None
    step, tier, bufs = found
    parts = {}
    for k in keys:
        skeleton = json.loads(bufs[f"{k}.json"].numpy().tobytes())
        buffer = state.StateBuffer(skeleton, bufs[f"{k}.data"])
        parts[k] = state.unflatten(skeleton, buffer.unpack())  # views: the loaded buffer is never reused
    own = parts[f"hp.rank{rank}"]
    if not all(isinstance(own.get(k), int) and own[k] >= 0 for k in ("samples", "state_world")):
        raise state.StateTransferError(f"the checkpoint of step {step} lacks the job's sample position or world size")
    replicated = {**parts["hp.state"], "rng": own["rng"]}
    if st.fsdp is not None:
        layout = list(st.fsdp.mesh.layout.sizes)
        if own.get("mesh") != layout:  # rank r's shard is another slice of another mesh
            raise sharded.ShardLost(f"the checkpoint of step {step} holds FSDP shards of a {own.get('mesh')} mesh, "
                                    f"the job's is {layout}: restart it at that shape")
        st.fsdp.load_shard(st.optimizer, own["fsdp"], step)
        st.load_replicated_part(replicated)
    elif st.sharded is None:
        st.restore(replicated)
    else:
        if own.get("world") != st.sharded.world_size:  # rank r's shard is another partition at another size
            raise sharded.ShardLost(f"the checkpoint of step {step} holds optimizer shards for {own.get('world')} ranks, "
                            f"the job has {st.sharded.world_size}: restart it at that size")
        st.model.load_state_dict(replicated["model"])
        st.load_replicated_part(replicated)
        st.sharded.load_shard(own["shard"])
    st.samples, st.world = own["samples"], own["state_world"]
    return step, tier

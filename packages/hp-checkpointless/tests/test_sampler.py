"""StepSampler / StepLoader: the samples of a step are a pure function of (seed, step, micro-batch)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from hp.checkpointless.sampler import StepLoader, StepSampler
from hp.core.errors import UsageError


class Squares(Dataset):
    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i * i])


def test_every_sample_once_per_epoch_and_the_same_global_batch_at_any_world_size():
    sampler = StepSampler(48, micro_batch=3, micro_batches=4, seed=7)
    epoch = [i for s in range(4) for m in range(4) for i in sampler.indices(s, m)]
    assert sorted(epoch) == list(range(48))
    for world in range(1, 9):  # uneven (3, 5..8) and ranks with no micro-batch (5..8) included
        per_step = sorted(i for r in range(world) for m in sampler.owned(2, r, world) for i in sampler.indices(2, m))
        assert per_step == sorted(i for m in range(4) for i in sampler.indices(2, m))
    assert StepSampler(48, 3, 4, seed=7).indices(9, 1) == sampler.indices(9, 1)  # no history
    assert StepSampler(48, 3, 4, seed=8).indices(9, 1) != sampler.indices(9, 1)


@pytest.mark.parametrize("call, message", [
    (lambda: StepSampler(0, 2, 2), "dataset_len, micro_batch and micro_batches >= 1"),
    (lambda: StepSampler(10, 2, 2).owned(0, 2, 2), "rank 2 is not in a world of 2"),
    (lambda: StepSampler(10, 2, 2).indices(0, 2), "no micro-batch 2 of step 0"),
    (lambda: StepLoader(Squares(), StepSampler(50, 2, 2), batch_size=4), "StepLoader chooses batch_size itself"),
])
def test_bad_input_is_a_one_line_error(call, message):
    with pytest.raises(UsageError, match=message) as e:
        call()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_follows_steps_restarts_for_a_replay_and_never_draws_the_global_rng(workers):
    sampler = StepSampler(50, micro_batch=2, micro_batches=4, seed=1)
    loader = StepLoader(Squares(), sampler, num_workers=workers)
    expect = lambda s: [[[i, i * i] for i in sampler.indices(s, m)] for m in sampler.owned(s, 1, 2)]  # noqa: E731
    torch.manual_seed(0)
    before = torch.get_rng_state()
    got = {s: [b.tolist() for b in loader.step(s, 1, 2)] for s in range(3)}
    micro = loader.step(3, 1, 2)
    next(iter(micro))  # a failure in the middle of step 3: it is replayed from its start
    replay = [b.tolist() for b in loader.step(3, 1, 2)]
    assert got == {s: expect(s) for s in range(3)} and replay == expect(3)
    assert len(micro) == 2
    assert torch.equal(torch.get_rng_state(), before)
    loader.close()


class PerReplica:
    """A per-replica batch: k micro-batches of b samples per rank, so the global batch follows W."""

    global_batch = None

    def __init__(self, micro_batch: int, per_rank: int) -> None:
        self.micro_batch, self.per_rank = micro_batch, per_rank

    def micro_batch_for(self, world: int) -> int:
        return self.micro_batch

    def micro_batches_for(self, world: int) -> int:
        return self.per_rank * world


@pytest.mark.parametrize("workers", [0, 2])
def test_a_per_replica_batch_reads_on_from_the_committed_position_through_4_3_4(workers):
    """What the runtime does with ``ctx.samples``: each committed step reads the next M(W)·b positions;
    a failed attempt (at 4 ranks) is replayed at 3 from the same start. Over the whole history the
    committed steps' samples are the sample stream in order: none skipped, none repeated."""
    sampler = StepSampler(50, seed=3, geometry=PerReplica(micro_batch=2, per_rank=2))
    loaders = [StepLoader(Squares(), sampler, num_workers=workers) for _ in range(4)]  # one per rank slot
    history = [(0, 4), (1, 4), (2, 3), (3, 3), (4, 4), (5, 4)]  # (step, world) of the committed attempts
    start, seen = 0, []
    for step, world in history:
        if step == 2:  # step 2 first ran at 4 ranks and failed midway: its samples are not consumed
            next(iter(loaders[0].step(2, 0, 4, start)))
        per_rank = [[b[:, 0].tolist() for b in loaders[r].step(step, r, world, start)] for r in range(world)]
        assert [len(p) for p in per_rank] == [2] * world  # k micro-batches per rank at any W
        seen += [i for p in per_rank for micro in p for i in micro]  # rank order = micro-batch order
        start += sampler.samples_at(world)
    assert start == 2 * 2 * (4 + 4 + 3 + 3 + 4 + 4) == len(seen)
    order = StepSampler(50, 1, 1, seed=3)  # the stream itself: position g is order.indices(g, 0)
    assert seen == [order.indices(g, 0)[0] for g in range(start)]
    assert sorted(seen[:50]) == list(range(50))  # one epoch: every sample exactly once
    for loader in loaders:
        loader.close()


@pytest.mark.parametrize("call, message", [
    (lambda: StepSampler(10), "micro_batch and micro_batches, or a geometry"),
    (lambda: StepSampler(10, 2, 2, geometry=PerReplica(2, 1)), "micro_batch and micro_batches, or a geometry"),
    (lambda: StepSampler(0, geometry=PerReplica(2, 1)), "dataset_len >= 1"),
    (lambda: StepSampler(10, geometry=PerReplica(2, 1)).indices(3, 0), "pass start="),
    (lambda: StepLoader(Squares(), StepSampler(50, geometry=PerReplica(2, 1))).step(1, 0, 2), "pass start="),
])
def test_a_per_replica_sampler_needs_a_start_and_one_geometry(call, message):
    with pytest.raises(UsageError, match=message) as e:
        call()
    assert "\n" not in str(e.value)

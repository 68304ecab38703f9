"""Per-micro-batch indices for a user's own map-style ``Dataset``, so replays and replacements see the
same samples; and a ``DataLoader`` (workers, prefetch, the user's collate) that follows them.

A step is ``micro_batches`` micro-batches of ``micro_batch`` samples (the global batch is their
product, whatever the world size). Micro-batch m of step s holds the samples at global positions
``s * global_batch + m * micro_batch + j`` of an :class:`hp.checkpointless.data.EpochOrder`: a pure
function of (seed, s, m), never of the world size, so every step sees the same samples at any W: none
skipped, none repeated. The world size only decides who computes which micro-batch (:func:`owned`).

    sampler = StepSampler(len(dataset), micro_batch=8, micro_batches=4, seed=0)
    loader = StepLoader(dataset, sampler, num_workers=2, collate_fn=...)
    for step in ctx.steps(n):
        with step:
            losses = []
            for x, y in step.micro_batches(loader):  # this rank's, at the current world size
                loss = loss_fn(model(x), y)
                loss.backward()  # summed over the step's micro-batches; hp divides by their count
                losses.append(loss)
            ctx.commit(losses)

Ownership is by **contiguous blocks**: rank r of W owns ``[r*q + min(r, e), ...)`` with ``q, e =
divmod(M, W)``: the first ``e`` ranks own ``q + 1`` micro-batches, the others ``q`` (uneven counts when W
does not divide M; a rank owns none when W > M). A rank's micro-batches are one contiguous span of the
step's samples (sequential reads from the data cache), and the ranks' blocks in rank order are the
micro-batches in order ``0..M-1``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from hp.checkpointless.data import EpochOrder
from hp.checkpointless.microbatch import owned
from hp.core.errors import UsageError

_LOADER_OWNED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "generator")


class StepSampler:
    def __init__(self, dataset_len: int, micro_batch: int, micro_batches: int, seed: int = 0,
                 shuffle: bool = True) -> None:
        if dataset_len < 1 or micro_batch < 1 or micro_batches < 1:
            raise UsageError(f"StepSampler needs dataset_len, micro_batch and micro_batches >= 1, got "
                             f"{dataset_len}, {micro_batch}, {micro_batches}")
        self.micro_batch, self.micro_batches, self.seed = micro_batch, micro_batches, seed
        self._order = EpochOrder(dataset_len, seed, shuffle)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.micro_batches

    def indices(self, step: int, m: int) -> list[int]:
        """Dataset indices of micro-batch ``m`` of ``step``."""
        if step < 0 or not 0 <= m < self.micro_batches:
            raise UsageError(f"no micro-batch {m} of step {step} (0 <= m < {self.micro_batches})")
        return self._order.indices(step * self.global_batch + m * self.micro_batch, self.micro_batch)

    def owned(self, step: int, rank: int, world: int) -> list[int]:
        """The micro-batch ids of ``step`` that ``rank`` of ``world`` computes (:func:`owned`)."""
        return owned(self.micro_batches, rank, world)

    def batches(self, rank: int, world: int, start: int) -> Iterator[list[int]]:
        """Index lists of every micro-batch ``rank`` owns, step after step from ``start`` (a batch sampler)."""
        step = start
        while True:
            for m in self.owned(step, rank, world):
                yield self.indices(step, m)
            step += 1


class _RankBatches(torch.utils.data.Sampler[list[int]]):
    def __init__(self, sampler: StepSampler, rank: int, world: int, start: int) -> None:
        self._args = (sampler, rank, world, start)

    def __iter__(self) -> Iterator[list[int]]:
        sampler, rank, world, start = self._args
        return sampler.batches(rank, world, start)


class StepLoader:
    """A ``torch.utils.data.DataLoader`` over a :class:`StepSampler`, positioned at the step asked for.

    In steady state one loader iterator runs ahead (workers prefetch the next micro-batches). When
    the step asked for is not the next one (a replay after a failure, a new rank or world size), the
    iterator is replaced by one that starts there. Its generator is the loader's own, seeded from the
    sampler's seed and the start step: creating an iterator never draws from the global torch RNG,
    whose state hp restores for a replay (random augmentations in workers are seeded per iterator:
    derive them from the sample index for bit-identical replays)."""

    def __init__(self, dataset: Dataset, sampler: StepSampler, **loader_kwargs: Any) -> None:
        owned = sorted(set(loader_kwargs) & set(_LOADER_OWNED))
        if owned:
            raise UsageError(f"StepLoader chooses {', '.join(owned)} itself (from its StepSampler): do not pass them")
        self.dataset, self.sampler, self._kwargs = dataset, sampler, loader_kwargs
        self._iterator: Iterator | None = None
        self._next: tuple[int, int, int] | None = None  # the (step, rank, world) whose start the iterator is at
        self._current: tuple[int, int, int] | None = None  # the step being consumed (None: at a step start)

    def step(self, step: int, rank: int, world: int) -> MicroBatches:
        """This rank's micro-batches of ``step`` (``len()`` of them), in order."""
        count = len(self.sampler.owned(step, rank, world))
        if self._next != (step, rank, world):  # a replay, or a step left unfinished
            self._restart(step, rank, world)
        self._next, self._current = None, (step, rank, world)
        return MicroBatches(self, (step, rank, world), count)

    def _restart(self, step: int, rank: int, world: int) -> None:
        self.close()
        generator = torch.Generator().manual_seed(self.sampler.seed * 1_000_003 + step)
        loader = DataLoader(self.dataset, batch_sampler=_RankBatches(self.sampler, rank, world, step),
                            generator=generator, **self._kwargs)
        self._iterator, self._next = iter(loader), (step, rank, world)

    def take(self, at: tuple[int, int, int], last: bool) -> Any:
        """The next micro-batch, which must be one of ``at`` = (step, rank, world) (see :class:`MicroBatches`)."""
        if self._current != at:
            raise UsageError("a StepLoader's micro-batches are consumed in order, one step after the other")
        batch = next(self._iterator)
        if last:
            step, rank, world = at
            self._next, self._current = (step + 1, rank, world), None
        return batch

    def close(self) -> None:
        """Drop the iterator: torch's iterator stops its workers when it is freed."""
        self._iterator = self._next = self._current = None


class MicroBatches:
    """One step's micro-batches for one rank: iterate once; ``len()`` says how many."""

    def __init__(self, loader: StepLoader, at: tuple[int, int, int], count: int) -> None:
        self._loader, self._at, self._count = loader, at, count

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Any]:
        for k in range(self._count):
            yield self._loader.take(self._at, last=k == self._count - 1)

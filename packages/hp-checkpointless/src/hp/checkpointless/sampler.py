"""Per-micro-batch indices for a user's own map-style ``Dataset``, so replays and replacements see the
same samples; and a ``DataLoader`` (workers, prefetch, the user's collate) that follows them.

A step at world size W is ``M(W)`` micro-batches of ``b(W)`` samples, as its :class:`BatchGeometry`
says: a constant global batch (``StepSampler(n, micro_batch=b, micro_batches=M)``: the same M·b samples
at any W), or a scaling policy's (``StepSampler(n, geometry=policy)``: micro-batch overrides per world
size; with a per-replica batch, ``M(W) = W · k``, so the global batch follows W). The samples of a
step are the next ``M(W) · b(W)`` positions of an :class:`hp.checkpointless.data.EpochOrder` from the
step's **start position**; micro-batch m holds positions ``start + m·b(W) + j``. The start position is
the number of samples the job consumed before the step: committed state that the runtime keeps
(``ctx.samples``), hydrates to joiners and saves in checkpoints. With a constant global batch it is
``step · G``, whatever the world sizes; with a per-replica batch it depends on the world size of every
step before, which is why it is state and not a formula. Either way every committed step reads the
samples after the last committed one: none skipped, none repeated, and a replay (at any W) reads the
samples of the attempt it replaces. The world size decides who computes which micro-batch (:func:`owned`).

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
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset

from hp.checkpointless.data import EpochOrder
from hp.checkpointless.microbatch import owned
from hp.core.errors import UsageError

_LOADER_OWNED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "generator")


class BatchGeometry(Protocol):
    """A step's shape at each world size (``hp.elastic.ScalingPolicy`` is one). ``global_batch``: the
    samples per step when they are the same at every world size, else None."""

    global_batch: int | None

    def micro_batch_for(self, world: int) -> int:
        """b(W): samples per micro-batch."""

    def micro_batches_for(self, world: int) -> int:
        """M(W): micro-batches per step, all ranks together."""


class ConstantBatch:
    """M micro-batches of b samples at every world size."""

    def __init__(self, micro_batch: int, micro_batches: int) -> None:
        self.micro_batch, self.micro_batches = micro_batch, micro_batches
        self.global_batch = micro_batch * micro_batches

    def micro_batch_for(self, world: int) -> int:
        return self.micro_batch

    def micro_batches_for(self, world: int) -> int:
        return self.micro_batches


class StepSampler:
    def __init__(self, dataset_len: int, micro_batch: int | None = None, micro_batches: int | None = None,
                 seed: int = 0, shuffle: bool = True, *, geometry: BatchGeometry | None = None) -> None:
        if (geometry is None) == (micro_batch is None and micro_batches is None):
            raise UsageError("StepSampler takes micro_batch and micro_batches, or a geometry (a ScalingPolicy)")
        if geometry is None:
            if dataset_len < 1 or micro_batch is None or micro_batches is None or micro_batch < 1 or micro_batches < 1:
                raise UsageError(f"StepSampler needs dataset_len, micro_batch and micro_batches >= 1, got "
                                 f"{dataset_len}, {micro_batch}, {micro_batches}")
            geometry = ConstantBatch(micro_batch, micro_batches)
        elif dataset_len < 1:
            raise UsageError(f"StepSampler needs dataset_len >= 1, got {dataset_len}")
        self.geometry, self.seed = geometry, seed
        self._order = EpochOrder(dataset_len, seed, shuffle)

    @property
    def global_batch(self) -> int | None:
        """Samples per step when that is the same at every world size (else None: see :meth:`samples_at`)."""
        return self.geometry.global_batch

    def micro_batches_at(self, world: int) -> int:
        """M(W): the step's micro-batches (all ranks together) at ``world``."""
        return self.geometry.micro_batches_for(world)

    def samples_at(self, world: int) -> int:
        """Samples a step consumes at ``world``."""
        return self.geometry.micro_batches_for(world) * self.geometry.micro_batch_for(world)

    def start_of(self, step: int) -> int:
        """The start position of ``step`` with a constant global batch (``step · G``); with a per-replica
        batch it depends on the world-size history: the runtime's ``ctx.samples`` is the one to use."""
        if self.global_batch is None:
            raise UsageError("with a per-replica batch a step's start depends on the world sizes before it: "
                             "pass start= (the runtime's ctx.samples)")
        return step * self.global_batch

    def indices(self, step: int, m: int, world: int = 1, start: int | None = None) -> list[int]:
        """Dataset indices of micro-batch ``m`` of ``step`` at ``world``; ``start``: the step's start
        position (default :meth:`start_of`)."""
        count = self.micro_batches_at(world)
        if step < 0 or not 0 <= m < count:
            raise UsageError(f"no micro-batch {m} of step {step} (0 <= m < {count})")
        b = self.geometry.micro_batch_for(world)
        first = self.start_of(step) if start is None else start
        return self._order.indices(first + m * b, b)

    def owned(self, step: int, rank: int, world: int) -> list[int]:
        """The micro-batch ids of ``step`` that ``rank`` of ``world`` computes (:func:`owned`)."""
        return owned(self.micro_batches_at(world), rank, world)

    def batches(self, rank: int, world: int, step: int, start: int) -> Iterator[list[int]]:
        """Index lists of every micro-batch ``rank`` owns, step after step from ``step`` at position
        ``start``, the world size staying ``world`` (a batch sampler)."""
        per_step = self.samples_at(world)
        while True:
            for m in self.owned(step, rank, world):
                yield self.indices(step, m, world, start)
            step, start = step + 1, start + per_step


class _RankBatches(torch.utils.data.Sampler[list[int]]):
    def __init__(self, sampler: StepSampler, rank: int, world: int, step: int, start: int) -> None:
        self._args = (sampler, rank, world, step, start)

    def __iter__(self) -> Iterator[list[int]]:
        sampler, rank, world, step, start = self._args
        return sampler.batches(rank, world, step, start)


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
        self._next: tuple[int, int, int, int] | None = None  # the (step, rank, world, start) the iterator is at
        self._current: tuple[int, int, int, int] | None = None  # the step being consumed (None: at a step start)

    def step(self, step: int, rank: int, world: int, start: int | None = None) -> MicroBatches:
        """This rank's micro-batches of ``step`` (``len()`` of them), in order; ``start``: the step's
        start position (the runtime passes ``ctx.samples``; default ``step · G``, constant batch only)."""
        at = (step, rank, world, self.sampler.start_of(step) if start is None else start)
        count = len(self.sampler.owned(step, rank, world))
        if self._next != at:  # a replay, a step left unfinished, a new rank or world size
            self._restart(*at)
        self._next, self._current = None, at
        return MicroBatches(self, at, count)

    def _restart(self, step: int, rank: int, world: int, start: int) -> None:
        self.close()
        generator = torch.Generator().manual_seed(self.sampler.seed * 1_000_003 + step)
        loader = DataLoader(self.dataset, batch_sampler=_RankBatches(self.sampler, rank, world, step, start),
                            generator=generator, **self._kwargs)
        self._iterator, self._next = iter(loader), (step, rank, world, start)

    def take(self, at: tuple[int, int, int, int], last: bool) -> Any:
        """The next micro-batch, which must be one of ``at`` = (step, rank, world, start) (see :class:`MicroBatches`)."""
        if self._current != at:
            raise UsageError("a StepLoader's micro-batches are consumed in order, one step after the other")
        batch = next(self._iterator)
        if last:
            step, rank, world, start = at
            self._next, self._current = (step + 1, rank, world, start + self.sampler.samples_at(world)), None
        return batch

    def close(self) -> None:
        """Drop the iterator: torch's iterator stops its workers when it is freed."""
        self._iterator = self._next = self._current = None


class MicroBatches:
    """One step's micro-batches for one rank: iterate once; ``len()`` says how many."""

    def __init__(self, loader: StepLoader, at: tuple[int, int, int, int], count: int) -> None:
        self._loader, self._at, self._count = loader, at, count

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Any]:
        for k in range(self._count):
            yield self._loader.take(self._at, last=k == self._count - 1)

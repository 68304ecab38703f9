"""Gradient all-reduce that overlaps the backward pass, bucket by bucket (as DDP's buckets do).

:class:`OverlappedMeanReduction` is a :class:`hp.checkpointless.reduction.Reduction`: pass it to
``ctx.register(..., reduction=OverlappedMeanReduction())``. The flat gradient buffer of the step
transaction is cut into buckets of about ``bucket_mb`` (whole parameters, from the last one back: the
order in which backward produces them). Each parameter's post-accumulate-grad hook tells the transaction
that its gradient is final (:meth:`StepTransaction.gradient_ready`); once every parameter of a bucket is
(and every bucket before it has started: they start in order on every rank), that bucket's all-reduce
starts, asynchronously, while backward goes on. :meth:`reduce` (called when the
step reduces, before the vote) waits for them, all-reduces the buckets that did not start (a gradient
that was not a view of the buffer, e.g. on the first step, or an unused parameter), in bucket order, and
divides by the number of contributions. The vote comes after the last bucket: commit semantics are
unchanged, and a failure of any bucket's all-reduce surfaces in the reduction, before the vote.

Every bucket is all-reduced on its own whether it started early or not, so a step's averaged gradient
does not depend on which buckets overlapped (a replay after a failure gets the same bits as the
fault-free step). At 2 ranks it is also the same bits as :class:`MeanReduction`'s one all-reduce (a sum
of two is exact whatever the order); at more ranks the buckets' chunking may associate the sum
differently: deterministic, but not the flat reduction's bits.

Requirements (as DDP without ``find_unused_parameters``): every rank's backward produces the same
parameters' gradients, in the same order; one backward per step (accumulate with
``step.micro_batches``, whose steps are reduced at the end, not overlapped): a gradient accumulated
again after its bucket started is a :class:`UsageError`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hp.checkpointless.reduction import Collective
from hp.core.errors import UsageError


class OverlappedMeanReduction:
    """The mean of the ranks' gradients, its all-reduce started during backward (module docstring)."""

    def __init__(self, bucket_mb: float = 25.0) -> None:
        if bucket_mb <= 0:
            raise UsageError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self.buckets: list[tuple[int, int]] = []  # (start, end) in the flat buffer, in launch order
        self._bucket_of: list[int] = []  # parameter index -> its bucket
        self._size: list[int] = []  # parameters per bucket
        self._ready: list[set[int]] = []  # per bucket: its parameters final this step
        self._works: list[Any] = []  # per bucket: its async all-reduce this step, or None
        self._next = 0
        self.overlapped = 0  # buckets whose all-reduce started during the last step's backward

    def plan(self, ranges: list[tuple[int, int]], itemsize: int) -> None:
        """``ranges``: each parameter's (offset, numel) in the flat buffer, in parameter order. Once."""
        if self.buckets:
            return
        self._bucket_of = [0] * len(ranges)
        start = end = None
        size = 0
        for index in reversed(range(len(ranges))):
            offset, numel = ranges[index]
            if end is None:
                end, start, size = offset + numel, offset, 0
            start, size = offset, size + 1
            self._bucket_of[index] = len(self.buckets)
            if (end - start) * itemsize >= self.bucket_bytes or index == 0:
                self.buckets.append((start, end))
                self._size.append(size)
                end = None
        self._reset()

    def _reset(self) -> None:
        self._ready = [set() for _ in self.buckets]
        self._works = [None] * len(self.buckets)
        self._next = 0  # the next bucket to start: they start in order

    def begin(self) -> None:
        """A step (or a replay) starts: no all-reduce of a failed attempt may still write into the buffer."""
        for work in self._works:
            if work is not None:
                try:
                    work.wait()
                except RuntimeError:
                    pass  # its group failed (and was released): the attempt is over
        self._reset()
        self.overlapped = 0

    def micro_batch_done(self, grads: torch.Tensor, m: int) -> None:
        pass  # a split step is reduced at its end (reduce)

    def gradient_ready(self, grads: torch.Tensor, index: int, collective: Collective) -> None:
        """Parameter ``index``'s gradient in ``grads`` is final for this step: start its bucket once full."""
        b = self._bucket_of[index]
        if b < self._next:
            raise UsageError("a gradient was accumulated again after its bucket's all-reduce started: with "
                             "OverlappedMeanReduction a step has one backward (use step.micro_batches to accumulate)")
        self._ready[b].add(index)
        # in bucket order only, as DDP: every rank must issue the same collectives in the same order, and
        # backward may finish a bucket before the one above it (a rank that starts none, a replacement
        # on its first step, issues them all in reduce(), in this order)
        while self._next < len(self.buckets) and len(self._ready[self._next]) == self._size[self._next]:
            start, end = self.buckets[self._next]
            self._works[self._next] = collective(dist.all_reduce, grads[start:end], async_op=True)
            self._next += 1
            self.overlapped += 1

    def reduce(self, grads: torch.Tensor, total: int, collective: Collective) -> None:
        for b, (start, end) in enumerate(self.buckets):
            work, self._works[b] = self._works[b], None
            if work is None:
                collective(dist.all_reduce, grads[start:end])
            else:
                collective(work.wait)
        self._ready, self._next = [set() for _ in self.buckets], 0
        grads.div_(total)

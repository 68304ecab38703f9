"""How a step's gradients become one global gradient: the plug of the step transaction.

The transaction (:mod:`hp.checkpointless.transaction`) keeps every parameter's ``.grad`` as a view into
one flat buffer. A :class:`Reduction` turns that buffer, on every rank, into the mean gradient of the
step. :class:`MeanReduction` (the default) is one float all-reduce divided by the number of
contributions: the world size for a plain step, the step's micro-batch count ``M`` for a step split in
micro-batches (:meth:`hp.checkpointless.runtime.Step.micro_batches`), whose gradients backward has
already summed on each rank. ``hp.elastic.ExactReduction`` makes the result independent of the world
size (exact mode). :class:`hp.checkpointless.overlap.OverlappedMeanReduction` starts the all-reduce during
backward; a reduction that can do that also has ``plan(ranges, itemsize)`` (the parameters' places in the
flat buffer, once) and ``gradient_ready(grads, index, collective)`` (parameter ``index``'s gradient is final
for this step, in a step not split in micro-batches).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

# collective(fn, *args, **kwargs): run one torch.distributed call on the current generation's group and
# return its result (an async call's work); a transport failure comes out as
# hp.checkpointless.recovery.CollectiveError
Collective = Callable[..., Any]


@runtime_checkable
class Reduction(Protocol):
    def begin(self) -> None:
        """A step, or the replay of a failed one, starts: forget anything kept from an earlier attempt."""

    def micro_batch_done(self, grads: torch.Tensor, m: int) -> None:
        """Micro-batch ``m`` of the step (its global index) finished its backward on this rank.

        ``grads``: the flat gradient buffer, holding the sum of this rank's micro-batch gradients so far.
        An implementation may copy it and zero it (then the next micro-batch accumulates from zero)."""

    def reduce(self, grads: torch.Tensor, total: int, collective: Collective) -> None:
        """Turn ``grads`` into the global mean, in place, on every rank.

        ``total``: the number of contributions the mean is over (the step's micro-batch count, or the
        world size for a step not split in micro-batches). Every rank calls this with the same ``total``;
        all communication goes through ``collective``."""


class MeanReduction:
    """One float all-reduce of the per-rank sums, divided by ``total`` (what DDP computes)."""

    def begin(self) -> None:
        pass

    def micro_batch_done(self, grads: torch.Tensor, m: int) -> None:
        pass  # backward keeps summing into the buffer

    def reduce(self, grads: torch.Tensor, total: int, collective: Collective) -> None:
        collective(dist.all_reduce, grads)
        grads.div_(total)

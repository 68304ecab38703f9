"""Constant global batch: which micro-batches of a step a rank owns, and what a micro-batch is.

A step is ``M = global_batch // micro_batch`` micro-batches of ``micro_batch`` samples. Micro-batch
``m`` of step ``s`` is a pure function of ``(seed, s, m)`` (:func:`micro_batch_seed`,
:func:`micro_batch_samples`), never of the world size, so every step sees the same samples at any W:
none skipped, none repeated. The world size only decides who computes which micro-batch.

The functions live in :mod:`hp.checkpointless.microbatch` (the runtime's step loop uses them); they are
re-exported here with the batch geometry of a policy. Ownership is by **contiguous blocks**: rank r of W owns ``[r*q + min(r, e), ...)`` with ``q, e =
divmod(M, W)``: the first ``e`` ranks own ``q + 1`` micro-batches, the others ``q`` (uneven counts
when W does not divide M, as balanced as round-robin: counts differ by at most one). Why blocks and
not round-robin: a rank's micro-batches are then one contiguous span of the step's samples (one read
from the data cache per step, sequential I/O), and concatenating the ranks' blocks in rank order gives
the micro-batches in order ``0..M-1``, so a per-rank partial sum in local order followed by a
rank-ordered combine visits micro-batches in the global order (what a fixed-order reduction needs).
Neither choice matters to exact mode (:mod:`hp.elastic.exact`), whose integer sum is
order-independent.
"""

from __future__ import annotations

from hp.checkpointless.microbatch import micro_batch_seed, owned, owner

__all__ = ["micro_batch_samples", "micro_batch_seed", "owned", "owner"]


def micro_batch_samples(step: int, m: int, micro_batch: int, global_batch: int) -> range:
    """Positions in the (seeded, per-epoch shuffled) sample stream that micro-batch ``m`` of ``step`` reads."""
    if global_batch % micro_batch:
        raise ValueError(f"global batch {global_batch} is not a multiple of the micro-batch {micro_batch}")
    if not 0 <= m < global_batch // micro_batch or step < 0:
        raise ValueError(f"no micro-batch {m} at step {step} with M={global_batch // micro_batch}")
    start = step * global_batch + m * micro_batch
    return range(start, start + micro_batch)

"""Which micro-batches of a step a rank owns, and the RNG seed of a micro-batch.

A step at world size W is ``M = policy.micro_batches_for(W)`` micro-batches. Micro-batch ``m`` of step
``s`` draws its randomness from ``(seed, s, m)`` (:func:`micro_batch_seed`) and its samples from the
step's start position (:class:`hp.checkpointless.sampler.StepSampler`, the one place that maps
positions to samples), never from W, so with a constant global batch every step sees the same samples
at any W: none skipped, none repeated. The world size only decides who computes which micro-batch.

The functions live in :mod:`hp.checkpointless.microbatch` (the runtime's step loop uses them) and are
re-exported here. Ownership is by **contiguous blocks**: rank r of W owns ``[r*q + min(r, e), ...)`` with
``q, e = divmod(M, W)``: the first ``e`` ranks own ``q + 1`` micro-batches, the others ``q`` (uneven counts
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

__all__ = ["micro_batch_seed", "owned", "owner"]


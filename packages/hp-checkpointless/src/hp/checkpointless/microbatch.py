"""Which micro-batches of a step a rank computes, and the RNG seed of each: pure, stdlib only.

A step is ``M`` micro-batches; rank r of W owns a contiguous block of them (:func:`owned`; uneven counts
when W does not divide M, none when W > M), so the ranks' blocks in rank order are the micro-batches in
order. Used by :mod:`hp.checkpointless.sampler` and re-exported by ``hp.elastic`` (whose policy code must
not import torch).
"""

from __future__ import annotations

import hashlib

from hp.core.errors import UsageError


def owned(micro_batches: int, rank: int, world: int) -> list[int]:
    """The micro-batches of a step that ``rank`` of ``world`` computes (a contiguous block, maybe empty)."""
    if micro_batches < 1 or world < 1:
        raise UsageError(f"micro-batches and world size must be >= 1, got M={micro_batches} W={world}")
    if not 0 <= rank < world:
        raise UsageError(f"rank {rank} is not in a world of {world}")
    q, e = divmod(micro_batches, world)
    start = rank * q + min(rank, e)
    return list(range(start, start + q + (1 if rank < e else 0)))


def owner(m: int, micro_batches: int, world: int) -> int:
    """The rank of ``world`` that owns micro-batch ``m`` (the inverse of :func:`owned`)."""
    if not 0 <= m < micro_batches or world < 1:
        raise UsageError(f"no micro-batch {m} of {micro_batches} in a world of {world}")
    q, e = divmod(micro_batches, world)
    big = e * (q + 1)  # micro-batches held by the first e ranks, q + 1 each
    return m // (q + 1) if m < big else e + (m - big) // q


def micro_batch_seed(seed: int, step: int, m: int) -> int:
    """A 63-bit RNG seed for micro-batch ``m`` of ``step`` (dropout, augmentation): W plays no part.
    ``Step.micro_batches`` seeds torch's global RNG with it before each micro-batch."""
    digest = hashlib.blake2b(f"hp/{seed}/{step}/{m}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1

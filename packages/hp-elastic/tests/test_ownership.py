"""Micro-batch ownership: every micro-batch of a step is owned exactly once at every world size."""

from __future__ import annotations

import pytest

from hp.core.errors import UsageError

from hp.elastic.ownership import micro_batch_seed, owned, owner


@pytest.mark.parametrize("m_total", [1, 2, 3, 5, 7, 8, 12, 13, 24, 100])
@pytest.mark.parametrize("world", range(1, 9))
def test_every_micro_batch_owned_exactly_once(m_total, world):
    blocks = [owned(m_total, r, world) for r in range(world)]
    flat = [m for b in blocks for m in b]
    assert flat == list(range(m_total))  # exactly once, and rank order is micro-batch order
    counts = [len(b) for b in blocks]
    assert max(counts) - min(counts) <= 1 and sum(counts) == m_total
    assert all(b == list(range(b[0], b[0] + len(b))) for b in blocks if b)  # contiguous
    assert [owner(m, m_total, world) for m in range(m_total)] == [r for r, b in enumerate(blocks) for _ in b]


def test_uneven_and_empty():
    assert [owned(12, r, 5) for r in range(5)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9], [10, 11]]
    assert [owned(3, r, 5) for r in range(5)] == [[0], [1], [2], [], []]


@pytest.mark.parametrize("args", [(0, 0, 1), (4, 0, 0), (4, 2, 2), (4, -1, 2)])
def test_owned_rejects(args):
    with pytest.raises(UsageError):
        owned(*args)


def test_micro_batch_identity_is_independent_of_world():
    seeds = {micro_batch_seed(7, s, m) for s in range(4) for m in range(12)}
    assert len(seeds) == 48 and all(0 <= x < 2**63 for x in seeds)
    assert micro_batch_seed(7, 3, 5) == micro_batch_seed(7, 3, 5) != micro_batch_seed(8, 3, 5)

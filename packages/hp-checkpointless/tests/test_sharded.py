"""Which peer rebuilds which optimizer shard after a failure (the decision every rank takes alike)."""

from __future__ import annotations

import pytest

from hp.checkpointless.sharded import ShardLost, Versions, own_roll_forward_needed, plan_shard_sources


def versions(committed, shard, replica, grads) -> Versions:
    return Versions(list(committed), list(shard), list(replica), list(grads))


def test_nothing_to_rebuild_when_every_shard_is_current():
    v = versions([7] * 4, [7] * 4, [7] * 4, [-1] * 4)
    assert plan_shard_sources(v, 7) == {}


def test_at_job_start_no_rank_has_state_and_none_is_missing():
    v = versions([-1] * 4, [-1] * 4, [-1] * 4, [-1] * 4)
    assert plan_shard_sources(v, -1) == {}


def test_a_fresh_process_gets_its_shard_from_its_buddy():
    v = versions([7, -1, 7, 7], [7, -1, 7, 7], [7, -1, 7, 7], [-1] * 4)
    assert plan_shard_sources(v, 7) == {1: 2}


def test_a_buddy_one_step_behind_can_rebuild_only_with_that_steps_gradients():
    with_grads = versions([7, -1, 7, 7], [7, -1, 7, 7], [7, -1, 6, 7], [-1, -1, 7, -1])
    assert plan_shard_sources(with_grads, 7) == {1: 2}
    without = versions([7, -1, 7, 7], [7, -1, 7, 7], [7, -1, 6, 7], [-1] * 4)
    with pytest.raises(ShardLost, match="buddy rank 2 holds a copy of step 6"):
        plan_shard_sources(without, 7)


def test_the_last_rank_s_buddy_is_rank_0():
    v = versions([7, 7, 7, -1], [7, 7, 7, -1], [7, 7, 7, -1], [-1] * 4)
    assert plan_shard_sources(v, 7) == {3: 0}


def test_a_survivor_that_missed_the_vote_rolls_its_own_shard_forward():
    v = versions([7, 6, 7, 7], [7, 6, 7, 7], [7, 6, 7, 7], [7, 7, 7, 7])
    assert plan_shard_sources(v, 7) == {}
    assert own_roll_forward_needed(v, 1, 7) and not own_roll_forward_needed(v, 0, 7)


def test_owner_and_buddy_both_fresh_means_the_shard_is_lost():
    v = versions([7, -1, -1, 7], [7, -1, -1, 7], [7, -1, -1, 7], [-1] * 4)
    with pytest.raises(ShardLost, match="shard of rank 1 at step 7 is lost: its buddy rank 2 holds nothing"):
        plan_shard_sources(v, 7)

"""Where a lost FSDP2/HSDP shard comes from (the decision every rank takes alike), and what an FSDP2
model registered with hp must be."""

from __future__ import annotations

import pytest

from hp.checkpointless.fsdp import ShardVersions, plan_sources
from hp.checkpointless.mesh import MeshLayout
from hp.checkpointless.replicas import NO_REPLICA
from hp.checkpointless.sharded import ShardLost

HSDP, FSDP = MeshLayout.of(4, replicate=2), MeshLayout.of(4)


def versions(shard, grads=(-1,) * 4, replica_at=(NO_REPLICA,) * 4, replica_grads=(-1,) * 4) -> ShardVersions:
    return ShardVersions(list(shard), list(grads), list(replica_at), list(replica_grads))


def test_nothing_moves_when_every_shard_is_current_or_at_job_start():
    assert plan_sources(versions([7] * 4), 7, HSDP) == (set(), {})
    assert plan_sources(versions([-1] * 4), -1, FSDP) == (set(), {})


def test_hsdp_takes_a_lost_shard_from_its_replicate_group():
    # rank 1 replaced: ranks 1 and 3 hold shard 1
    assert plan_sources(versions([7, -1, 7, 7]), 7, HSDP) == (set(), {1: (3, False)})
    assert plan_sources(versions([-1, 7, 7, 7]), 7, HSDP) == (set(), {0: (2, False)})


def test_hsdp_source_that_missed_the_vote_rolls_forward_first():
    # rank 0 committed step 7 (then died); rank 3 finished step 7's backward but missed the vote
    v = versions([-1, 7, 6, 6], grads=[-1, 7, 7, 7])
    rolls, sources = plan_sources(v, 7, HSDP)
    assert rolls == {2, 3} and sources == {0: (2, False)}


def test_hsdp_shard_lost_with_its_whole_replicate_group():
    with pytest.raises(ShardLost, match=r"HSDP shard of rank 1 at step 7 is lost: no rank of its replicate group \[1, 3\]"):
        plan_sources(versions([7, -1, 7, -1]), 7, HSDP)


def test_fsdp_takes_a_lost_shard_from_its_buddy_copy():
    # the copy made before the vote of step 8, which failed: the shard of step 7 with step 8's gradients
    v = versions([7, -1, 7, 7], replica_at=[6, 6, 7, 7], replica_grads=[7, 7, 8, 8])
    assert plan_sources(v, 7, FSDP) == (set(), {1: (2, False)})


def test_fsdp_rolls_the_buddy_copy_forward_after_the_vote():
    # rank 2 died after the vote of step 8: its buddy holds its shard of step 7 and step 8's gradients of it
    v = versions([8, 8, -1, 8], replica_at=[7, 7, 7, 7], replica_grads=[8, 8, 8, 8])
    assert plan_sources(v, 8, FSDP) == (set(), {2: (3, True)})


def test_fsdp_buddy_along_the_agreed_ring():
    v = versions([8, -1, 8, 8], replica_at=[7, 7, 7, 7], replica_grads=[8, 8, 8, 8])
    assert plan_sources(v, 8, FSDP, ring=(0, 2, 1, 3)) == (set(), {1: (3, True)})


def test_a_copy_without_the_gradients_of_the_step_cannot_rebuild_it():
    v = versions([8, -1, 8, 8], replica_at=[7, 7, 7, 7], replica_grads=[-1, -1, -1, -1])
    with pytest.raises(ShardLost, match="FSDP shard of rank 1 at step 8 is lost: its buddy rank 2 holds a copy of "
                                        "step 7 with the gradients of step -1"):
        plan_sources(v, 8, FSDP)


def test_fsdp_shard_lost_with_its_buddy():
    with pytest.raises(ShardLost, match="FSDP shard of rank 1 at step 7 is lost: its buddy rank 2 holds nothing"):
        plan_sources(versions([7, -1, -1, 7], replica_at=[7, 7, 7, 7], replica_grads=[8] * 4), 7, FSDP)


def test_only_missing_or_stale_shadows_are_copied_whole_again():
    from hp.checkpointless.fsdp import stale_shadows

    assert stale_shadows(versions([7] * 4, replica_at=[7] * 4), 7) == []
    assert stale_shadows(versions([7] * 4, replica_at=[7, 6, 7, 7], replica_grads=[-1, 7, -1, -1]), 7) == []
    assert stale_shadows(versions([7] * 4, replica_at=[7, 6, 7, 7]), 7) == [1]  # one step behind, no gradients
    assert stale_shadows(versions([7, -1, 7, 7], replica_at=[7, NO_REPLICA, 7, 7]), 7) == [1]  # a replacement
    assert stale_shadows(versions([-1] * 4), -1) == [0, 1, 2, 3]  # job start: NO_REPLICA is not "one step before -1"
    assert stale_shadows(versions([7] * 4, replica_at=[7] * 4), 7, ring_kept=False) == [0, 1, 2, 3]


def test_a_malformed_shard_from_a_peer_is_a_transfer_error_not_a_crash():
    import torch

    from hp.checkpointless import state, transfer
    from hp.checkpointless.shadow import Shadow

    with pytest.raises(state.StateTransferError, match="rank 3 sent a malformed shard: KeyError"):
        with transfer.from_peer(3, "shard"):
            Shadow({"at": 1}, torch.optim.AdamW)
    params = [torch.zeros(2), torch.zeros(3)]
    with pytest.raises(state.StateTransferError, match=r"optimizer order \[0, 0\] .* does not cover its 2 parameters"):
        Shadow({"at": 1, "hyper": [{"lr": 0.1}], "shard": {"params": params, "optim": {}, "order": [0, 0],
                                                            "sizes": [2]}}, torch.optim.AdamW)

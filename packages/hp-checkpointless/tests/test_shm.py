"""Same-node hydration through shared memory: the buffer, what a source accepts as one, and the state wire's
in-place flag (the end-to-end path runs in every hp demo whose spare has its buffer ready, and in
test_bench_hydrate.py, which checks the state delivered bit for bit)."""

from __future__ import annotations

import os

import pytest
import torch

from hp.checkpointless import shm, state


def test_a_receiver_buffer_is_attached_by_its_offer_and_shares_its_bytes():
    mine = shm.SharedBuffer.create(4096)
    assert shm.offered(mine.offer()) and not shm.offered(shm.no_offer())
    theirs = shm.SharedBuffer.attach(mine.offer(), 1000)
    theirs.tensor[:3] = torch.tensor([7, 8, 9], dtype=torch.uint8)
    assert mine.tensor[:3].tolist() == [7, 8, 9]
    theirs.close()
    mine.received()
    assert mine.tensor[:3].tolist() == [7, 8, 9]  # the receiver's mapping outlives its fd


def test_a_source_refuses_an_offer_too_small_for_the_state_or_of_something_else():
    mine = shm.SharedBuffer.create(4096)
    with pytest.raises(ValueError, match="4096 bytes for 8192 bytes of state"):
        shm.SharedBuffer.attach(mine.offer(), 8192)
    with pytest.raises(ValueError, match="pid -1"):
        shm.SharedBuffer.attach(torch.tensor([-1, 3, 4096]), 10)
    with open(os.devnull, "rb") as f:  # a character device, not a shared buffer
        with pytest.raises(ValueError, match="no shared buffer of this user's"):
            shm.SharedBuffer.attach(torch.tensor([os.getpid(), f.fileno(), 4096]), 10)
    with pytest.raises(OSError):  # above the kernel's largest pid: no such process
        shm.SharedBuffer.attach(torch.tensor([2**22 + 1, 3, 4096]), 10)


def test_a_state_packed_in_place_needs_room_for_all_of_it():
    st = {"a": torch.arange(100, dtype=torch.float32)}
    frames = state.encode(st, None, torch.zeros(4096, dtype=torch.uint8))
    assert len(frames) == 2 and int(frames[0][7]) == state.IN_PLACE  # header and skeleton only
    with pytest.raises(state.StateTransferError, match="holds 64 bytes, the state needs 400"):
        state.encode(st, None, torch.zeros(64, dtype=torch.uint8))


def test_the_in_place_flag_is_covered_by_the_header_checksum():
    header = state._header(10, 400, 1, 0, state.IN_PLACE)
    flipped = header.clone()
    flipped[7] = 0
    assert state._header_crc(header) == int(header[6]) != state._header_crc(flipped)


def test_a_rank_behind_hydrates_from_the_lowest_up_to_date_rank_of_its_node():
    from hp.checkpointless.agreement import Agreement
    from hp.checkpointless.sharded import Versions

    v = Versions([5] * 6, [-1] * 6, [-1] * 6, [-1] * 6)
    a = Agreement(3, 5, source=0, behind=[1, 4], versions=v, nodes=(0, 0, 0, 1, 1, 2))
    assert (a.source_for(1), a.source_for(4)) == (0, 3)  # its node's lowest up-to-date rank
    alone = Agreement(3, 5, source=0, behind=[5], versions=v, nodes=(0, 0, 0, 1, 1, 2))
    assert alone.source_for(5) == 0  # nobody up to date on node 2: the lowest rank, over the transport
    assert Agreement(3, 5, source=0, behind=[1], versions=v).source_for(1) == 0  # nodes unknown

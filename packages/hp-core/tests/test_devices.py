"""Every process of a node gets a device slot (LOCAL_RANK), spares included, and a replacement takes the
slot its predecessor freed (pure; the agent's use of it: test_agent_devices in integration)."""

from __future__ import annotations

import pytest

from hp.core.devices import DeviceSlots


def test_workers_then_spares_take_slots_in_order_and_a_replacement_takes_the_freed_one():
    slots = DeviceSlots(5)  # 4 workers + 1 spare
    assert [slots.take() for _ in range(5)] == [0, 1, 2, 3, 4]
    slots.release(1)  # rank 1's process died for good; the spare on slot 4 holds its rank now
    assert slots.take() == 1  # the replenished spare gets rank 1's device
    slots.release(1)
    slots.release(1)  # idempotent
    assert slots.free == [1]


def test_more_processes_than_slots_get_new_ones_and_a_bad_count_is_refused():
    slots = DeviceSlots(1)
    assert (slots.take(), slots.take()) == (0, 1) and slots.count == 2
    slots.release(7)  # not a slot of this node: ignored
    assert slots.free == []
    with pytest.raises(ValueError, match="non-negative number of device slots"):
        DeviceSlots(-1)

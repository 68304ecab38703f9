"""The elastic demo's report of each change of world size (hp.elastic.demo.run.scale_events), from event logs."""

from __future__ import annotations

import math

from hp.elastic.demo.run import scale_events


def _commits(rows: list[tuple[int, int, float]]) -> list[dict]:
    return [{"event": "commit", "step": s, "world": w, "t": t, "loss": "0x1p+0", "rank": 0} for s, w, t in rows]


def test_a_size_held_for_one_step_still_has_a_pause():
    """4 -> 3 for a single step (the replacement joined at once) -> 4: the step at 3 has no step time of its own;
    the pause uses the run's median step time instead of becoming NaN (seen once replacements were forked ready)."""
    rows = [(0, 4, 0.0), (1, 4, 1.0), (2, 4, 2.0), (3, 3, 5.0), (4, 4, 7.5), (5, 4, 8.5)]
    events = _commits(rows) + [{"event": "failure_detected", "t": 2.5, "rank": 0}]
    shrink, grow = scale_events(events)
    assert (shrink["from"], shrink["to"], shrink["kind"]) == (4, 3, "shrink")
    assert shrink["step_s"] == 1.0 and shrink["pause_s"] == 2.0  # gap 3 s, less the run's 1 s step
    assert (grow["from"], grow["to"], grow["kind"]) == (3, 4, "grow")
    assert grow["step_s"] == 1.0 and grow["pause_s"] == 1.5  # the step time at 4, measured at 4
    assert not any(math.isnan(e["pause_s"]) for e in (shrink, grow))

"""The torchft variant of `hp bench recovery`: its arithmetic on hand-made event logs (the real run,
Lighthouse, torchruns, SIGKILL, restart and heal, is checked by test_bench_recovery's bench run)."""

from __future__ import annotations

import pytest
from hp.chaos.baselines import torchft_bench
from hp.chaos.bench.recovery_common import BenchConfig

def _commit(t: float, rank: int, step: int, loss: str, participants: int = 4, weights: str = "") -> dict:
    return {"t": t, "event": "commit", "rank": rank, "attempt": 0, "step": step, "loss": loss,
            "participants": participants, "weights": weights or f"w{step}"}


def test_downtime_is_the_survivors_lost_time_and_rejoin_is_measured_on_the_restarted_group():
    cfg = BenchConfig(model_size="tiny", nproc=4, steps=6, fault_step=2)
    reference = [_commit(2.0 * s, 0, s, f"l{s}") for s in range(6)]  # 2 s a step, minutes earlier
    faulted = [_commit(float(s), 0, s, f"l{s}") for s in range(3)]  # 1 s a step before the fault
    faulted += [{"t": 2.1, "event": "fault_injected", "rank": 1, "attempt": 0, "step": 2}]
    faulted += [_commit(7.6, 0, 3, "l3", participants=3, weights="y3"), _commit(9.0, 0, 4, "x4", participants=3),
                _commit(10.0, 0, 5, "x5")]
    faulted += [{"t": 2.1 + i, "event": name, "rank": 1, "attempt": 1, **extra} for i, (name, extra) in enumerate(
        [("started", {}), ("imported", {}), ("data_attached", {}), ("model_ready", {}), ("pg_ready", {}),
         ("restored", {"step": 3})], start=1)]
    faulted += [{**_commit(10.0, 1, 5, "x5"), "attempt": 1}]  # the restarted group's first commit
    r = torchft_bench.analyse(reference, sorted(faulted, key=lambda e: e["t"]), cfg)
    assert r["step_time_s"] == pytest.approx(1.0) and r["reference_step_time_s"] == pytest.approx(2.0)
    assert r["to_next_step_s"] == pytest.approx(7.6 - 2.1) and r["downtime_s"] == pytest.approx(7.6 - 2.1 - 1.0)
    assert r["rejoin_s"] == pytest.approx(6.0) and r["restored_step"] == 3
    assert r["all_ranks_back_s"] == pytest.approx(10.0 - 2.1) and r["recovery_s"] == r["rejoin_s"]
    assert r["rejoin_stall_s"] == pytest.approx(0.4)  # step 4 took 1.4 s against a median of 1.0
    assert r["dropped_batches"] == 2 and r["world_at_step_after_fault"] == 3
    # step 3's loss was computed on step 2's weights, as in the reference, but its update averaged 3
    # groups' gradients: the weights after it differ
    assert (r["bitwise_equal"], r["first_divergent_step"], r["equal_before_fault"]) == (False, 3, True)
    assert torchft_bench.analyse(reference, faulted[:3], cfg) == {"error": "no fault was injected"}

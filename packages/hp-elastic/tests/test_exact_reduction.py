"""ExactReduction, the step transaction's exact mode: in process (slots, collectives, errors) and across
real processes (gloo, CPU): training at W = 1, 2, 3, 4 ends in bit-identical parameters and AdamW state."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hp.core.errors import UsageError
from hp import testing
from hp.elastic import exact
from hp.elastic.exact import ExactReduction, NonFiniteGradientError, dequantize, exact_mean, quantize, scale_shift

reduction_mod = pytest.importorskip("hp.checkpointless.reduction")  # MeanReduction, the float control

HERE = Path(__file__).resolve().parent
WORLD, TIMEOUT_S = 4, 55


class Recorder:
    """A collective for one rank alone (W=1): records what it was asked to run, runs nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, torch.dtype, object]] = []

    def __call__(self, fn, tensor, op=None) -> None:
        self.calls.append((fn, tensor.dtype, op))


def wide(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gradient-like values over ~20 orders of magnitude (within ``dtype``'s range), with zeros."""
    gen = torch.Generator().manual_seed(seed)
    lo = -6 if dtype == torch.float16 else -18
    mag = torch.pow(10.0, torch.empty(n, dtype=torch.float64).uniform_(lo, 3, generator=gen))
    g = (torch.randn(n, dtype=torch.float64, generator=gen) * mag).to(dtype)
    g[seed % 5::9] = 0.0
    return g


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def test_is_a_reduction():
    assert isinstance(ExactReduction(), reduction_mod.Reduction)


@pytest.mark.parametrize("dtype, scale", [
    (torch.float32, 1.0), (torch.float32, 1e-30), (torch.float32, 1e34), (torch.bfloat16, 1.0),
    (torch.bfloat16, 1e-30), (torch.bfloat16, 1e34), (torch.float16, 1.0), (torch.float64, 1.0),
    (torch.float64, 1e-300), (torch.float64, 1e304)])
def test_blocked_path_matches_quantize_bit_for_bit(monkeypatch, dtype, scale):
    # the scales reach the two-factor scaling (tiny max: shift > 127 for float32) and the unfused
    # dequantize (float64 extremes), besides the one-multiply, one-divide common case
    monkeypatch.setattr(exact, "CHUNK", 1000)  # several blocks and a ragged last one
    grads = [(wide(4321, s, torch.float64) * scale).to(dtype) if dtype != torch.float16 else wide(4321, s, dtype)
             for s in range(5)]
    assert all(torch.isfinite(g).all() for g in grads) and grads[0].any()
    shift = scale_shift(max(g.abs().max().item() for g in grads), 5)
    total = sum((quantize(g, shift) for g in grads), torch.zeros(4321, dtype=torch.int64))
    assert torch.equal(bits(exact_mean(grads, 5)), bits(dequantize(total, shift, 5, dtype)))


def test_micro_batches_are_saved_in_reused_slots():
    grads = [wide(3000, s) for s in range(6)]
    red, buf = ExactReduction(), torch.zeros(3000)
    ptrs = None
    for step in range(3):
        red.begin()
        buf.fill_(123.0)  # whatever the buffer held before: the first micro-batch overwrites it below
        for m in (2, 3, 4):
            buf.copy_(grads[m]) if m == 2 else buf.add_(grads[m])  # backward accumulates into the buffer
            red.micro_batch_done(buf, m)
            assert not buf.any(), "micro_batch_done must zero the buffer"
        ptrs = ptrs or [s.data_ptr() for s in red._slots]
        assert [s.data_ptr() for s in red._slots] == ptrs and len(ptrs) == 3
        rec = Recorder()
        red.reduce(buf, 6, rec)
        assert rec.calls == [(dist.all_reduce, torch.float64, dist.ReduceOp.MAX),
                             (dist.all_reduce, torch.int64, dist.ReduceOp.SUM)]
        assert torch.equal(bits(buf), bits(exact_mean(grads[2:5], 6)))


def test_a_plain_step_reduces_the_buffer_itself():
    g = wide(777, 3)
    red, buf = ExactReduction(), g.clone()
    red.begin()
    red.reduce(buf, 2, Recorder())
    assert torch.equal(bits(buf), bits(exact_mean([g], 2)))


def test_a_rank_with_no_micro_batch_joins_both_collectives():
    red, buf, rec = ExactReduction(), torch.zeros(50), Recorder()
    red.begin()
    red.reduce(buf, 3, rec)
    assert len(rec.calls) == 2 and not buf.any()


@pytest.mark.parametrize("value, word", [(math.nan, "NaN"), (math.inf, "inf")])
def test_non_finite_makes_the_mean_nan_after_the_first_collective(value, word):
    red, buf, rec = ExactReduction(), torch.zeros(20), Recorder()
    red.begin()
    for m in (4, 5):
        buf.copy_(wide(20, m))
        if m == 5:
            buf[3] = value
        red.micro_batch_done(buf, m)
    red.reduce(buf, 8, rec)  # as a float all-reduce: NaN everywhere, so a GradScaler skips the step
    assert bool(buf.isnan().all())
    assert len(rec.calls) == 1  # every rank saw it after the MAX: nobody enters the int64 all-reduce
    buf[3] = value
    with pytest.raises(NonFiniteGradientError, match=rf"{word} in micro-batch\(es\) \[0\] on this rank"):
        exact_mean([buf[3:4]], 8)  # the function form reports it


def test_bad_input():
    red, buf = ExactReduction(), torch.zeros(4)
    red.begin()
    red.micro_batch_done(buf, 0)
    with pytest.raises(UsageError, match="reported twice"):
        red.micro_batch_done(buf, 0)
    red.micro_batch_done(buf, 1)
    with pytest.raises(UsageError, match="total=1"):
        red.reduce(buf, 1, Recorder())
    with pytest.raises(UsageError, match="changed within a step"):
        red.micro_batch_done(torch.zeros(5), 2)
    with pytest.raises(UsageError, match="floating-point"):
        red.reduce(torch.zeros(4, dtype=torch.int64), 4, Recorder())


def run_ranks(scenario: str, out: Path) -> None:
    testing.run_ranks([str(HERE / "exact_reduction_worker.py"), scenario, str(out)], WORLD, TIMEOUT_S, scenario,
                      {**os.environ, "OMP_NUM_THREADS": "1"})


def load_states(out: Path, mode: str, worlds) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    return {(w, r): torch.load(out / f"{mode}_w{w}_r{r}.pt", weights_only=True) for w in worlds for r in range(w)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


@pytest.mark.slow
def test_training_is_bit_identical_at_w_1_to_4(tmp_path):
    run_ranks("train", tmp_path)
    worlds = range(1, WORLD + 1)
    exact_states = load_states(tmp_path, "exact", worlds)
    ref = exact_states[(1, 0)]
    assert ref["step"].eq(4).all() and ref["exp_avg_sq"].any()
    differ = [key for key, s in exact_states.items() if not same(s, ref)]
    assert not differ, f"exact mode: (W, rank) {differ} differ from W=1"
    # the control: the float reduction of per-rank sums depends on W, so the test can fail
    mean_states = load_states(tmp_path, "mean", worlds)
    assert all(same(mean_states[(w, r)], mean_states[(w, 0)]) for w, r in mean_states)  # ranks agree within a W
    mean_differ = [w for w in worlds if not same(mean_states[(w, 0)], mean_states[(1, 0)])]
    assert mean_differ, "MeanReduction was bit-identical at every W: the test does not exercise rounding"
    assert torch.allclose(mean_states[(1, 0)]["params"], ref["params"], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_zero_micro_batch_rank_nan_and_plain_step(tmp_path):
    run_ranks("edge", tmp_path)
    # M=3 at W=4: rank 3 owns nothing, takes part in both collectives, and training matches W=1
    states = load_states(tmp_path, "exact", (1, WORLD))
    assert all(same(s, states[(1, 0)]) for s in states.values())
    texts = [(tmp_path / f"nan{r}.txt").read_text() for r in range(WORLD)]
    assert texts == ["all NaN"] * WORLD, texts  # one rank's NaN: every rank's mean is NaN
    plain = [torch.load(tmp_path / f"plain{r}.pt", weights_only=True) for r in range(WORLD)]
    assert all(torch.equal(bits(p["reduced"]), bits(plain[0]["reduced"])) for p in plain)
    assert torch.equal(bits(plain[0]["reduced"]), bits(exact_mean([p["mine"] for p in plain], WORLD)))

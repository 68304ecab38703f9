"""Exact mode in one process: scale choice, quantization, W-independence by simulated ranks, errors."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from hp.elastic.exact import (
    NonFiniteGradientError, dequantize, exact_mean, precision_bits, quantize, scale_shift,
)
from hp.elastic.ownership import owned

# pytest runs with --import-mode=importlib: the tests directory is not on sys.path, load the cases by path
_spec = importlib.util.spec_from_file_location("hp_elastic_exact_cases", Path(__file__).with_name("exact_cases.py"))
_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cases)
M, micro_grads = _cases.M, _cases.micro_grads


def test_precision_bits_and_shift():
    assert [precision_bits(m) for m in (1, 2, 3, 4, 12, 1024, 1025)] == [62, 61, 60, 60, 58, 52, 51]
    assert scale_shift(0.0, 12) == 0
    assert scale_shift(1.0, 12) == 58 - 1  # 1.0 = 0.5 * 2**1
    assert scale_shift(0.75, 12) == 58


@pytest.mark.parametrize("m_total", [1, 3, 12, 1000])
def test_sum_of_m_maxima_fits_int64(m_total):
    g = torch.tensor([3.4e38, -3.4e38, 1.0], dtype=torch.float32)  # near float32 max
    shift = scale_shift(3.4e38, m_total)
    q = quantize(g, shift)
    assert q.abs().max().item() * m_total <= 2**62
    assert torch.equal(dequantize(q * m_total, shift, m_total, torch.float32)[:2], g[:2])


def test_values_near_the_max_are_lossless():
    g = torch.tensor([1.0, -0.1, 2.0**-28, 1e-7, 0.0], dtype=torch.float32)
    shift = scale_shift(1.0, 12)
    assert torch.equal(dequantize(quantize(g, shift), shift, 1, torch.float32), g)
    tiny = torch.tensor([1.0, 2.0**-60], dtype=torch.float32)
    assert dequantize(quantize(tiny, shift), shift, 1, torch.float32)[1].item() == 0.0  # below G * 2**-(K+1)


def test_simulated_ranks_give_identical_bits():
    # Integer sums are associative: summing per-rank integer partials reproduces the single-rank sum.
    grads = micro_grads()
    ref = exact_mean(grads, M)
    gmax = max(g.abs().max().item() for g in grads)
    shift = scale_shift(gmax, M)
    for w in range(1, 9):
        partials = [sum((quantize(grads[m], shift) for m in owned(M, r, w)), torch.zeros(grads[0].numel(),
                    dtype=torch.int64)) for r in range(w)]
        total = partials[0].clone()
        for p in partials[1:]:
            total += p
        assert torch.equal(dequantize(total, shift, M, torch.float32).view(torch.int32), ref.view(torch.int32))


def test_mean_is_accurate():
    grads = micro_grads()
    ref = torch.stack([g.double() for g in grads]).mean(0)
    got = exact_mean(grads, M).double()
    assert (got - ref).abs().max().item() <= ref.abs().max().item() * 2**-23
    assert torch.equal(exact_mean([torch.zeros(5)] * 3, 3), torch.zeros(5))


@pytest.mark.parametrize("value, word", [(math.nan, "NaN"), (math.inf, "inf"), (-math.inf, "inf")])
def test_non_finite_raises(value, word):
    grads = micro_grads()[:3]
    grads[1] = grads[1].clone()
    grads[1][10] = value
    with pytest.raises(NonFiniteGradientError, match=rf"{word} in micro-batch\(es\) \[8\] on this rank"):
        exact_mean(grads, M, micro_ids=[7, 8, 9])


def test_bad_arguments():
    with pytest.raises(ValueError, match="numel"):
        exact_mean([], 4)
    assert torch.equal(exact_mean([], 4, numel=3), torch.zeros(3))
    with pytest.raises(ValueError, match="same numel"):
        exact_mean([torch.zeros(3), torch.zeros(4)], 4)
    with pytest.raises(ValueError, match="floating"):
        exact_mean([torch.zeros(3, dtype=torch.int64)], 4)
    with pytest.raises(ValueError, match="only 1"):
        exact_mean([torch.zeros(3)] * 2, 1)
    with pytest.raises(ValueError, match="not initialized"):
        exact_mean([torch.zeros(3)], 1, group=object())

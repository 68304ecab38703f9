"""Exact mode across real processes (gloo, CPU): bit-identical means for W = 1, 2, 3, 4."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from hp import testing
from hp.elastic.exact import exact_mean

# pytest runs with --import-mode=importlib: the tests directory is not on sys.path, load the cases by path
_spec = importlib.util.spec_from_file_location("hp_elastic_exact_cases", Path(__file__).with_name("exact_cases.py"))
_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cases)
M, micro_grads = _cases.M, _cases.micro_grads

HERE = Path(__file__).resolve().parent
WORLD, TIMEOUT_S = 4, 90


def run_ranks(out: Path) -> None:
    # the worker finds exact_cases.py next to itself (sys.path[0])
    testing.run_ranks([str(HERE / "exact_worker.py"), str(out)], WORLD, TIMEOUT_S, "exact-mode ranks",
                      {**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exact")
    run_ranks(out)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_exact_mean_bit_identical_for_w_1_to_4(results):
    got = {w: torch.load(results / f"w{w}.pt", weights_only=True) for w in range(1, WORLD + 1)}
    reference = exact_mean(micro_grads(), M)  # in process, no group: W = 1 without torch.distributed
    for w, r in got.items():
        assert r["exact"].dtype == torch.float32
        assert torch.equal(bits(r["exact"]), bits(reference)), f"exact mean at W={w} differs from W=1"
    # the test can fail: a float all-reduce of per-rank float sums is not W-independent
    differ = [w for w, r in got.items() if not torch.equal(bits(r["float"]), bits(got[1]["float"]))]
    assert differ, "float all-reduce happened to be identical at every W: the data does not exercise rounding"
    # and exact mode is as accurate as float: close to the float64 mean
    exact64 = torch.stack([g.double() for g in micro_grads()]).mean(0)
    err = (reference.double() - exact64).abs().max().item()
    assert err <= exact64.abs().max().item() * 2**-23, err


@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_non_finite_is_reported_on_every_rank(results, kind):
    texts = [(results / f"{kind}{r}.txt").read_text() for r in range(WORLD)]
    assert all(t.startswith("NonFiniteGradientError") for t in texts), texts
    word = "NaN" if kind == "nan" else "inf"
    owner_of_7 = 2  # owned(12, 2, 4) == [6, 7, 8]
    assert f"{word} in micro-batch(es) [7] on this rank" in texts[owner_of_7]
    assert all("on another rank" in t for r, t in enumerate(texts) if r != owner_of_7)

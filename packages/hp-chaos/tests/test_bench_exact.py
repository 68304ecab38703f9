"""``hp bench exact`` with tiny settings: the result's shape, never its timings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hp.chaos.bench.exact import ExactBenchConfig, format_table, run
from hp.core.errors import UsageError

pytest.importorskip("hp.checkpointless.demo.model")


@pytest.mark.slow
def test_bench_runs_both_modes():
    r = run(ExactBenchConfig(model_size="tiny", seq=16, micro_batches=2, micro_batch=1, steps=2, warmup=0,
                             timeout_s=120))
    for key in ("float_step_s", "exact_step_s", "float_reduce_s", "exact_reduce_s"):
        assert r[key] > 0, key
        lo, hi = r[key[:-2] + "_range_s"]
        assert 0 < lo <= r[key] <= hi
    assert all(r[f"{m}_{w}_cpu_s"] > 0 for m in ("float", "exact") for w in ("step", "reduce"))
    assert r["ratio"] > 0 and r["cpu_ratio"] > 0 and r["params"] > 0 and r["grad_bytes"] == 4 * r["params"]
    assert (r["world"], r["micro_batches_per_rank"], r["micro_batches_per_step"]) == (2, 2, 4)
    assert json.loads(json.dumps(r)) == r
    assert "step ratio" in format_table(r)


def test_bad_settings_are_one_line_usage_errors():
    with pytest.raises(UsageError, match="model-size"):
        run(ExactBenchConfig(model_size="huge"))
    with pytest.raises(UsageError, match="nproc"):
        run(ExactBenchConfig(nproc=1))
    out = subprocess.run([sys.executable, "-m", "hp.chaos.bench.exact", "--steps", "0"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--steps" in out.stderr


def test_import_does_not_load_torch():
    code = "import sys, hp.chaos.bench.exact; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr

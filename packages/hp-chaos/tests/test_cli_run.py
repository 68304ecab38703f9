"""``hp chaos run FILE --json`` end to end with real jobs: the last stdout line is one JSON object,
an unmet expectation makes the exit code 1 and is named, the result file feeds ``hp chaos report``."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from hp.testing import HP

SCENARIO = """\
name: cli-slow-rank
job: {nodes: 1, nproc_per_node: 2, spares: 0, steps: 6, model: tiny, seed: 0}
faults:
  - {at_step: 2, phase: allreduce, kind: slow, target: "rank:1", delay_s: 1.0, steps: 2}
expect: {completes: true, bitwise_equal: true, lost_steps: 0, recoveries: 0, min_goodput: 1.0}
"""


@pytest.mark.timeout(600)  # two real jobs on a shared 2-core machine; the bound only catches hangs
def test_hp_chaos_run_json_names_the_unmet_expectation_and_exits_1(tmp_path):
    (tmp_path / "cache").mkdir()
    path = tmp_path / "slow.yaml"
    path.write_text(SCENARIO)
    out = subprocess.run([*HP, "chaos", "run", str(path), "--json", "--log-dir", str(tmp_path / "logs")],
                         capture_output=True, text=True, timeout=560,
                         env={**os.environ, "HP_DATA_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(r) == {"name", "passed", "bitwise_equal", "lost_steps", "recovery_s", "goodput", "failures", "result"}
    # a straggler costs time, never bits: everything holds except a goodput of 1.0 (2 s of sleeping)
    assert (r["passed"], r["bitwise_equal"], r["lost_steps"]) == (False, True, 0)
    assert len(r["failures"]) == 1 and r["failures"][0].startswith("min_goodput: expected >= 1.0, got 0."), r
    assert len(r["recovery_s"]) == 1 and r["recovery_s"][0] >= 1.0 and 0 < r["goodput"] < 1
    full = json.loads((tmp_path / "logs" / "result.json").read_text())
    assert r["result"] == str(tmp_path / "logs" / "result.json") and full["recoveries"] == 0
    assert full["faults"][0]["fired"] and full["orphans_killed"] == 0
    assert "unmet" in out.stdout and "verdict" in out.stdout
    report = subprocess.run([*HP, "chaos", "report", r["result"]], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0 and (tmp_path / "logs" / "result.png").stat().st_size > 10_000

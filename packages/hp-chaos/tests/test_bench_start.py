"""``hp bench start``: its JSON contract (a smoke run of one job per start method) and its bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HP = [sys.executable, "-m", "hp.core.cli"]


@pytest.mark.timeout(600)
def test_bench_start_times_both_start_methods_from_their_events(tmp_path):
    out = subprocess.run([*HP, "bench", "start", "--repeats", "1", "--steps", "3", "--json", "--out",
                          str(tmp_path / "start.json")], capture_output=True, text=True, timeout=560)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r == json.loads((tmp_path / "start.json").read_text())
    assert r["benchmark"] == "start" and r["processes"] == 3 and set(r["methods"]) == {"spawn", "forkserver"}
    for figures in r["methods"].values():
        assert figures["total_s"]["n"] == 1
        assert 0 < figures["first_commit_s"]["median"] < figures["total_s"]["median"]
        assert 0 < figures["exit_s"]["median"] < figures["total_s"]["median"]
    assert set(r["ratio"]) == {"first_commit_s", "exit_s", "total_s"} and all(v > 0 for v in r["ratio"].values())
    assert "a smoke run" in out.stdout


@pytest.mark.parametrize("args, message", [(["--repeats", "0"], "--repeats must be >= 1, got 0"),
                                           (["--nproc", "0"], "--nproc must be >= 1, got 0")])
def test_bench_start_bad_input_is_one_line(args, message):
    out = subprocess.run([*HP, "bench", "start", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr

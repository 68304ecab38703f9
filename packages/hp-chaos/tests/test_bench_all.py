"""`hp bench all`: the suite into one results file a README can quote (commit, clean tree, machine, each
benchmark's own JSON), with real benchmark processes."""

from __future__ import annotations

import json
import subprocess

import pytest
from hp.chaos.bench import suite as bench_all
from hp.testing import HP


@pytest.mark.timeout(300)
def test_bench_all_writes_each_benchmarks_json_with_commit_and_machine(tmp_path):
    out_path = tmp_path / "results" / "smoke.json"
    out = subprocess.run([*HP, "bench", "all", "--quick", "--only", "exact", "--out", str(out_path)],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    r = json.loads(out_path.read_text())
    assert r["schema"] == bench_all.SCHEMA and r["quick"] is True and r["completed"] is True
    assert r["machine"]["cores"] >= 1 and r["machine"]["torch"]
    assert list(r["benchmarks"]) == ["exact"]
    exact = r["benchmarks"]["exact"]
    assert exact["returncode"] == 0 and exact["args"] == bench_all.SUITE["exact"][1]
    assert "written:" in out.stdout and "exact" in out.stdout
    demo = r["demo"]  # hp demo's table, as a new user first sees it: its verdict is every rank's bits
    assert demo["completed"] is True and demo["bitwise_equal"] is True and demo["recovery_s"] > 0


def test_source_says_whether_the_figures_come_from_committed_code(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "f.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "f.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    monkeypatch.chdir(repo)
    clean = bench_all.source()
    assert clean["clean_tree"] is True and len(clean["commit"]) == 40
    (repo / "f.py").write_text("x = 2\n")
    assert bench_all.source()["clean_tree"] is False
    monkeypatch.chdir(tmp_path)  # not a repository
    assert bench_all.source() == {"commit": None, "clean_tree": None}


def test_a_benchmark_that_prints_no_json_is_recorded_as_failed():
    r = bench_all.run_one("recovery", ["--repeats", "0"], log=lambda m: None)  # a usage error: exit 2
    assert r["completed"] is False and r["returncode"] == 2 and "--repeats must be >= 1" in r["error_tail"]


@pytest.mark.parametrize("args, message", [(["--out", "x.json", "--only", "bogus"], "--only"),
                                           (["--out", "results.txt"], "--out must name a .json file")])
def test_bench_all_bad_input_is_a_one_line_error(args, message):
    out = subprocess.run([*HP, "bench", "all", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr

"""``hp bench step`` (issue #16): hp's step against plain DDP, same model, ranks and launcher, one job per mode
alternating. A small run: the contract of its JSON and that its figures are the ranks' own timings."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

HP = [sys.executable, "-m", "hp.core.cli"]
SMALL = ["--model-size", "tiny", "--vocab", "256", "--steps", "3", "--warmup", "1", "--repeats", "1", "--corpus-mb", "1"]


def test_bench_step_json_has_every_mode_and_the_overheads_of_their_medians(tmp_path):
    out = tmp_path / "step.json"
    done = subprocess.run([*HP, "bench", "step", *SMALL, "--json", "--out", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r == json.loads(out.read_text())
    assert r["benchmark"] == "step" and r["world"] == 2 and r["pinned"] is True
    for mode in ("hp", "hp_overlap", "ddp", "fsdp", "hp_fsdp"):
        step, compute, tail = (r[f"{mode}_{w}"] for w in ("step", "compute", "tail"))
        assert step["n"] == 3 and step["median"] == r[f"{mode}_step_s"] > 0  # 3 steps x 1 job
        assert all(0 < c <= s for c, s in zip(compute["values"], step["values"]))
        assert statistics.median(step["values"]) == r[f"{mode}_step_s"]
    assert r["overhead"] == round(r["hp_step_s"] / r["ddp_step_s"] - 1, 4)
    assert r["overlap_overhead"] == round(r["hp_overlap_step_s"] / r["ddp_step_s"] - 1, 4)
    assert r["fsdp_overhead"] == round(r["hp_fsdp_step_s"] / r["fsdp_step_s"] - 1, 4)
    assert len(r["overhead_by_repeat"]) == len(r["overlap_overhead_by_repeat"]) == len(r["fsdp_overhead_by_repeat"]) == 1
    for line in ("overhead (hp / ddp - 1)", "overhead (hp_overlap / ddp - 1)", "overhead (hp_fsdp / fsdp - 1)"):
        assert line in done.stdout


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps, --repeats"),
    (["--nproc", "1"], "--nproc must be >= 2"),
    (["--model-size", "huge"], "--model-size must be one of"),
    (["--vocab", "10"], "--vocab must be >= 256"),
])
def test_bench_step_bad_input_is_one_line(argv, message):
    done = subprocess.run([*HP, "bench", "step", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr

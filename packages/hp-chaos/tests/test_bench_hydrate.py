"""``hp bench hydrate`` (issue #16): a spare's hydration on one node through shared memory and over gloo,
against a memcpy of the same bytes in the same run. A small run: the JSON contract, and that every
transfer delivered the source's state (the bench fails otherwise)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import torch

HP = [sys.executable, "-m", "hp.core.cli"]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
def test_bench_hydrate_json_has_every_mode_its_throughput_and_the_ratio_to_the_floor(device, tmp_path):
    out = tmp_path / "hydrate.json"
    done = subprocess.run([*HP, "bench", "hydrate", "--model-size", "tiny", "--vocab", "256", "--repeats", "2",
                           "--device", device, "--json", "--out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r == json.loads(out.read_text())
    assert r["benchmark"] == "hydrate" and r["nbytes"] > 1_000_000 and r["pinned"] is True and r["device"] == device
    modes = ("shm", "premapped", "tcp", "floor", *(("staging",) if device == "cuda" else ()))
    for mode in modes:
        s = r[f"{mode}_s"]
        assert s["n"] == 2 and s["median"] == statistics.median(s["values"]) > 0
        assert r[f"{mode}_gbps"] == round(r["nbytes"] / s["median"] / 1e9, 3)
    assert r["shm_of_floor"] == round(r["floor_s"]["median"] / r["shm_s"]["median"], 3)
    assert r["premapped_of_floor"] == round(r["floor_s"]["median"] / r["premapped_s"]["median"], 3)
    assert r["definition_version"] == 2
    assert "of the memcpy floor's throughput" in done.stdout
    assert ("staging_s" in r) is (device == "cuda")


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--model-size", "huge"], "--model-size must be one of"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    *([(["--device", "cuda"], "--device cuda needs a CUDA GPU")] if not torch.cuda.is_available() else []),
])
def test_bench_hydrate_bad_input_is_one_line(argv, message):
    done = subprocess.run([*HP, "bench", "hydrate", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr

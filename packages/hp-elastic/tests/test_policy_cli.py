"""A bad scaling policy given to the real `hp run --nnodes MIN:MAX --scaling-policy FILE`: one line on stderr
naming the file and the problem, exit code 2, and nothing started (no controller, no log directory)."""

from __future__ import annotations

import os
import subprocess

import pytest

from hp.testing import HP, free_port

GOOD = {"min_replicas": "1", "max_replicas": "2", "global_batch": "8", "micro_batch": "2"}


def write_policy(tmp_path, **keys: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in {**GOOD, **keys}.items()))
    return str(path)


@pytest.mark.parametrize("keys, problem", [
    ({"min_replicas": "3", "max_replicas": "2"}, "min_replicas 3 > max_replicas 2"),
    ({"min_replicas": "2", "max_replicas": "5", "unit": "2"}, "unit 2 does not divide max_replicas 5"),
    ({"max_replicas": "4", "unit": "2", "min_replicas": "2", "sizes": "[2, 3]"}, "unit 2 does not divide sizes [3]"),
    ({"global_batch": "10", "micro_batch": "4"}, "global_batch 10 is not a multiple of micro_batch 4"),
    ({"bogus": "1", "lr_rul": "linear"}, "unknown keys bogus, lr_rul (known: min_replicas, max_replicas,"),
])
def test_a_bad_policy_is_one_line_exit_2_and_starts_nothing(tmp_path, keys, problem):
    policy = write_policy(tmp_path, **keys)
    logs = tmp_path / "logs"
    out = subprocess.run(
        [*HP, "run", "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--scaling-policy", policy,
         "--log-dir", str(logs), "-m", "x"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HP_JOB_TOKEN": "t0ken" * 8})
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith(f"hp: error: scaling policy file {policy}: "), lines[0]
    assert problem in lines[0], lines[0]
    assert out.stdout == ""
    assert not logs.exists()  # the agent stopped before its log directory, its controller, its workers

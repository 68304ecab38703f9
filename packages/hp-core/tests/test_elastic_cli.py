"""The elastic flags of the real `hp` CLI (`hp run --nnodes MIN:MAX --scaling-policy FILE`, `hp scale`): bad
input is one line on stderr and exit code 2, before anything starts. No training.

The checks of a policy file's content need hp-elastic: they are in hp-elastic's tests/test_policy_cli.py.
"""

from __future__ import annotations

import os
import subprocess
from importlib.metadata import entry_points

import pytest

from hp.testing import HP, free_port


def hp(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*HP, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HP_JOB_TOKEN": "t0ken" * 8, **(env or {})})


def one_line_usage_error(out: subprocess.CompletedProcess, message: str) -> None:
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hp: error: "), out.stderr
    assert message in lines[0], lines[0]
    assert "Traceback" not in out.stderr and out.stdout == ""


@pytest.fixture
def policy(tmp_path) -> str:
    path = tmp_path / "policy.yaml"
    path.write_text("min_replicas: 1\nmax_replicas: 2\nglobal_batch: 8\nmicro_batch: 2\n")
    return str(path)


def test_min_above_max_is_refused(policy, tmp_path):
    out = hp("run", "--nnodes", "3:2", "--scaling-policy", policy, "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
             "--log-dir", str(tmp_path / "logs"), "-m", "x")
    one_line_usage_error(out, "--nnodes MIN:MAX needs MIN <= MAX, got 3:2")
    assert not (tmp_path / "logs").exists()


def test_min_max_needs_a_scaling_policy():
    out = hp("run", "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "x")
    one_line_usage_error(out, "--nnodes MIN:MAX makes an elastic job: give its --scaling-policy FILE")


@pytest.mark.parametrize("nnodes", ["x:y", "1:2:3"])
def test_a_malformed_nnodes_is_refused(nnodes, policy):
    out = hp("run", f"--nnodes={nnodes}", "--scaling-policy", policy, "-m", "x")
    one_line_usage_error(out, f"--nnodes: expected N or MIN:MAX (e.g. 2:4), got {nnodes!r}")


def test_a_missing_policy_file_is_refused(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    out = hp("run", "--nnodes", "1:2", "--scaling-policy", missing, "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
             "-m", "x")
    one_line_usage_error(out, f"--scaling-policy: no such file: {missing}")


@pytest.mark.parametrize("grace", ["0"])
def test_a_grace_period_that_is_not_positive_is_refused(grace, policy):
    out = hp("run", "--nnodes", "1:2", "--scaling-policy", policy, "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
             f"--grace-period={grace}", "-m", "x")
    one_line_usage_error(out, f"--grace-period must be > 0, got {float(grace)}")


def test_an_elastic_job_needs_a_fixed_rdzv_endpoint(policy):
    out = hp("run", "--nnodes", "1:2", "--scaling-policy", policy, "-m", "x")
    one_line_usage_error(out, "--rdzv-endpoint HOST:PORT with a fixed port is required")


def _has_elastic() -> bool:
    return any(ep.name == "elastic" for ep in entry_points(group="hp"))


@pytest.mark.skipif(not _has_elastic(), reason="`hp scale` comes from hp-elastic's plugin")
@pytest.mark.parametrize("replicas, message", [
    ("-1", "--replicas must be >= 0, got -1"),
    ("two", "argument --replicas: invalid int value: 'two'"),
])
def test_hp_scale_refuses_bad_replicas(replicas, message):
    out = hp("scale", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--replicas", replicas)
    one_line_usage_error(out, message)


def test_a_late_node_may_use_a_node_rank_from_min_to_max(policy, tmp_path):
    # nobody listens at the endpoint: a valid start ends when the rendezvous times out (1 s)
    out = hp("run", "--nnodes", "1:2", "--node-rank", "1", "--scaling-policy", policy,
             "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-timeout", "1", "--log-dir", str(tmp_path / "l"),
             "-m", "x")
    assert "--node-rank" not in out.stderr, out.stderr

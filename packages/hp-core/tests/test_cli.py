"""The `hp` command line: discovery output and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from hp.testing import HP


def hp(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*HP, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_backends_json_lists_builtin_plugins_with_their_dist():
    out = hp("backends", "--json")
    assert out.returncode == 0, out.stderr
    found = {(b["family"], b["name"]): b["dist"] for b in json.loads(out.stdout)}
    for key in [("transport", "gloo"), ("transport", "nccl"), ("scheduler", "local"), ("store", "tcp"),
                ("cli", "run"), ("cli", "backends")]:
        assert found.get(key) == "hp-core", (key, found)
    assert all(set(b) == {"family", "name", "dist"} for b in json.loads(out.stdout))


def test_backends_table():
    out = hp("backends")
    rows = [line.split() for line in out.stdout.splitlines()]
    assert out.returncode == 0 and rows[0] == ["FAMILY", "NAME", "DIST"] and ["transport", "gloo", "hp-core"] in rows


@pytest.mark.parametrize("args, message", [
    (["run", "--transport", "bogus", "x.py"], "unknown transport backend 'bogus' (available: gloo, nccl)"),
    (["run", "--store", "zookeeper", "x.py"], "unknown store backend 'zookeeper'"),
    (["run", "--rdzv-endpoint", "localhost", "x.py"], "--rdzv-endpoint: expected HOST:PORT"),
    (["run", "--rdzv-endpoint", "a:b:c", "x.py"], "--rdzv-endpoint: expected HOST:PORT"),
    (["run", "--rdzv-endpoint", "host:99999", "x.py"], "--rdzv-endpoint: expected HOST:PORT"),
    (["run", "--nproc-per-node", "0", "x.py"], "--nproc-per-node must be >= 1, got 0"),
    (["run", "--nproc-per-node", "two", "x.py"], "invalid int value: 'two'"),
    (["run", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1", "x.py"], "--node-rank must be in [0, 2)"),
    (["run", "--nnodes", "2", "x.py"], "--rdzv-endpoint HOST:PORT with a fixed port is required"),
    (["run", "--spares", "-1", "x.py"], "--spares must be >= 0, got -1"),
    (["run", "--start-method", "fork", "x.py"], "argument --start-method: invalid choice: 'fork'"),
    (["run"], "the following arguments are required: entrypoint"),
    # #13 findings 7-8: a run id becomes a directory name: never a path out of it, never a traceback
    (["run", "--run-id", "../../../some/dir", "x.py"], "--run-id must be 1-128 of [A-Za-z0-9_.-]"),
    (["run", "--run-id", "a/b", "x.py"], "--run-id must be 1-128 of [A-Za-z0-9_.-]"),
    (["run", "--run-id", "..", "x.py"], "not '.' or '..', got '..'"),
    (["fly"], "invalid choice: 'fly'"),
    # #31 item 11: bounds before anything starts (the agent grew to 2.4 GB; nan and negatives were accepted)
    (["run", "--nproc-per-node", "99999999999999999999", "x.py"], "--nproc-per-node must be at most 1024"),
    (["run", "--spares", "5000", "x.py"], "--spares must be at most 1024"),
    (["run", "--rdzv-timeout", "nan", "x.py"], "--rdzv-timeout must be > 0 seconds"),
    (["run", "--heartbeat-timeout", "inf", "x.py"], "--heartbeat-timeout must be > 0 seconds and at most"),
    (["run", "--hang-timeout", "-1", "x.py"], "--hang-timeout must be >= 0"),
    (["run", "--log-dir", "/proc/hp-test/logs", "x.py"], "--log-dir /proc/hp-test/logs: No such file or directory"),
    (["controller", "--nnodes", "1", "--port", "70000"], "--port must be in [0, 65535], got 70000"),
    (["controller", "--nnodes", "1", "--heartbeat-timeout", "-5"], "--heartbeat-timeout must be > 0 seconds"),
    (["controller", "--nnodes", "1", "--heartbeat-timeout", "nan"], "--heartbeat-timeout must be > 0 seconds"),
    (["--log-level", "BOGUS", "backends"], "argument --log-level: invalid choice: 'BOGUS'"),
    (["controller", "--nnodes", "1"], "a shared job token is required"),
])
def test_bad_input_is_one_line_exit_2_no_traceback(args, message):
    out = hp(*args, env={"HP_JOB_TOKEN": ""})
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hp: error:"), out.stderr
    assert message in lines[0]
    assert out.stdout == ""


def test_a_controller_that_cannot_listen_says_so_in_one_line():
    """#13 finding 8: an address this machine does not have was a traceback."""
    out = hp("controller", "--nnodes", "1", "--host", "10.255.255.1", "--port", "0", env={"HP_JOB_TOKEN": "t" * 32})
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--host 10.255.255.1: cannot listen there" in lines[0], out.stderr


def test_nccl_without_cuda_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the nccl transport is available here")
    out = hp("run", "--transport", "nccl", "x.py")
    assert out.returncode == 2
    assert out.stderr.strip() == ("hp: error: transport 'nccl' needs CUDA GPUs, but torch.cuda.is_available() "
                                  "is False on this machine; use --transport gloo")


def test_token_is_fresh_hex():
    a, b = hp("token").stdout.strip(), hp("token").stdout.strip()
    assert a != b and len(a) == 64 and int(a, 16) >= 0


@pytest.mark.parametrize("args, env, message", [
    (["--rdzv-endpoint", "nohost"], {"HP_JOB_TOKEN": "t0ken" * 8}, "--rdzv-endpoint: expected HOST:PORT"),
    (["--rdzv-endpoint", "127.0.0.1:1"], {"HP_JOB_TOKEN": ""}, "a shared job token is required"),
    (["--rdzv-endpoint", "127.0.0.1:1", "--token-file", "/nonexistent"], {}, "--token-file: No such file"),
])
def test_hp_finish_bad_input_is_one_line(args, env, message):
    out = hp("finish", *args, env=env)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr


@pytest.mark.parametrize("flag, message", [
    ("--token-file", "--token-file {}: not UTF-8 text"),
    ("--scaling-policy", "scaling policy file {}: not UTF-8 text"),
])
def test_a_file_that_is_not_utf8_is_one_line(tmp_path, flag, message):
    """#31 item 11: a non-UTF-8 token file or policy was a UnicodeDecodeError traceback."""
    bad = tmp_path / "bad"
    bad.write_bytes(b"\xff\xfe\x00")
    nnodes = "1:2" if flag == "--scaling-policy" else "2"  # each makes hp read the file
    out = hp("run", flag, str(bad), "--nnodes", nnodes, "--rdzv-endpoint", "127.0.0.1:1", "x.py",
             env={"HP_JOB_TOKEN": "t0ken" * 8})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and message.format(bad) in lines[0], out.stderr

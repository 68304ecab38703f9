"""The ``hp.run`` TorchX component: the real ``torchx`` CLI lists it, dry-runs it for several
schedulers, and really launches ``hp run`` with it on ``local_cwd``."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from torchx import specs
from torchx.specs.builders import materialize_appdef

from hp.core import auth
from hp.testing import free_port, kill_tagged
from hp.core.torchx_component import run as hp_run

BIN = Path(sys.executable).parent
TORCHX = BIN / "torchx"
TX_MARKER = Path(__file__).parent / "workers" / "tx_marker.py"
TOKEN_RE = re.compile(r"[0-9a-f]{64}")


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def __str__(self) -> str:  # shown by failing asserts
        return f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


@pytest.fixture
def torchx_cli(tmp_path: Path):
    """Runs the real ``torchx`` CLI in tmp_path with HP_TEST_DIR=tmp_path and the venv's bin dir
    first on PATH; everything it started is killed afterwards, even if the test failed."""
    started: list[subprocess.Popen] = []

    def _run(*args: str, extra_env: dict[str, str] | None = None, timeout: float = 90) -> Result:
        env = {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "HP_TEST_DIR": str(tmp_path),
            **(extra_env or {}),
        }
        proc = subprocess.Popen(
            [str(TORCHX), *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        started.append(proc)
        out, err = proc.communicate(timeout=timeout)
        return Result(proc.returncode, out, err)

    yield _run
    for proc in started:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
    kill_tagged(f"HP_TEST_DIR={tmp_path}")


def _scheduler_request(result: Result) -> str:
    marker = "=== SCHEDULER REQUEST ==="
    assert marker in result.stdout, result
    return result.stdout.split(marker, 1)[1]


def _bash_argv(line: str, env: dict[str, str] | None = None) -> list[str]:
    """The argv ``bash -c line`` hands to ``hp``, with ``hp`` replaced by a function that prints
    its arguments one per line (NUL-separated, so arguments with spaces survive)."""
    out = subprocess.run(
        ["bash", "-c", "hp() { printf 'hp\\0'; printf '%s\\0' \"$@\"; }; " + line],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(env or {})},
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout
    return out.split("\0")[:-1]


# --- the real CLI ---------------------------------------------------------------------------------


def test_builtins_lists_torchx_components_next_to_hp(torchx_cli):
    result = torchx_cli("builtins")
    assert result.returncode == 0, result
    listed = set(re.findall(r"^\s*\d+\.\s+(\S+)\s*$", result.stdout, flags=re.MULTILINE))
    assert {"dist.ddp", "utils.echo", "hp.run"} <= listed, result


def test_local_cwd_run_launches_hp_run_with_two_workers(torchx_cli, tmp_path):
    result = torchx_cli(
        "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'torchx'}",
        "hp.run", "--nproc_per_node", "2", "--log_dir", str(tmp_path / "hp-logs"),
        "--script", str(TX_MARKER),
    )
    assert result.returncode == 0, result
    assert "SUCCEEDED" in result.stderr, result
    done = {r: json.loads((tmp_path / f"tx_rank{r}.done").read_text()) for r in range(2)}
    assert [d["rank"] for d in done.values()] == ["0", "1"]
    assert all(d["world_size"] == "2" for d in done.values()), done
    assert done[0]["pid"] != done[1]["pid"]
    assert not (tmp_path / "tx_rank2.pid").exists(), "more workers than --nproc_per_node"
    # hp's agent, not TorchX, ran the workers: their logs are in hp's --log-dir layout
    assert (tmp_path / "hp-logs" / "rank1" / "attempt_0" / "stdout.log").read_text().startswith("tx worker rank 1 done")


def test_local_cwd_run_two_nodes_rendezvous_through_rank0_host(torchx_cli, tmp_path):
    # Two `hp run` replicas: node 1 finds node 0's controller through ${TORCHX_RANK0_HOST}.
    result = torchx_cli(
        "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'torchx'}",
        "hp.run", "--nnodes", "2", "--rdzv_port", str(free_port()),
        "--log_dir", str(tmp_path / "hp-logs"), "--script", str(TX_MARKER),
    )
    assert result.returncode == 0, result
    done = [json.loads((tmp_path / f"tx_rank{r}.done").read_text()) for r in range(2)]
    assert [d["world_size"] for d in done] == ["2", "2"], done


def test_local_cwd_run_reports_a_failing_worker(torchx_cli, tmp_path):
    result = torchx_cli(
        "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'torchx'}",
        "hp.run", "--log_dir", str(tmp_path / "hp-logs"), "--script", str(TX_MARKER),
        extra_env={"TX_EXIT_CODE": "3"},
    )
    assert (tmp_path / "tx_rank0.done").exists(), result
    assert result.returncode != 0, result
    assert "FAILED" in result.stderr, result


def test_local_cwd_dryrun(torchx_cli, tmp_path):
    result = torchx_cli(
        "run", "--dryrun", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'torchx'}",
        "hp.run", "--script", "train.py", "--", "--lr", "0.1",
    )
    assert result.returncode == 0, result
    request = ast.literal_eval(_scheduler_request(result).strip())  # a pformat'ed dict
    (replica,) = request["role_params"]["train"]
    assert replica["args"][:2] == ["bash", "-c"], request
    argv = shlex.split(replica["args"][2])
    assert argv[:2] == ["hp", "run"] and argv[-3:] == ["train.py", "--lr", "0.1"], argv
    assert argv[argv.index("--run-id") + 1] == request["app_id"], "the app_id macro was not substituted"
    assert replica["cwd"] == str(tmp_path)
    assert not list(tmp_path.glob("tx_rank*")), "a dry run started something"


def test_slurm_dryrun_emits_sbatch_script_running_hp(torchx_cli):
    result = torchx_cli("run", "--dryrun", "-s", "slurm", "hp.run", "--script", "train.py")
    assert result.returncode == 0, result
    request = _scheduler_request(result)
    assert "#SBATCH" in request and "srun" in request, result
    assert "bash -c 'hp run --nnodes 1" in request, result
    assert "train.py" in request


def test_kubernetes_dryrun_emits_volcano_job_with_rdzv_endpoint(torchx_cli):
    # torchx's kubernetes scheduler builds its request with the `kubernetes` client package,
    # which hp-core does not depend on.
    pytest.importorskip("kubernetes", reason="torchx's kubernetes dry run needs the `kubernetes` package")
    result = torchx_cli(
        "run", "--dryrun", "-s", "kubernetes", "-cfg", "queue=default", "--workspace", "",
        "hp.run", "--nnodes", "2", "--script", "train.py",
    )
    assert result.returncode == 0, result
    request = _scheduler_request(result)
    assert "kind: Job" in request and "batch.volcano.sh" in request, result
    assert "hp run --nnodes 2" in request, result
    # the `$$` escape survived macro substitution as a single `$`: bash expands it in the pod
    assert "--rdzv-endpoint ${TORCHX_RANK0_HOST:=localhost}:29400" in request, result
    assert "$${" not in request and "${rank0_env}" not in request, result
    assert "--node-rank '0'" in request and "--node-rank '1'" in request, result
    tokens = re.findall(r"name: HP_JOB_TOKEN\s+value: '?(\w+)'?", request)
    assert len(tokens) == 2 and len(set(tokens)) == 1 and TOKEN_RE.fullmatch(tokens[0]), request


# --- the component function in-process ------------------------------------------------------------


def test_single_node_app_def():
    app = hp_run(script="a.py")
    assert isinstance(app, specs.AppDef)
    assert len(app.roles) == 1
    role = app.roles[0]
    assert role.num_replicas == 1
    assert role.entrypoint == "bash" and role.args[0] == "-c"
    line = role.args[1]
    assert "hp run" in line and "a.py" in line
    argv = shlex.split(line)
    assert argv[:2] == ["hp", "run"] and argv[-1] == "a.py"
    assert "--node-rank" not in argv and "--rdzv-endpoint" not in argv
    assert auth.TOKEN_ENV not in role.env
    assert app.name == role.name == "a"


@pytest.mark.parametrize("kwargs", [{}, {"script": "a.py", "m": "pkg.mod"}])
def test_exactly_one_of_script_and_module(kwargs):
    with pytest.raises(ValueError, match="exactly one"):
        hp_run(**kwargs)


def test_multi_node_module_app_def_resolves_rank0_host():
    app = hp_run(m="pkg.mod", nnodes=2)
    role = app.roles[0]
    assert role.num_replicas == 2
    argv = shlex.split(role.args[1])
    assert "--node-rank" in argv
    i = argv.index("-m")
    assert argv[i + 1] == "pkg.mod" and i + 2 == len(argv)
    assert app.name == "pkg-mod"

    values = specs.macros.Values(img_root="", app_id="job-42", replica_id="1", rank0_env="TORCHX_RANK0_HOST")
    resolved = values.apply(role).args[1]
    assert "${TORCHX_RANK0_HOST:=localhost}:29400" in resolved, resolved
    assert "$$" not in resolved and "${replica_id}" not in resolved and "${app_id}" not in resolved

    # What bash really runs on a node: the controller is localhost unless torchx names rank 0's host.
    for env, host in [({}, "localhost"), ({"TORCHX_RANK0_HOST": "node-0.svc"}, "node-0.svc")]:
        argv = _bash_argv(resolved, env)
        assert argv[:2] == ["hp", "run"], argv
        assert argv[argv.index("--rdzv-endpoint") + 1] == f"{host}:29400", argv
        assert argv[argv.index("--node-rank") + 1] == "1"
        assert argv[argv.index("--run-id") + 1] == "job-42"
        assert argv[argv.index("--nnodes") + 1] == "2"
        assert argv[-2:] == ["-m", "pkg.mod"]


def test_script_args_and_awkward_paths_reach_hp_run_intact():
    app = hp_run("--lr", "0.1", "--name", "a b; echo pwned", script="my dir/train.py", nnodes=2, rdzv_port=31000)
    values = specs.macros.Values(img_root="", app_id="j", replica_id="0", rank0_env="TORCHX_RANK0_HOST")
    argv = _bash_argv(values.apply(app.roles[0]).args[1])
    assert argv[-5:] == ["my dir/train.py", "--lr", "0.1", "--name", "a b; echo pwned"], argv
    assert argv[argv.index("--rdzv-endpoint") + 1] == "localhost:31000"
    assert app.roles[0].port_map == {"hp-controller": 31000}


def test_multi_node_job_token():
    role = hp_run(script="train.py", nnodes=2).roles[0]
    token = role.env.get(auth.TOKEN_ENV)
    assert token is not None and TOKEN_RE.fullmatch(token), role.env
    assert hp_run(script="train.py", nnodes=2).roles[0].env[auth.TOKEN_ENV] != token, "token reused across jobs"
    given = hp_run(script="train.py", nnodes=2, env={auth.TOKEN_ENV: "f" * 64, "X": "1"}).roles[0].env
    assert given == {auth.TOKEN_ENV: "f" * 64, "X": "1"}


def test_component_materializes_from_cli_style_args():
    # What `torchx run` does with the component: TorchX reads the parameter annotations to decode
    # strings into Dict/Optional values, so they must be real types, not postponed strings.
    app = materialize_appdef(
        hp_run,
        ["--nnodes", "2", "--nproc_per_node", "3", "--env", "A=1,B=two", "--script", "t.py", "--", "--x", "1"],
    )
    role = app.roles[0]
    assert role.num_replicas == 2
    assert role.env["A"] == "1" and role.env["B"] == "two" and TOKEN_RE.fullmatch(role.env[auth.TOKEN_ENV])
    argv = shlex.split(role.args[1])
    assert argv[argv.index("--nproc-per-node") + 1] == "3"
    assert argv[-3:] == ["t.py", "--x", "1"]

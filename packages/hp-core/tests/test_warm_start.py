"""The warm start (hp.core.warm_start): ``hp run``'s agent forked from the session's server is the process a
cold ``hp run`` would have been, and its stand-in ends, and is ended, as that process would be."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hp.core.protocol import WARM_START_ENV
from hp.testing import HP, tagged_pids, wait_for
from hp.core.warm_server import INTERPRETER_ENV
from hp.core.warm_start import python_command, resolve

# waits for the test's word, then exits with the code it names
SCRIPT = """
import os, sys, time
d = os.environ["HP_TEST_DIR"]
print(f"worker sees cwd={os.getcwd()} tag={os.environ.get('WARM_TAG')}", flush=True)
open(os.path.join(d, "started"), "w").close()
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(d, "finish")):
    assert time.monotonic() < deadline, "never told to finish"
    time.sleep(0.05)
sys.exit(int(open(os.path.join(d, "finish")).read() or 0))
"""


@pytest.fixture
def server() -> str:
    """The session's warm-start server, once it accepts (its imports take seconds at the session's start)."""
    path = os.environ.get(WARM_START_ENV, "")
    assert path, "the suite's conftest starts a warm-start server for every test session"

    def accepts() -> bool:
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(path)
            except OSError:
                return False
        return True
    wait_for(accepts, 120, "the warm-start server to listen")
    return path


def _start(tmp_path: Path, env: dict[str, str] | None = None, argv: list[str] | None = None) -> subprocess.Popen:
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "HP_TEST_DIR": str(tmp_path), "WARM_TAG": tmp_path.name, **(env or {})}
    return subprocess.Popen([*(argv or []), *HP, "run", "--nproc-per-node", "1", "--tee", "0", str(script)],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(tmp_path: Path, code: int) -> None:
    (tmp_path / "finish.tmp").write_text(str(code))
    (tmp_path / "finish.tmp").rename(tmp_path / "finish")


def _end(proc: subprocess.Popen) -> str:
    try:
        return proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _agent_of(proc: subprocess.Popen) -> int:
    wait_for(lambda: resolve(proc.pid) != proc.pid or proc.poll() is not None, 30, "the agent's pid")
    return resolve(proc.pid)


def test_the_forked_agent_is_the_process_hp_run_would_have_been(server, tmp_path):
    """Its environment (as /proc shows it), working directory, title, streams and exit code are the stand-in's;
    its parent is the server, not the stand-in. The same job with HP_WARM_START empty runs cold and ends alike."""
    proc = _start(tmp_path)
    agent = _agent_of(proc)
    assert agent != proc.pid, "hp run did not go through the warm-start server"
    wait_for(lambda: (tmp_path / "started").exists(), 60, "the worker to start")
    stat = Path(f"/proc/{agent}/stat").read_text()
    assert int(stat.rpartition(")")[2].split()[1]) != proc.pid
    assert f"WARM_TAG={tmp_path.name}".encode() + b"\0" in Path(f"/proc/{agent}/environ").read_bytes()
    assert b"hp.core.cli run --nproc-per-node 1" in Path(f"/proc/{agent}/cmdline").read_bytes().replace(b"\0", b" ")
    assert os.readlink(f"/proc/{agent}/cwd") == str(tmp_path)
    assert agent in tagged_pids(f"HP_TEST_DIR={tmp_path}")
    _finish(tmp_path, 3)
    warm = _end(proc)
    assert f"worker sees cwd={tmp_path} tag={tmp_path.name}" in warm, warm

    (tmp_path / "started").unlink()
    (tmp_path / "finish").unlink()
    cold = _start(tmp_path, {WARM_START_ENV: ""})
    wait_for(lambda: (tmp_path / "started").exists(), 60, "the cold worker to start")
    assert resolve(cold.pid) == cold.pid
    _finish(tmp_path, 3)
    out = _end(cold)
    assert proc.returncode == cold.returncode != 0, (warm, out)
    assert "exited with code 3" in warm and "exited with code 3" in out, (warm, out)


def test_a_stand_in_killed_takes_its_agent_and_workers_with_it(server, tmp_path):
    """SIGKILL of the stand-in (a CI timeout, a test killing its process group): the kernel kills the agent
    (the socket's F_SETSIG), and the agent's fork server and workers die with it, as with a cold agent."""
    proc = _start(tmp_path)
    agent = _agent_of(proc)
    wait_for(lambda: (tmp_path / "started").exists(), 60, "the worker to start")
    tag = f"HP_TEST_DIR={tmp_path}"
    assert agent in tagged_pids(tag) and len(tagged_pids(tag)) >= 3  # stand-in, agent, worker (+ server)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_for(lambda: not tagged_pids(tag), 20, f"every process of the job to end (left: {tagged_pids(tag)})")


def test_the_agent_killed_ends_its_stand_in_with_the_same_signal(server, tmp_path):
    proc = _start(tmp_path)
    agent = _agent_of(proc)
    wait_for(lambda: (tmp_path / "started").exists(), 60, "the worker to start")
    os.kill(agent, signal.SIGKILL)
    _end(proc)
    assert proc.returncode == -signal.SIGKILL
    wait_for(lambda: not tagged_pids(f"HP_TEST_DIR={tmp_path}"), 20, "the workers to end")


def test_sigterm_to_the_stand_in_is_the_agent_s(server, tmp_path):
    """The agent handles SIGTERM (it stops its workers and exits saying so): sent to the stand-in, it is
    passed on, and the job ends with the same code and message as a cold agent's."""
    outs = {}
    for mode, env in (("warm", {}), ("cold", {WARM_START_ENV: ""})):
        (tmp_path / "started").unlink(missing_ok=True)
        proc = _start(tmp_path, env)
        wait_for(lambda: (tmp_path / "started").exists(), 60, f"the {mode} worker to start")  # noqa: B023
        assert (resolve(proc.pid) != proc.pid) == (mode == "warm")
        proc.send_signal(signal.SIGTERM)
        outs[mode] = (_end(proc), proc.returncode)
    assert outs["warm"][1] == outs["cold"][1], outs
    assert "SIGTERM" in outs["warm"][0] and "SIGTERM" in outs["cold"][0], outs


def test_the_agent_enters_the_stand_in_s_network_namespace(server, tmp_path):
    """A stand-in started in another network namespace (``nsenter --net``, as the chaos harness starts a
    node's agent) gets an agent in that namespace."""
    argv = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    proc = _start(tmp_path, argv=argv)
    agent = _agent_of(proc)
    assert agent != proc.pid
    wait_for(lambda: (tmp_path / "started").exists(), 60, "the worker to start")
    assert os.readlink(f"/proc/{agent}/ns/net") == os.readlink(f"/proc/{proc.pid}/ns/net") != \
        os.readlink("/proc/self/ns/net")
    _finish(tmp_path, 0)
    out = _end(proc)
    assert proc.returncode == 0, out


@pytest.mark.parametrize("request_line, why", [
    ({"executable": "/usr/bin/python3"}, "another interpreter or hp installation"),
    ({"hp": "/elsewhere/hp/core"}, "another interpreter or hp installation"),
    ({"mode": "shell"}, "malformed request"),
    ({"env": {"PYTHONHASHSEED": "12345"}}, "interpreter settings differ: PYTHONHASHSEED"),
    ({"mode": "python", "argv": ["-X", "dev", "x.py"]}, "malformed request"),
    (b"not json\n", "Expecting value"),
    (b"x" * 70000, "request cut short or too large"),
])
def test_a_request_the_server_must_not_fork_for_is_refused(server, request_line, why):
    """Another interpreter or hp installation, a line that is not JSON, one cut short: refused in one line,
    nothing forked (the stand-in then runs hp itself)."""
    import hp.core

    if isinstance(request_line, dict):
        good = {"executable": sys.executable, "hp": os.path.dirname(os.path.abspath(hp.core.__file__)),
                "mode": "hp", "argv": ["hp", "run", "x.py"], "cwd": "/", "umask": 0o22, "affinity": [0], "nice": 0,
                "fds": [], "title": "hp run x.py"}
        env = {k: os.environ[k] for k in INTERPRETER_ENV if k in os.environ}  # the server's: the session's
        request_line = json.dumps({**good, **request_line, "env": {**env, **request_line.get("env", {})}}).encode() + b"\n"
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(server)
        s.sendall(request_line)
        if not request_line.endswith(b"\n"):
            s.shutdown(socket.SHUT_WR)
        reply = json.loads(s.makefile("rb").readline())
    assert "pid" not in reply and why in reply["refused"], reply


PROGRAM = """
import json, os, sys
warm = "torch" in sys.modules  # before the program imports anything: only a warm fork has it
import torch
here = {"warm": warm, "name": __name__, "argv": sys.argv, "path": sys.path[:2], "cwd": os.getcwd(),
        "threads": torch.get_num_threads(), "tag": os.environ.get("WARM_TAG"), "stdin": sys.stdin.read()}
if sys.argv[1:] == ["fail"]:
    raise RuntimeError("the program failed")
print(json.dumps(here), flush=True)
sys.exit(7)
"""


def _program(tmp_path: Path, command: list[str], *args: str) -> tuple[int, str]:
    """Run PROGRAM (tmp_path/prog/p.py, from tmp_path) with ``command``: (exit code, output)."""
    (tmp_path / "prog").mkdir(exist_ok=True)
    (tmp_path / "prog" / "p.py").write_text(PROGRAM)
    env = {**os.environ, "WARM_TAG": tmp_path.name, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path / "lib")}
    proc = subprocess.Popen([*command, "prog/p.py", *args], cwd=tmp_path, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.communicate(input="from stdin", timeout=120)[0]
    return proc.returncode, out


def test_a_python_program_forked_warm_runs_as_the_interpreter_would_run_it(server, tmp_path):
    """``python_command`` (the session has a server): the program runs in a fork that has torch, with the
    ``__main__``, ``sys.argv``, ``sys.path`` (PYTHONPATH too), working directory, environment, stdin, torch
    thread count (OMP_NUM_THREADS) and exit code of ``python prog/p.py`` (run cold beside it); an exception is a
    traceback and exit 1 as well; ``-c CODE ARGS`` has ``python -c``'s argv and sys.path[0]."""
    assert python_command(["prog/p.py", "a"]) == [sys.executable, "-m", "hp.core.warm_start", "prog/p.py", "a"]
    warm_code, warm_out = _program(tmp_path, [sys.executable, "-m", "hp.core.warm_start"], "a", "b")
    cold_code, cold_out = _program(tmp_path, [sys.executable], "a", "b")
    warm, cold = json.loads(warm_out.splitlines()[-1]), json.loads(cold_out.splitlines()[-1])
    assert (warm.pop("warm"), cold.pop("warm")) == (True, False)
    assert warm == cold == {"name": "__main__", "argv": ["prog/p.py", "a", "b"],
                            "path": [str(tmp_path / "prog"), str(tmp_path / "lib")],
                            "cwd": str(tmp_path), "threads": 1, "tag": tmp_path.name, "stdin": "from stdin"}
    assert warm_code == cold_code == 7
    code, out = _program(tmp_path, [sys.executable, "-m", "hp.core.warm_start"], "fail")
    assert code == 1 and "RuntimeError: the program failed" in out and "Traceback" in out, out
    code_c = "import json, sys; print(json.dumps([__name__, sys.argv, sys.path[0], 'torch' in sys.modules]))"
    outs = [subprocess.run([*cmd, "-c", code_c, "x"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
            for cmd in ([sys.executable, "-m", "hp.core.warm_start"], [sys.executable])]
    assert [json.loads(o.stdout) for o in outs] == [["__main__", ["-c", "x"], "", True],
                                                    ["__main__", ["-c", "x"], "", False]], outs


def test_without_a_server_the_stand_in_runs_the_program_cold(tmp_path, monkeypatch):
    monkeypatch.setenv(WARM_START_ENV, "")
    assert python_command(["x.py", "1"]) == [sys.executable, "x.py", "1"]
    code, out = _program(tmp_path, [sys.executable, "-m", "hp.core.warm_start"], "c")
    assert code == 7 and json.loads(out.splitlines()[-1])["warm"] is False, out


def test_a_stand_in_waits_for_a_starting_server_and_not_for_a_dead_one(tmp_path, monkeypatch):
    """Started while its server still imports, the program runs warm (it waited); a server that died
    before listening is not waited for (cold at once)."""
    from hp.core import warm_start

    with warm_start.session() as path:
        assert not os.path.exists(path)  # still importing
        code, out = _program(tmp_path, [sys.executable, "-m", "hp.core.warm_start"], "s")
        assert code == 7 and json.loads(out.splitlines()[-1])["warm"] is True, out
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "server").write_text(str(dead.pid))
    monkeypatch.setenv(WARM_START_ENV, str(tmp_path / "gone" / "sock"))
    code, out = _program(tmp_path, [sys.executable, "-m", "hp.core.warm_start"], "d")
    assert code == 7 and json.loads(out.splitlines()[-1])["warm"] is False, out

"""``hp ckpt ls|verify|gc`` on a namespace (daemon) or URL, bad input as one-line errors (exit 2),
and the wire format's refusals."""

from __future__ import annotations

import json
import socket

import pytest

from hp.core.auth import new_token
from hp.tiered_ckpt import fmt, wire


class Result:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def hp(capsys):
    """The real ``hp`` entry point, in process (a fresh interpreter per call costs seconds here)."""
    from hp.core.cli import main

    def run(*args: str) -> Result:
        capsys.readouterr()
        code = main(list(args))
        out = capsys.readouterr()
        return Result(code, out.out, out.err)
    return run


@pytest.mark.parametrize("args, message", [
    (["ckpt", "ls", "job"], "exactly one of --url"),
    (["ckpt", "ls", "job", "--url", "/x", "--daemon", "127.0.0.1:1"], "exactly one of --url"),
    (["ckpt", "ls", "job", "--daemon", "nohostport"], "expected HOST:PORT"),
    (["ckpt", "gc", "job", "--url", "/x", "--keep", "-1"], "--keep must be >= 1"),
    (["ckpt", "gc", "job", "--url", "/x", "--keep", "0"], "--keep must be >= 1"),  # #13 finding 4: wiped all
    (["ckpt", "ls", "job", "--url", "file:///nonexistent/hp"], "no such location"),
    (["ckpt", "verify", "job", "--url", "file:///nonexistent/hp"], "no such location"),
    (["ckpt", "ls", "job", "--url", "bogus://x"], "--url bogus://x:"),
    (["ckpt", "ls", "job", "--daemon", "127.0.0.1:1"], "127.0.0.1:1: ConnectionRefusedError"),  # finding 8
    (["ckpt", "daemon", "--listen", "127.0.0.1:0", "--replicas", "0", "--dir", "/etc/passwd"], "--dir /etc/passwd:"),
    (["ckpt", "ls", "a/b", "--url", "/x"], "namespace must be 1-128 of [A-Za-z0-9_.-]"),
    (["ckpt", "ls", "..", "--url", "/x"], "not '.' or '..'"),
    (["ckpt", "daemon", "--listen", "127.0.0.1:1", "--replicas", "-1"], "must be >= 0"),
])
def test_bad_input_is_one_line_exit_2(args, message, monkeypatch, hp):
    monkeypatch.setenv("HP_JOB_TOKEN", new_token())
    r = hp(*args)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_ls_verify_gc_on_url_and_daemon(daemons, token, tmp_path, monkeypatch, hp):
    import torch

    from hp.tiered_ckpt import TieredConfig, api
    from hp.testing import wait_for

    monkeypatch.setenv("HP_JOB_TOKEN", token)
    node = daemons("node0", replicas=0, via_hp_cli=True)  # `hp ckpt daemon` itself
    url = f"file://{tmp_path}/p"
    cfg = TieredConfig("job", daemon=node.addr, persist_url=url, persist_every=1)
    for step in (1, 2, 3):  # each persisted before the next save (a newer queued step supersedes an upload)
        api.save({"x": torch.full((8,), float(step))}, step, cfg)
        wait_for(lambda: (tmp_path / "p/job" / fmt.step_dir(step) / fmt.COMMIT).exists(), 60, f"step {step} committed")
    (tmp_path / "p/job" / fmt.step_dir(7)).mkdir()  # an upload that never finished

    ls = json.loads(hp("ckpt", "ls", "job", "--url", url, "--json").stdout)
    assert {r["step"]: r["complete"] for r in ls if r["step"] in (3, 7)} == {3: True, 7: False}
    shard2 = tmp_path / "p/job" / fmt.step_dir(2) / fmt.rank_file(0)
    shard2.write_bytes(shard2.read_bytes()[:10])  # #13 finding 4: a truncated step listed as complete
    ls = json.loads(hp("ckpt", "ls", "job", "--url", url, "--json").stdout)
    assert {r["step"]: r["complete"] for r in ls if r["step"] in (2, 3)} == {2: False, 3: True}

    def in_memory() -> list[int]:
        return [r["step"] for r in json.loads(hp("ckpt", "ls", "job", "--daemon", node.addr, "--json").stdout)
                if r["complete"]]

    # keep-memory 2: step 1 goes once no upload reads it any more (the last one may end after step 3's commit)
    wait_for(lambda: in_memory() == [2, 3], 30, "memory retention of 2 steps")
    v = hp("ckpt", "verify", "job", "--url", url, "--step", "3")
    assert v.returncode == 0 and "step 3: ok" in v.stdout
    v = hp("ckpt", "verify", "job", "--url", url, "--step", "7")
    assert v.returncode == 1 and "no commit marker" in v.stdout
    (tmp_path / "p/job" / fmt.step_dir(7) / fmt.COMMIT).write_text('{"world": "two"')  # finding 8: a traceback
    v = hp("ckpt", "verify", "job", "--url", url, "--step", "7")
    assert v.returncode == 1 and "unreadable commit marker" in v.stdout and "Traceback" not in v.stderr
    (tmp_path / "p/job" / fmt.step_dir(7) / fmt.COMMIT).unlink()

    gc = hp("ckpt", "gc", "job", "--url", url, "--keep", "1")
    assert gc.returncode == 0
    left = {r["step"]: r["complete"] for r in json.loads(hp("ckpt", "ls", "job", "--url", url, "--json").stdout)}
    assert left == {3: True, 7: False}  # older steps gone; the newer unfinished one is not ours to judge yet
    refused = hp("ckpt", "gc", "job", "--daemon", node.addr, "--keep", "1", "--admin-key-file", str(tmp_path / "none"))
    assert refused.returncode == 2 and "--admin-key-file" in refused.stderr and len(refused.stderr.splitlines()) == 1
    gc = hp("ckpt", "gc", "job", "--daemon", node.addr, "--keep", "1", "--admin-key-file", str(node.root / "admin.key"))
    assert json.loads(gc.stdout)["removed"] == [2]


def test_frames_are_authenticated_and_capped(daemons, token):
    node = daemons("node0", replicas=0)
    with socket.create_connection(("127.0.0.1", node.port)) as s:
        wire.send(s, new_token(), {"op": "list", "ns": "job"})  # signed with another job's token
        with pytest.raises(wire.WireError, match="closed"):
            wire.recv_header(s, token)
    with socket.create_connection(("127.0.0.1", node.port)) as s:
        s.sendall((wire.MAX_HEADER + 1).to_bytes(4, "big"))
        assert s.recv(10) == b""
    with socket.create_connection(("127.0.0.1", node.port)) as s:  # unknown op: refused with a reason
        with pytest.raises(wire.RefusedError, match="unknown op"):
            wire.exchange(s, token, {"op": "format_disk"})
        assert wire.exchange(s, token, {"op": "ping"})[0]["ok"]  # the connection stays usable
    out = node.output()
    assert "authentication failed" in out and "exceeds" in out


def test_idle_connections_announcing_big_headers_cost_the_daemon_no_memory(daemons, token):
    """#13 finding 5 (DoS): 4 MiB was allocated per connection before authentication; 40 stalled
    connections took a daemon from 28 to 188 MiB."""
    import time

    def rss_mib(pid: int) -> float:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

    node = daemons("node0", replicas=0)
    with socket.create_connection(("127.0.0.1", node.port)) as s:
        assert wire.exchange(s, token, {"op": "ping"})[0]["ok"]
    before = rss_mib(node.proc.pid)
    socks = []
    try:
        for _ in range(40):
            s = socket.create_connection(("127.0.0.1", node.port))
            s.sendall(wire.MAX_HEADER.to_bytes(4, "big") + b"0" * 64 + b"{")  # then nothing
            socks.append(s)
        time.sleep(1.0)  # every handler thread is in its read by now
        grown = rss_mib(node.proc.pid) - before
        assert grown < 40, f"40 stalled connections grew the daemon by {grown:.0f} MiB"
        with socket.create_connection(("127.0.0.1", node.port)) as s:  # and it still answers
            assert wire.exchange(s, token, {"op": "ping"})[0]["ok"]
    finally:
        for s in socks:
            s.close()


def test_seal_accepts_only_the_slot_the_daemon_handed_out(daemons, token):
    from hp.tiered_ckpt.client import DaemonClient
    from hp.tiered_ckpt.signed import new_save_id

    node = daemons("node0", replicas=0)
    c = DaemonClient(("127.0.0.1", node.port), token)
    path = c.slot("job", 0, 1, 4096)
    for bad_path, spans, size in (("/etc/passwd", [[0, 10]], 10), (path, [[4000, 200]], 4096), (path, [[0, 10]], 1 << 20)):
        with pytest.raises(wire.RefusedError):
            c.seal("job", 0, 1, 1, bad_path, size, spans, None, new_save_id())
    c.seal("job", 0, 1, 1, path, 4096, [[0, 4096]], None, new_save_id())

"""``hp bench ckpt`` (definition 2): what its figures mean, checked on a tiny state against a real
SeaweedFS and real node daemons.

One point of issue #12's audit per test: the floor is never timed while the daemon works on a save
or a DCP save is in flight, its order around the save alternates, hp and DCP are compared cold
against cold and warm against warm with >= 3 samples each, and the JSON carries its definition
version, the machine, the load average before/after and the spreads.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from unittest.mock import patch

import pytest

from hp.chaos.bench import ckpt as bench

ROUNDS, SAVES = 3, 1


@pytest.fixture(scope="module")
def s3():
    """A real SeaweedFS S3 endpoint for this module (as hp-tiered-ckpt's tests start one)."""
    from hp.tiered_ckpt.seaweed import SeaweedS3

    server = SeaweedS3().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def run(s3):
    """One real run through the ``hp`` entry point, in process: (exit code, stdout, stderr)."""
    from hp.core.cli import main

    out, err = io.StringIO(), io.StringIO()
    with patch.dict(os.environ, s3.env()), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["bench", "ckpt", "--params", "2e4", "--saves", str(SAVES), "--rounds", str(ROUNDS),
                     "--json", "--url", f"s3://{s3.bucket}/bench"])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def result(run) -> dict:
    code, out, err = run
    assert code == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def floor_violations(trace: list[dict]) -> list[str]:
    """Every floor timing that began while an hp save was not yet finished in the daemon (saved,
    checksummed, committed, uploaded: ``daemon_idle`` of the same round and step) or while a DCP
    save was in flight, or during which the daemon's CPU time advanced."""
    busy_hp: set[tuple] = set()
    dcp_in_flight = 0
    bad = []
    for e in trace:
        key = (e.get("round"), e.get("step"))
        what = e["what"]
        if what in ("hp_save_start", "hp_persist_start"):
            busy_hp.add(key)
        elif what == "daemon_idle":
            busy_hp.discard(key)
        elif what in ("dcp_async_start", "dcp_sync_start"):
            dcp_in_flight += 1
        elif what in ("dcp_async_done", "dcp_sync_done"):
            dcp_in_flight -= 1
        elif what == "floor_start" and (busy_hp or dcp_in_flight):
            bad.append(f"floor at t={e['t']} while hp {sorted(busy_hp)} / {dcp_in_flight} DCP saves were busy")
        elif what == "floor_end" and e["daemon_cpu_ticks"] > 1:
            bad.append(f"daemon used {e['daemon_cpu_ticks']} CPU ticks during the floor ending t={e['t']}")
    return bad


def test_floor_check_catches_the_definition_1_schedule():
    """The check above is not vacuous: definition 1 timed the floor right after save() returned."""
    v1 = [{"t": 0.0, "what": "hp_save_start", "round": 0, "step": 5},
          {"t": 0.3, "what": "hp_save_end", "round": 0, "step": 5},
          {"t": 0.3, "what": "floor_start", "round": 0, "step": 5},
          {"t": 0.7, "what": "floor_end", "round": 0, "step": 5, "daemon_cpu_ticks": 40}]
    assert len(floor_violations(v1)) == 2
    in_flight = [{"t": 0.0, "what": "dcp_async_start", "round": 0, "k": 1},
                 {"t": 0.1, "what": "floor_start", "round": 0, "step": 2},
                 {"t": 0.2, "what": "floor_end", "round": 0, "step": 2, "daemon_cpu_ticks": 0}]
    assert len(floor_violations(in_flight)) == 1


def test_floor_is_timed_only_with_the_daemon_idle(result):
    trace = result["trace"]
    assert sum(e["what"] == "floor_start" for e in trace) == result["floor_s"]["n"] == ROUNDS * (SAVES + 2)
    assert floor_violations(trace) == []
    assert result["floor_while_daemon_busy"] == sum(e["daemon_cpu_ticks"] > 0 for e in trace if e["what"] == "floor_end")


def test_floor_order_alternates_around_the_save(result):
    """floor, then save / save, daemon idle, then floor: in turn, and both reported."""
    trace = result["trace"]
    orders = []
    for i, e in enumerate(trace):
        if e["what"] != "floor_start":
            continue
        nxt = next(x for x in trace[i + 1:] if x["what"] != "floor_end")
        if nxt["what"] == "hp_save_start" and nxt["step"] == e["step"]:
            orders.append("before")
        else:
            prev = [x for x in trace[:i] if x["what"] != "floor_end"][-1]
            assert (prev["what"], prev["step"]) == ("daemon_idle", e["step"]), (prev, e)
            orders.append("after")
    assert all(a != b for a, b in zip(orders, orders[1:])), orders
    by_order = result["floor_by_order_s"]
    assert by_order["before_save"]["n"] + by_order["after_save_idle"]["n"] == result["floor_s"]["n"]
    assert min(by_order["before_save"]["n"], by_order["after_save_idle"]["n"]) >= 4


def test_cold_and_warm_are_compared_like_for_like(result):
    # hp: cold = a save that mapped a staging slot never used before; a fresh daemon per round has two
    # slots in rotation (--keep-memory 1), so its first two saves are the cold ones
    fresh = [(e["round"], e["step"]) for e in result["trace"] if e["what"] == "hp_save_end" and e["fresh_slot"]]
    assert fresh == [(r, s) for r in range(ROUNDS) for s in (1, 2)]
    # DCP: cold = the first save through a stager not used before; one new stager per round
    cold = [(e["round"], e["k"]) for e in result["trace"] if e["what"] == "dcp_async_done" and e["cold"]]
    assert cold == [(r, 0) for r in range(ROUNDS)]
    hp, dcp, total = result["hp_stall_s"], result["dcp_async_stall_s"], result["dcp_async_total_s"]
    assert hp["cold"]["n"] == 2 * ROUNDS and hp["warm"]["n"] == SAVES * ROUNDS
    assert dcp["cold"]["n"] == ROUNDS and dcp["warm"]["n"] == (SAVES + 1) * ROUNDS  # a new stager per round
    assert total["cold"]["n"] == ROUNDS and total["warm"]["n"] == (SAVES + 1) * ROUNDS
    for s in (hp["cold"], hp["warm"], dcp["cold"], dcp["warm"], total["cold"], total["warm"],
              result["floor_s"], result["dcp_sync_s"]):
        assert s["n"] >= 3 and s["min"] <= s["median"] <= s["max"] and len(s["values"]) == s["n"] and s["min"] > 0
    for kind in ("cold", "warm"):
        assert result["dcp_async_over_hp"][kind] == round(dcp[kind]["median"] / hp[kind]["median"], 3)
        assert total[kind]["median"] >= dcp[kind]["median"]
    assert result["stall_over_floor"] == round(hp["warm"]["median"] / result["floor_s"]["median"], 3)
    assert result["sync_over_stall"] == round(result["dcp_sync_s"]["median"] / hp["warm"]["median"], 3)
    assert result["dcp_async_stager"].startswith("DefaultStager(StagingOptions(")
    assert set(result["first_in_process_s"]) == {"hp", "dcp_async"}


def test_saves_never_overlap_and_hp_and_dcp_take_turns(result):
    trace = result["trace"]
    in_flight = 0
    for e in trace:  # one save of any kind at a time: DCP's future done, the daemon idle, before the next
        if e["what"] in ("hp_save_start", "hp_persist_start", "dcp_async_start", "dcp_sync_start"):
            assert in_flight == 0, e
            in_flight += 1
        elif e["what"] in ("daemon_idle", "dcp_async_done", "dcp_sync_done"):
            in_flight -= 1
    for r in range(ROUNDS):
        starts = [e["what"] for e in trace if e.get("round") == r and e["what"] in ("hp_save_start", "dcp_async_start")]
        pairs = [tuple(starts[i:i + 2]) for i in range(0, len(starts), 2)]
        assert all(set(p) == {"hp_save_start", "dcp_async_start"} for p in pairs), starts
        assert len(set(pairs)) == 2, starts  # which goes first alternates


def test_result_carries_definition_machine_load_and_baselines(result, run):
    assert result["benchmark"] == "ckpt" and result["definition_version"] == bench.DEFINITION_VERSION == 2
    assert result["machine"]["cores"] >= 1 and result["machine"]["torch"]
    assert len(result["load_avg"]["before"]) == 3 and len(result["load_avg"]["after"]) == 3
    assert result["completed"] is True and result["state_bytes"] > 0 and result["params"] > 0
    assert result["saves"] == SAVES and result["rounds"] == ROUNDS
    for key in ("persist_s", "persist_MBps", "persist_save_stall_s", "s3fs_raw_MBps", "s3fs_raw_s"):
        assert result[key]["n"] == ROUNDS and result[key]["median"] > 0, key
    assert {"floor", "hp_cold", "hp_warm", "dcp_cold", "dcp_warm"} <= set(result["definitions"])
    # the table for people, then the JSON as the last stdout line (as hp-chaos's benchmarks do)
    lines = run[1].strip().splitlines()
    table = "\n".join(lines[:-1])
    for text in ("definition 2", "daemon idle", "hp save stall, cold", "hp save stall, warm",
                 "DCP async_save blocks, cold", "DCP async_save blocks, warm", "DCP synchronous save"):
        assert text in table, text


def test_wait_idle_returns_only_once_checksummed_and_quiet(tmp_path):
    """The daemon's own view after :meth:`HpDaemon.wait_idle`: every file checksummed, no CPU used."""
    import time

    import torch

    d = bench.HpDaemon("idle", None, tmp_path)
    try:
        stall, fresh = d.save({"x": torch.ones(16 << 20)}, 1)  # 64 MB: the checksum takes a while
        assert fresh
        d.wait_idle(1)
        manifest = d.client.manifest(d.ns, 1)
        assert manifest["files"]["0"]["items"], manifest
        ticks = d.cpu_ticks()
        time.sleep(0.2)
        assert d.cpu_ticks() - ticks <= 1
    finally:
        d.stop()
    assert not d.shm.exists()


@pytest.mark.parametrize("argv,message", [
    (["bench", "ckpt", "--params", "10"], "--params must be a number >= 1000"),
    (["bench", "ckpt", "--params", "-1"], "--params must be a number >= 1000"),
    (["bench", "ckpt", "--params", "nan"], "--params must be a number >= 1000"),
    (["bench", "ckpt", "--saves", "0"], "--saves must be >= 1"),
    (["bench", "ckpt", "--rounds", "2"], "--rounds must be >= 3"),
    (["bench", "ckpt", "--saves", "x"], "invalid int value"),
])
def test_bad_input_is_one_line_exit_2(argv, message, capsys):
    """A bad flag is one line on stderr and exit 2, before anything starts."""
    from hp.core.cli import main

    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err

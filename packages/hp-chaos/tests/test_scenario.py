"""Scenario files: every key validated, a malformed file is one line naming the key (exit 2), and
each fault kind turns into the injection it documents."""

from __future__ import annotations

import signal
import subprocess

import pytest
from hp.chaos.faults import fault_kinds
from hp.chaos.faults.base import ScenarioError
from hp.chaos.faults.process import ResumeHung, SignalAt
from hp.chaos.scenario import load_scenario, parse_scenario
from hp.core.plugins import list_backends
from hp.testing import HP, replaced

GOOD = {
    "name": "kill-rank-in-allreduce",
    "job": {"nodes": 1, "nproc_per_node": 4, "spares": 1, "steps": 40, "model": "tiny", "seed": 0},
    "faults": [{"at_step": 12, "phase": "allreduce", "kind": "kill", "target": "rank:1"},
               {"at_step": 25, "kind": "hang", "target": "rank:2", "duration_s": 30}],
    "expect": {"completes": True, "bitwise_equal": True, "lost_steps": 0, "max_recovery_s": 2.0},
}


def with_(path: str, value) -> dict:
    """GOOD with the value at a dotted path replaced; ``...`` deletes it."""
    return replaced(GOOD, path, value)


def test_the_issue_example_parses_into_typed_faults():
    s = parse_scenario(GOOD)
    assert (s.name, s.job.nproc_per_node, s.job.spares, s.job.steps) == ("kill-rank-in-allreduce", 4, 1, 40)
    kill, hang = s.faults
    assert (kill.kind, kill.at_step, str(kill.target), kill.phase) == ("kill", 12, "rank:1", "allreduce")
    assert (hang.phase, hang.params) == ("forward", {"duration_s": 30.0})  # phase defaults to forward
    assert s.expect.max_recovery_s == 2.0 and s.expect.bitwise_equal is True and s.expect.min_goodput is None


@pytest.mark.parametrize("path, value, key", [
    ("name", "", "name"),
    ("job.nproc_per_node", 0, "job.nproc_per_node"),
    ("job.steps", "many", "job.steps"),
    ("job.gpus", 8, "job.gpus"),
    ("job.model", "huge", "job.model"),
    ("faults", [], "faults"),
    ("faults.0.kind", "meteor", "faults[0].kind"),
    ("faults.0.at_step", 40, "faults[0].at_step"),
    ("faults.0.at_step", ..., "faults[0].at_step"),
    ("faults.0.target", "rank:4", "faults[0].target"),
    ("faults.0.target", "gpu:1", "faults[0].target"),
    ("faults.0.target", ..., "faults[0].target"),
    ("faults.0.phase", "backprop", "faults[0].phase"),
    ("faults.1.duration_s", -1, "faults[1].duration_s"),
    ("faults.1.duration_s", "long", "faults[1].duration_s"),
    ("faults.1.colour", "red", "faults[1].colour"),
    ("faults.1", {"at_step": 3, "kind": "exception", "target": "spare:0"}, "faults[1].target"),
    ("faults.1", {"at_step": 3, "kind": "kill", "target": "spare:1"}, "faults[1].target"),
    ("faults.1", {"at_step": 3, "kind": "kill", "target": "controller", "phase": "commit"}, "faults[1].phase"),
    ("faults.1", {"at_step": 3, "kind": "slow", "target": "rank:0", "steps": 0}, "faults[1].steps"),
    ("faults.1", {"at_step": 3, "kind": "partition", "target": "node:0"}, "faults[1].kind"),
    ("faults.1", {"at_step": 3, "kind": "storage", "target": "storage"}, "faults[1].duration_s"),
    ("faults.1", {"at_step": 3, "kind": "storage", "target": "storage", "duration_s": 1, "mode": "x"},
     "faults[1].mode"),
    ("expect.lost_steps", -1, "expect.lost_steps"),
    ("expect.completes", "yes", "expect.completes"),
    ("expect.min_goodput", 1.5, "expect.min_goodput"),
    ("expect.recovers", 1, "expect.recovers"),
    ("job.checkpoint", 2, "job.checkpoint"),
    ("job.checkpoint", {"every": 0}, "job.checkpoint.every"),
    ("job.checkpoint", {"persist_every": "2"}, "job.checkpoint.persist_every"),
    ("job.checkpoint", {"evry": 2}, "job.checkpoint.evry"),
    ("expect.persisted_step", 10, "expect.persisted_step"),  # no job.checkpoint
    ("faults.1", {"at_step": 3, "kind": "storage", "target": "storage", "duration_s": 1}, "faults[1]"),
    # #13 finding 8: numbers that are not numbers, sizes that are typos, names that are paths
    ("job.timeout_s", float("nan"), "job.timeout_s"),
    ("job.heartbeat_timeout_s", float("inf"), "job.heartbeat_timeout_s"),
    ("expect.max_recovery_s", -1.0, "expect.max_recovery_s"),
    ("job.nproc_per_node", 100000, "job.nproc_per_node"),
    ("name", "../../etc", "name"),
    ("name", "a/b", "name"),
])
def test_a_malformed_scenario_names_the_key(path, value, key):
    with pytest.raises(ScenarioError) as e:
        parse_scenario(with_(path, value))
    assert e.value.key == key and str(e.value).startswith(f"{key}: ")


def test_a_checkpointing_job_and_its_persisted_step():
    raw = {**GOOD, "job": {**GOOD["job"], "checkpoint": {"every": 2, "persist_every": 4}},
           "faults": [{"at_step": 5, "kind": "storage", "target": "storage", "duration_s": 3}],
           "expect": {"persisted_step": 36}}
    s = parse_scenario(raw)
    assert (s.job.checkpoint.every, s.job.checkpoint.persist_every, s.expect.persisted_step) == (2, 4, 36)
    assert raw["job"]["checkpoint"] == {"every": 2, "persist_every": 4}  # the caller's mapping is left alone
    assert s.job.reference_key() != parse_scenario(GOOD).job.reference_key()
    for step in (38, 40):  # not a persisted step; past the end
        with pytest.raises(ScenarioError, match=r"^expect\.persisted_step: must be a step the job persists"):
            parse_scenario({**raw, "expect": {"persisted_step": step}})


def test_network_faults_validate_against_a_multi_node_job():
    raw = {**GOOD, "job": {**GOOD["job"], "nodes": 2}, "faults": [
        {"at_step": 5, "kind": "partition", "target": "node:1", "duration_s": 2, "mode": "reject"},
        {"at_step": 6, "kind": "loss", "target": "node:0", "probability": 0.05},
        {"at_step": 7, "kind": "node", "target": "node:1"}]}
    partition, loss, node = parse_scenario(raw).faults
    assert partition.params == {"duration_s": 2.0, "mode": "reject"}
    assert loss.params == {"probability": 0.05, "duration_s": None}
    with pytest.raises(ScenarioError, match=r"faults\[0\]\.probability"):
        parse_scenario({**raw, "faults": [{"at_step": 5, "kind": "loss", "target": "node:1", "probability": 1.5}]})
    with pytest.raises(ScenarioError, match=r"faults\[0\]\.target: node:2 does not exist"):
        parse_scenario({**raw, "faults": [{"at_step": 5, "kind": "node", "target": "node:2"}]})


def test_each_kind_injects_in_process_or_from_outside():
    kinds, shape = fault_kinds(), parse_scenario(GOOD).job.shape
    s = parse_scenario({**GOOD, "faults": [
        {"at_step": 2, "kind": "kill", "target": "rank:1", "phase": "commit"},
        {"at_step": 3, "kind": "hang", "target": "rank:2", "duration_s": 1.5},
        {"at_step": 4, "kind": "slow", "target": "rank:3", "delay_s": 0.1, "steps": 2, "phase": "backward"},
        {"at_step": 5, "kind": "kill", "target": "spare:0"},
        {"at_step": 6, "kind": "hang", "target": "controller", "duration_s": 2},
        {"at_step": 7, "kind": "exception", "target": "rank:0", "phase": "optimizer"}]})
    got = [kinds[f.kind].inject(f, shape) for f in s.faults]
    assert got[0].hp_faults == [{"at_step": 2, "phase": "commit", "kind": "kill", "rank": 1}] and not got[0].actions
    assert got[1].hp_faults[0]["kind"] == "hang" and isinstance(got[1].actions[0], ResumeHung)
    assert got[1].actions[0].duration_s == 1.5
    assert got[2].hp_faults == [{"at_step": 4, "phase": "backward", "kind": "slow", "rank": 3,
                                 "delay_s": 0.1, "steps": 2}]
    spare, controller = got[3].actions[0], got[4].actions[0]
    assert isinstance(spare, SignalAt) and spare.sig == signal.SIGKILL and not got[3].hp_faults
    assert controller.sig == signal.SIGSTOP and controller.resume and controller.duration_s == 2.0
    assert got[5].hp_faults == [{"at_step": 7, "phase": "optimizer", "kind": "exception", "rank": 0}]


def test_hp_backends_lists_the_fault_family():
    faults = {b.name: b.dist for b in list_backends() if b.family == "fault"}
    assert faults == dict.fromkeys(["exception", "hang", "join", "kill", "loss", "node", "partition", "preempt", "slow",
                                    "storage", "store"], "hp-chaos")
    out = subprocess.run([*HP, "backends"], capture_output=True, text=True, check=True).stdout
    assert any(line.split()[:3] == ["fault", "partition", "hp-chaos"] for line in out.splitlines())


MALFORMED = [
    ("name: x\njob: {steps: 1}\nfaults: [{at_step: 0, kind: kill, target: 'rank:1'}]\n", "job.steps"),
    ("name: x\nfaults: [{at_step: 3, kind: hang, target: 'rank:1', duration_s: 0}]\n", "faults[0].duration_s"),
    ("name: [unclosed\n", "(file)"),
    ("- just\n- a list\n", "(top level)"),
]


def test_a_file_that_is_not_utf8_is_one_scenario_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"name: x\njob: {steps: \xff\xfe}\n")
    with pytest.raises(ScenarioError, match="not UTF-8"):
        load_scenario(path)


@pytest.mark.parametrize("content, key", MALFORMED)
def test_a_malformed_file_names_the_key(tmp_path, content, key):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(ScenarioError) as e:
        load_scenario(path)
    assert e.value.key == key


@pytest.mark.parametrize("content, key", MALFORMED[1:3])
def test_hp_chaos_run_rejects_a_malformed_file_in_one_line_with_exit_2(tmp_path, content, key):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    out = subprocess.run([*HP, "chaos", "run", str(path), "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and f"{key}: " in out.stderr and out.stderr.startswith("hp: error: scenario ")


def test_hp_chaos_faults_documents_every_kind():
    out = subprocess.run([*HP, "chaos", "faults", "--json"], capture_output=True, text=True, check=True).stdout
    rows = {r["kind"]: r for r in __import__("json").loads(out)}
    assert set(rows) == {"exception", "hang", "join", "kill", "loss", "node", "partition", "preempt", "slow", "storage",
                         "store"}
    assert all(r["doc"] for r in rows.values())
    assert rows["kill"]["targets"] == ["rank", "spare", "controller"] and rows["kill"]["phase"] is True
    assert rows["storage"]["params"] == ["duration_s", "mode"]

"""Scenarios on the etcd store (``job.store: etcd``): the plumbing that does not need an HA controller.

The spec (``job.store``, ``expect.max_failover_s``), the ``store`` fault (refused on a tcp job; on a
real etcd, a pause that ends), the nodes' decision logs merged by time and the leader they name
(the ``controller`` target, the job's outcome), failover in the verdict, and the runner's private
etcd: reachable from every node namespace with the flags each agent gets, stopped however the run
ends. The etcd scenarios themselves (integration/scenarios/*etcd*.yaml, store-paused.yaml) need the
HA controller and run in integration/test_scenarios.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import urllib.request

import pytest
from hp.chaos import launch
from hp.chaos.faults import fault_kinds
from hp.chaos.faults.base import ScenarioError
from hp.chaos.faults.store import PauseAt, StorePause
from hp.chaos.launch import JobRun, Live, leader_node, node_command, read_decisions
from hp.chaos.runner import evaluate, failover, run_scenario
from hp.chaos.scenario import parse_scenario
from hp.checkpointless.demo.run import RunResult
from hp.core.errors import BackendUnavailableError
from hp.core.protocol import Decision, Event
from hp.testing import HP, replaced

ETCD = {"name": "etcd-job", "job": {"nodes": 2, "nproc_per_node": 1, "spares": 1, "steps": 12, "store": "etcd"},
        "faults": [{"at_step": 6, "kind": "kill", "target": "controller"}],
        "expect": {"completes": True, "max_failover_s": 30.0}}


def with_(path: str, value) -> dict:
    return replaced(ETCD, path, value)


def etcd_job(*faults: dict) -> dict:
    """ETCD with these faults and no expectation."""
    return {**ETCD, "faults": list(faults), "expect": {}}


PAUSE = {"at_step": 5, "kind": "store", "target": "store", "duration_s": 3}


def etcd_server():
    from hp.core.etcd_store import EtcdServer, etcd_binary

    try:
        etcd_binary()
    except BackendUnavailableError as e:
        pytest.skip(str(e))
    return EtcdServer


def answers(endpoint: str, timeout: float = 1.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://{endpoint}/v2/keys/", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


# ---- the spec --------------------------------------------------------------------------------------

def test_the_store_defaults_to_tcp_and_etcd_parses_with_its_failover_expectation():
    s = parse_scenario(ETCD)
    assert (s.job.store, s.job.shape.store, s.expect.max_failover_s) == ("etcd", "etcd", 30.0)
    tcp = parse_scenario(replaced(etcd_job(*ETCD["faults"]), "job.store", ...))
    assert tcp.job.store == "tcp" and tcp.job.shape.store == "tcp"
    assert s.job.reference_key() == tcp.job.reference_key()  # the losses do not depend on the store
    pause = parse_scenario(etcd_job(PAUSE))
    assert (pause.faults[0].kind, str(pause.faults[0].target), pause.faults[0].params) == \
        ("store", "store", {"duration_s": 3.0})


@pytest.mark.parametrize("path, value, key, message", [
    ("job.store", "zookeeper", "job.store", "must be one of ['tcp', 'etcd']"),
    ("job.store", 1, "job.store", "must be str"),
    ("job.controller", "standalone", "job.store", "cannot be combined with job.controller: standalone"),
    ("job.store", "tcp", "expect.max_failover_s", "needs job.store: etcd"),
    ("expect.max_failover_s", 0, "expect.max_failover_s", "must be > 0"),
    ("faults", [{"at_step": 6, "kind": "kill", "target": "rank:1"}], "expect.max_failover_s",
     "needs a fault on target controller"),
    ("faults", [{"at_step": 5, "kind": "store", "target": "store"}], "faults[0].duration_s", "required"),
    ("faults", [{"at_step": 5, "kind": "store", "target": "store", "duration_s": -1}], "faults[0].duration_s",
     "must be > 0"),
    ("faults", [{"at_step": 5, "kind": "store", "target": "rank:0", "duration_s": 1}], "faults[0].target",
     "a store fault targets store"),
    ("faults", [{"at_step": 5, "kind": "store", "target": "store:1", "duration_s": 1}], "faults[0].target",
     "'store' takes no index"),
    ("faults", [{"at_step": 5, "kind": "kill", "target": "store"}], "faults[0].target",
     "a kill fault targets rank or spare or controller"),
])
def test_a_malformed_etcd_scenario_names_the_key(path, value, key, message):
    with pytest.raises(ScenarioError) as e:
        parse_scenario(with_(path, value))
    assert e.value.key == key and str(e.value).startswith(f"{key}: ") and message in str(e.value)
    assert "\n" not in str(e.value)


def test_a_store_fault_on_a_tcp_job_is_refused_in_one_line(tmp_path):
    raw = {"name": "x", "job": {"nodes": 1, "steps": 12},
           "faults": [{"at_step": 5, "kind": "store", "target": "store", "duration_s": 3}]}
    with pytest.raises(ScenarioError, match=r"^faults\[0\]\.kind: a store fault pauses the job's etcd: it needs "
                                            r"job.store: etcd, got 'tcp'$"):
        parse_scenario(raw)
    path = tmp_path / "store-on-tcp.yaml"
    path.write_text(json.dumps(raw))  # JSON is YAML too
    out = subprocess.run([*HP, "chaos", "run", str(path), "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("hp: error: scenario ")
    assert "faults[0].kind: a store fault pauses the job's etcd: it needs job.store: etcd" in out.stderr
    # a Scenario built in code (not parsed) is refused by the runner before anything starts
    scenario = parse_scenario(etcd_job(PAUSE))
    scenario = dataclasses.replace(scenario, job=dataclasses.replace(scenario.job, store="tcp"))
    with pytest.raises(ValueError, match="a store fault pauses the job's etcd: it needs job.store: etcd"):
        run_scenario(scenario, log_dir=str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()


def test_the_store_kind_is_discovered_and_documented():
    kind = fault_kinds()["store"]
    assert kind.targets == ("store",) and kind.event_trigger and list(kind.params) == ["duration_s"]
    out = subprocess.run([*HP, "chaos", "faults", "--json"], capture_output=True, text=True, check=True).stdout
    rows = {r["kind"]: r for r in json.loads(out)}
    assert rows["store"]["targets"] == ["store"] and "etcd" in rows["store"]["doc"]


# ---- the agents' flags ---------------------------------------------------------------------------

def test_every_agent_gets_the_etcd_endpoint_and_one_run_id_instead_of_a_controller():
    from hp.chaos.launch import demo_config

    s = parse_scenario(ETCD)
    argvs = [node_command(s.job, demo_config(s.job), f"/logs/node{i}", i, "10.1.2.254:2379", run_id="chaos-ab12")
             for i in range(2)]
    for i, argv in enumerate(argvs):
        flags = argv[argv.index("run") + 1:]  # hp run's flags, then the training module's
        assert flags[flags.index("--store") + 1] == "etcd" and flags[flags.index("--run-id") + 1] == "chaos-ab12"
        assert flags[flags.index("--rdzv-endpoint") + 1] == "10.1.2.254:2379"
        assert flags[flags.index("--node-rank") + 1] == str(i) and flags[flags.index("--nnodes") + 1] == "2"
    tcp = parse_scenario(replaced(etcd_job(*ETCD["faults"]), "job.store", "tcp")).job
    assert "--store" not in node_command(tcp, demo_config(tcp), "/logs/node0", 0, "10.1.2.1:2000")
    with pytest.raises(ValueError, match="needs the etcd endpoint and a run id"):
        node_command(s.job, demo_config(s.job), "/logs/node0", 0, "10.1.2.254:2379")


# ---- decisions: merged over the nodes, the leader they name -----------------------------------

def write_decisions(directory, *decisions: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / launch.DECISIONS_FILE, "a") as f:
        f.writelines(json.dumps(d) + "\n" for d in decisions)


def elected(t: float, node: int, epoch: int) -> dict:
    return {"decision": Decision.CONTROLLER_ELECTED, "t": t, "epoch": epoch, "node_rank": node}


def test_the_nodes_decision_logs_merge_by_time_and_name_the_leader(tmp_path):
    write_decisions(tmp_path / "node0", elected(1.0, 0, 1), {"decision": "new_generation", "t": 2.0},
                    {"decision": "promote_spare", "t": 4.0})
    write_decisions(tmp_path / "node1", elected(5.0, 1, 2), {"decision": "node_lost", "t": 11.0, "node": 0})
    with open(tmp_path / "node0" / launch.DECISIONS_FILE, "a") as f:
        f.write('{"decision": "promote_sp')  # its agent was SIGKILLed while writing this line
    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1"), str(tmp_path / "node2")]  # node 2 logged nothing
    merged = read_decisions(dirs)
    assert [d["t"] for d in merged] == [1.0, 2.0, 4.0, 5.0, 11.0]
    assert leader_node(merged) == 1 and leader_node(merged[:3]) == 0 and leader_node([]) == 0
    assert leader_node([elected(1.0, 1, 1) | {"node_rank": "1"}]) == 1  # a number as text counts too
    assert leader_node([elected(1.0, 1, 1), elected(2.0, 0, 2) | {"node_rank": None}]) == 1  # not a node: ignored


class Agent:
    """A Popen stand-in: a pid, and a returncode once it ended."""

    def __init__(self, pid: int, returncode: int | None = None) -> None:
        self.pid, self.returncode = pid, returncode

    def poll(self) -> int | None:
        return self.returncode


def live(tmp_path, agents: list[Agent], etcd: object | None) -> Live:
    dirs = [str(tmp_path / f"node{i}") for i in range(len(agents))]
    return Live(agents, launch._Tail([os.path.join(d, "events") for d in dirs]), None, etcd=etcd,
                decision_log=launch._DecisionTail(dirs) if etcd is not None else None)


def test_the_controller_target_is_the_leading_agent_and_the_outcome_is_the_last_leaders(tmp_path):
    node0, node1 = Agent(100), Agent(200)
    job = live(tmp_path, [node0, node1], etcd=object())
    job.update()
    assert (job.leader(), job.controller_pid()) == (0, 100)  # before any election: node 0
    write_decisions(tmp_path / "node1", elected(1.0, 1, 1))  # node 1 won the first election
    job.update()
    assert (job.leader(), job.controller_pid()) == (1, 200)
    node1.returncode = -9  # killed: no controller until the next election
    assert job.controller_pid() is None
    write_decisions(tmp_path / "node0", elected(3.0, 0, 2))
    job.update()
    assert (job.leader(), job.controller_pid()) == (0, 100)
    node0.returncode = 0
    assert job.outcome_agent() is node0
    # the tcp store: node 0's agent, whatever a decision log says
    tcp = live(tmp_path, [Agent(300, 0), Agent(400, 0)], etcd=None)
    tcp.update()
    assert (tcp.controller_pid(), tcp.outcome_agent().pid, tcp.decisions()) == (300, 300, [])


# ---- failover in the verdict ---------------------------------------------------------------------

def commit(t: float, step: int, generation: int = 1) -> dict:
    return {"t": t, "event": "commit", "rank": 0, "step": step, "generation": generation,
            "loss": (5.0 - step / 10).hex()}


FINAL = {"event": "final_state", "rank": 0, "step": 11, "digests": {"params": "p"}}


def etcd_run(decisions: list[dict]) -> tuple[RunResult, JobRun]:
    reference = RunResult(0, 12.0, [commit(float(s), s) for s in range(12)] + [{**FINAL, "t": 12.0}], "")
    ev = [commit(float(s), s) for s in range(6)]
    ev.append({"t": 5.5, "event": Event.FAULT_INJECTED, "kind": "kill", "phase": None, "step": 6, "rank": None,
               "target": "controller", "fault": 0, "pid": 1, "signal": "SIGKILL"})
    ev += [commit(float(s) + 4.0, s, 2) for s in range(6, 12)] + [{**FINAL, "t": 16.0}]
    return reference, JobRun(RunResult(0, 17.0, ev, ""), False, 0, [], [-9, 0], [1, 2], decisions, "etcd")


def test_failover_is_the_fault_to_the_next_election_and_max_failover_s_checks_it():
    assert failover([elected(1.0, 0, 1), elected(9.0, 1, 2)], 5.5) == 3.5
    assert failover([elected(1.0, 0, 1)], 5.5) is None and failover([elected(9.0, 1, 2)], None) is None
    scenario = parse_scenario({**ETCD, "expect": {"completes": True, "bitwise_equal": True, "lost_steps": 0,
                                                  "max_failover_s": 5.0}})
    r = evaluate(scenario, *etcd_run([elected(1.0, 0, 1), {"decision": "new_generation", "t": 2.0},
                                      elected(8.75, 1, 2)]))
    assert r["passed"], r["failures"]
    assert r["failover_s"] == [3.25] and r["faults"][0]["failover_s"] == 3.25
    assert r["controller_elections"] == [{"t": 1.0, "epoch": 1, "node_rank": 0}, {"t": 8.75, "epoch": 2, "node_rank": 1}]
    slow = evaluate(scenario, *etcd_run([elected(1.0, 0, 1), elected(12.0, 1, 2)]))
    assert slow["failures"] == ["max_failover_s: faults[0] (kill of controller at step 6) expected <= 5.0 s, "
                                "got 6.500 s"]
    never = evaluate(scenario, *etcd_run([elected(1.0, 0, 1)]))
    assert never["failover_s"] == [None] and never["failures"] == [
        "max_failover_s: faults[0] (kill of controller at step 6) expected <= 5.0 s, got no controller_elected "
        "decision after it"]
    from hp.chaos.report import format_table

    assert "recovery 4.500 s, failover 3.250 s" in format_table(r)  # 5.5 -> step 6's commit at 10.0


# ---- the store fault on a real etcd ------------------------------------------------------------

class Job:
    """The part of a running job PauseAt sees."""

    def __init__(self, etcd) -> None:
        self.etcd, self.recorded = etcd, []

    def committed(self) -> int:
        return 4

    def record(self, event: str, **fields) -> None:
        self.recorded.append((event, fields))


def thread_states(pid: int) -> set[str]:
    states = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            states.add(f.read().rsplit(")", 1)[1].split()[0])
    return states


def test_the_store_fault_pauses_a_real_etcd_for_its_duration_then_resumes_it():
    server_cls = etcd_server()
    spec = parse_scenario(etcd_job({**PAUSE, "duration_s": 2})).faults[0]
    (action,) = fault_kinds()["store"].inject(spec, parse_scenario(ETCD).job.shape).actions
    assert isinstance(action, PauseAt) and action.duration_s == 2.0
    with server_cls() as server:
        assert answers(server.endpoint)
        assert not action.ready(Job(None))  # no etcd (yet): the fault waits
        job = Job(server)
        assert action.ready(job)
        undo = action.fire(job)
        assert thread_states(server.proc.pid) <= {"T", "t"}  # every thread stopped when fire returns
        assert not answers(server.endpoint, timeout=0.5)
        assert job.recorded[0][0] == Event.FAULT_INJECTED and job.recorded[0][1]["fault"] == 0
        assert job.recorded[0][1]["pid"] == server.proc.pid
        undo()
        assert answers(server.endpoint, timeout=5.0)
        assert job.recorded[-1] == (Event.FAULT_RESUMED, {"fault": 0})
        undo()  # the runner's end-of-run undo after the timed one: harmless
        assert answers(server.endpoint)
        with StorePause(server):  # a context manager too
            assert not answers(server.endpoint, timeout=0.3)
        assert answers(server.endpoint, timeout=5.0)
    # ending a pause after etcd is gone is no error (a run that ends while etcd is paused)
    with server_cls() as server:
        pause = StorePause(server)
        pause.start()
    pause.end()


# ---- the runner's private etcd ---------------------------------------------------------------

CHECK = """
import json, sys, urllib.request
flags = dict(zip(sys.argv[1::2], sys.argv[2::2]))
endpoint = flags["--rdzv-endpoint"]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
with opener.open(f"http://{endpoint}/v2/keys/", timeout=10) as r:
    print("AGENT " + json.dumps({"store": flags.get("--store"), "run_id": flags.get("--run-id"),
                                 "endpoint": endpoint, "node": flags.get("--node-rank"), "status": r.status}),
          flush=True)
"""


@pytest.fixture
def probe_agents(monkeypatch):
    """Agents that only check that the etcd they were given answers; the servers the runner started."""
    started = []
    real_start, real_node_command = launch._start_etcd, launch.node_command

    def start_etcd(stack, host, log_dir):
        started.append(real_start(stack, host, log_dir))
        return started[-1]

    def node_command(job, cfg, log_dir, node, endpoint, policy=None, run_id=None):
        argv = real_node_command(job, cfg, log_dir, node, endpoint, policy, run_id)
        flags = argv[argv.index("run") + 1:]  # hp run's flags, then the training module's
        # keep the flags that take a value, pairwise, for the probe's dict
        keep = [x for i, f in enumerate(flags) if f in ("--store", "--run-id", "--rdzv-endpoint", "--node-rank")
                for x in (f, flags[i + 1])]
        return [sys.executable, "-c", CHECK, *keep]

    monkeypatch.setattr(launch, "_start_etcd", start_etcd)
    monkeypatch.setattr(launch, "node_command", node_command)
    return started


def agents_seen(log_dir) -> list[dict]:
    with open(os.path.join(log_dir, "job.out")) as f:
        return [json.loads(line[6:]) for line in f if line.startswith("AGENT ")]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.parametrize("nodes", [1, pytest.param(2, marks=pytest.mark.skipif(
    os.geteuid() != 0, reason="network namespaces need root"))])
def test_the_runner_starts_an_etcd_every_node_reaches_and_stops_it(tmp_path, probe_agents, nodes):
    etcd_server()
    job = parse_scenario(with_("job.nodes", nodes)).job
    run = launch.run_job(job, str(tmp_path), [])
    (server,) = probe_agents
    seen = agents_seen(tmp_path)
    assert run.result.returncode == 0 and run.agent_returncodes == [0] * nodes and run.store == "etcd"
    assert sorted(a["node"] for a in seen if a["node"] is not None) == ([] if nodes == 1 else ["0", "1"])
    assert len(seen) == nodes and {a["endpoint"] for a in seen} == {server.endpoint}
    assert all(a["status"] == 200 and a["store"] == "etcd" for a in seen)
    assert len({a["run_id"] for a in seen}) == 1 and seen[0]["run_id"].startswith("chaos-")
    # loopback for one node; else the host's address on the namespaces' bridge (outside every node)
    assert server.host == "127.0.0.1" if nodes == 1 else server.host.endswith(".254")
    assert gone(server.proc.pid) and not server.dir.exists()
    assert os.path.exists(tmp_path / "etcd.log")  # kept for the post-mortem
    assert run.decisions == []


def test_the_runner_stops_its_etcd_when_the_run_fails(tmp_path, probe_agents, monkeypatch):
    etcd_server()

    def boom(live, actions, deadline):
        raise RuntimeError("the watch loop broke")

    monkeypatch.setattr(launch, "_watch", boom)
    with pytest.raises(RuntimeError, match="the watch loop broke"):
        launch.run_job(parse_scenario(with_("job.nodes", 1)).job, str(tmp_path), [])
    (server,) = probe_agents
    assert gone(server.proc.pid) and not server.dir.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_the_host_address_serves_every_node_and_a_partition_leaves_it_alone():
    from hp.chaos.topology import Topology

    server_cls = etcd_server()
    probe = ("import sys, urllib.request\n"
             "o = urllib.request.build_opener(urllib.request.ProxyHandler({}))\n"
             "try:\n    print(o.open(f'http://{sys.argv[1]}/v2/keys/', timeout=2).status)\n"
             "except OSError as e:\n    print(type(e).__name__)\n")
    with Topology(2) as topo:
        host = topo.host_address()
        assert host == f"{topo.subnet}.254" and topo.host_address() == host  # added once
        with server_cls(host) as server:
            topo.partition(0, 1)
            for node in (0, 1):
                p = topo.run_in(node, [sys.executable, "-c", probe, server.endpoint], stdout=subprocess.PIPE,
                                text=True)
                assert p.communicate(timeout=30)[0].strip() == "200"
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    assert f" {host}/" not in out  # gone with the bridge

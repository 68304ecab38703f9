"""hp.core.schedulers.k8s.watch.JobWatch replayed on recorded watch-event streams (tests/data/k8s_watch/*.jsonl).

The streams are hand-built in the API's wire format (no API server runs here: see the directory's README);
each event's object is schema-validated before it is replayed, so a fixture the API could not have sent fails
the test instead of teaching the fold something false."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import kubernetes_validate
import pytest

from hp.core.schedulers.k8s import schemas
from hp.core.schedulers.k8s.watch import JobWatch, Phase, WatchEventError
from hp.core.scaling import CAPACITY, FAILURE, PREEMPTION

DATA = Path(__file__).parent / "data" / "k8s_watch"
STREAMS = sorted(p.name for p in DATA.glob("*.jsonl"))
K8S_VERSION = "1.36.0"


def _load(name: str) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]
    return lines[0]["header"], lines[1:]


def _replay(header: dict, records: list[dict]) -> tuple[JobWatch, list[list], dict[str, str]]:
    now = [0.0]
    watch = JobWatch("demo", nproc_per_node=1, not_ready_grace_s=header.get("not_ready_grace_s", 0.0),
                     clock=lambda: now[0])
    got, phases = [], {}
    for i, record in enumerate(records, 1):
        now[0] = record["t"]
        got += [[d.event.kind, d.event.count] for d in watch.feed(record["event"])]
        phases[str(i)] = watch.phase.value
    return watch, got, phases


def test_there_are_the_five_streams():
    assert STREAMS == ["capacity_returning.jsonl", "disruption_target_preemption.jsonl", "kueue_admission.jsonl",
                       "kueue_eviction.jsonl", "node_not_ready.jsonl"]


@pytest.mark.parametrize("name", STREAMS)
def test_every_recorded_object_validates(name):
    _, records = _load(name)
    for record in records:
        event = record["event"]
        assert event["type"] in ("ADDED", "MODIFIED", "DELETED")
        obj = event["object"]
        if obj["kind"] == "Workload":
            schemas.validate(obj)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", STREAMS)
def test_decisions_on_the_recorded_stream(name):
    header, records = _load(name)
    watch, got, phases = _replay(header, records)
    assert got == header["expect"]
    for i, phase in header.get("phases", {}).items():
        assert phases[i] == phase, (i, phases)
    cap = watch.capacity()
    final = header["final"]
    assert (cap.hosts, cap.preemption_requested, watch.phase.value) == (final["hosts"], final["preemption_requested"],
                                                                         final["phase"])
    assert cap.replicas == cap.hosts * cap.slots_per_host


def test_decisions_carry_the_reason_and_the_capacity_then():
    header, records = _load("disruption_target_preemption.jsonl")
    watch, _, _ = _replay(header, records)
    preemption = next(d for d in watch.decisions if d.event.kind == PREEMPTION)
    assert "PreemptionByScheduler" in preemption.reason and preemption.at == 30
    assert preemption.capacity.hosts == 2 and preemption.capacity.preemption_requested  # the pod is leaving


def test_without_the_disruption_condition_the_same_loss_is_a_failure():
    """The fold reads the condition: strip it from the stream and the decision changes."""
    header, records = _load("disruption_target_preemption.jsonl")
    for record in records:
        status = record["event"]["object"].get("status", {})
        status["conditions"] = [c for c in status.get("conditions", []) if c["type"] != "DisruptionTarget"]
    _, got, _ = _replay(header, records)
    assert got[-1] == [FAILURE, 1] and [PREEMPTION, 1] not in got


def _node_not_ready() -> tuple[list[dict], list[float], JobWatch]:
    """The node_not_ready stream fed to a watch with a 30 s grace, on a clock the test moves on."""
    _, records = _load("node_not_ready.jsonl")
    now = [0.0]
    watch = JobWatch("demo", not_ready_grace_s=30.0, clock=lambda: now[0])
    for record in records:
        now[0] = record["t"]
        watch.feed(record["event"])
    return records, now, watch


def test_a_node_not_ready_within_the_grace_is_not_yet_a_failure():
    records, now, watch = _node_not_ready()
    assert [d.event.kind for d in watch.decisions] == [CAPACITY, CAPACITY]  # 10 s of a 30 s grace
    assert watch.capacity().hosts == 1  # but the pod there no longer counts as capacity
    now[0] = 90.0
    assert [(d.event.kind, d.event.count) for d in watch.tick()] == [(FAILURE, 1)]
    assert watch.tick() == []  # counted once


def test_a_node_back_to_ready_within_the_grace_costs_nothing():
    records, now, watch = _node_not_ready()
    back = copy.deepcopy(records[4]["event"])  # node-b, Ready Unknown -> True
    back["object"]["status"]["conditions"][0].update(status="True", reason="KubeletReady")
    assert back["object"]["metadata"]["name"] == "node-b"
    now[0] = 75.0
    assert [d.event.kind for d in watch.feed(back)] == [CAPACITY]  # its pod counts again
    now[0] = 200.0
    assert [d.event.kind for d in watch.tick()] == []
    assert watch.capacity().hosts == 2


def test_other_jobs_pods_and_workloads_are_ignored():
    header, records = _load("kueue_eviction.jsonl")
    for record in records:
        obj = record["event"]["object"]
        if obj["kind"] == "Pod":
            obj["metadata"]["labels"]["hp.dev/job"] = "other"
        if obj["kind"] == "Workload":
            obj["metadata"]["ownerReferences"][0]["name"] = "other"
    watch, got, _ = _replay(header, records)
    assert got == [] and watch.capacity().hosts == 0 and watch.phase is Phase.PENDING


def test_an_expired_watch_goes_stale_until_reset():
    watch = JobWatch("demo")
    assert watch.feed({"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}) == []
    assert watch.phase is Phase.STALE
    watch.reset()
    assert watch.phase is Phase.PENDING


@pytest.mark.parametrize("event", [None, {}, {"type": "ADDED"}, {"type": "CHANGED", "object": {}},
                                   {"type": "ADDED", "object": {"kind": "Deployment"}}])
def test_malformed_events_are_refused(event):
    with pytest.raises(WatchEventError):
        JobWatch("demo").feed(event)


def test_failure_decisions_name_the_pods_node_rank_and_uid():
    """What hp k8s watch reports to the controller: the node rank the pod's wrapper runs as (its group's
    HP_RANK_OFFSET plus its completion index) and its uid (the node's incarnation)."""
    records, now, watch = _node_not_ready()
    now[0] = 90.0
    (failure,) = watch.tick()
    (pod,) = failure.pods
    lost = next(r["event"]["object"] for r in records if r["event"]["object"]["metadata"].get("uid") == pod.uid)
    assert lost["spec"]["nodeName"] == "node-b" and pod.name == lost["metadata"]["name"]
    assert pod.node_rank == int(lost["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"])


@pytest.mark.parametrize("change, rank", [
    (lambda p: None, 3),
    (lambda p: p["metadata"]["annotations"].update({"batch.kubernetes.io/job-completion-index": "x"}), None),
    (lambda p: p["metadata"].pop("annotations"), None),
    (lambda p: p["spec"]["containers"][0].update(env=[]), None),
    (lambda p: p["metadata"].update(annotations={"volcano.sh/task-index": "1"}), 3),
])
def test_a_pods_node_rank_comes_from_the_pod_alone(change, rank):
    from hp.core.schedulers.k8s.watch import node_rank

    pod = {"metadata": {"annotations": {"batch.kubernetes.io/job-completion-index": "1"}},
           "spec": {"containers": [{"name": "hp", "env": [{"name": "HP_RANK_OFFSET", "value": "2"}]}]}}
    change(pod)
    assert node_rank(pod) == rank


def test_reactions_report_failures_and_retry_what_could_not_be_told():
    from hp.core.schedulers.k8s.operator import Reactions
    from hp.core.schedulers.k8s.watch import Decision, PodRef
    from hp.core.scaling import ScaleEvent
    from hp.core.schedulers.api import Capacity

    answers, calls, said = [False, True, True], [], []

    def report(items):
        calls.extend((node, uid) for node, _, uid in items)
        return [] if answers.pop(0) else list(items)

    cap = Capacity(hosts=1, slots_per_host=1)
    reactions = Reactions(report, log=said.append)
    reactions.act([Decision(0, ScaleEvent(PREEMPTION, 1), "pod a: PreemptionByScheduler", cap, (PodRef("a", "ua", 0),)),
                   Decision(0, ScaleEvent(FAILURE, 2), "node n NotReady", cap,
                            (PodRef("b", "ub", 1), PodRef("c", "uc", None)))])
    assert calls == [(1, "ub")]  # a preemption is its pod's SIGTERM to act on; rank None: the heartbeat's
    assert reactions.pending == [(1, "node n NotReady (pod b)", "ub")]
    assert any("names no node rank" in m for m in said) and any(m.startswith("preemption 1") for m in said)
    reactions.act([])
    assert calls == [(1, "ub"), (1, "ub")] and reactions.pending == [] and len(reactions.told) == 1

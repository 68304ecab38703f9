"""Writes the hand-built watch streams of this directory (run by hand: python make_streams.py). Not a capture
from a cluster: see README.md."""
import json
from pathlib import Path

OUT = Path(__file__).parent
NS = "default"
T0 = "2026-08-24T10:00:00Z"

def ts(s): return f"2026-08-24T10:{s // 60:02d}:{s % 60:02d}Z"

def pod(name, uid, group, node, phase="Pending", ready=False, extra=(), js="demo", idx=0, offset=0):
    conds = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": T0}] if node else []
    if phase == "Running":
        conds += [{"type": "Initialized", "status": "True", "lastTransitionTime": T0},
                  {"type": "ContainersReady", "status": "True" if ready else "False", "lastTransitionTime": T0},
                  {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": T0}]
    conds += list(extra)
    o = {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": name, "namespace": NS, "uid": uid, "resourceVersion": "1",
                      "labels": {"hp.dev/job": "demo", "hp.dev/role": "worker", "hp.dev/group": group,
                                 "jobset.sigs.k8s.io/jobset-name": js, "jobset.sigs.k8s.io/replicatedjob-name": group,
                                 "jobset.sigs.k8s.io/job-index": "0", "batch.kubernetes.io/job-completion-index": str(idx)},
                      "annotations": {"batch.kubernetes.io/job-completion-index": str(idx),
                                      "jobset.sigs.k8s.io/job-index": "0"}},
         "spec": {"restartPolicy": "Never", "priorityClassName": "hp-base" if group == "base" else "hp-elastic",
                  "containers": [{"name": "hp", "image": "hp:0.1.0", "command": ["/bin/sh", "-c", "..."],
                                  "env": [{"name": "HP_RANK_OFFSET", "value": str(offset)}]}]},
         "status": {"phase": phase, "conditions": conds}}
    if node:
        o["spec"]["nodeName"] = node
    if phase == "Running":
        o["status"]["podIP"] = "10.0.0.%d" % (sum(name.encode()) % 200 + 2)
        o["status"]["startTime"] = T0
    return o

def node(name, ready="True"):
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "uid": "node-" + name, "resourceVersion": "1",
            "labels": {"kubernetes.io/hostname": name}},
            "status": {"allocatable": {"cpu": "96", "memory": "1024Gi", "nvidia.com/gpu": "8"},
                       "conditions": [{"type": "Ready", "status": ready,
                                       "reason": "KubeletReady" if ready == "True" else "NodeStatusUnknown",
                                       "message": "kubelet is posting ready status" if ready == "True" else "Kubelet stopped posting node status.",
                                       "lastHeartbeatTime": T0, "lastTransitionTime": T0}]}}

def cond(t, status, reason, message, at=T0):
    return {"type": t, "status": status, "reason": reason, "message": message, "lastTransitionTime": at}

def workload(name, owner, count, conds):
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {"name": name, "namespace": NS, "uid": "wl-" + name, "resourceVersion": "1",
                         "labels": {"kueue.x-k8s.io/job-uid": "js-" + owner},
                         "ownerReferences": [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": owner,
                                              "uid": "js-" + owner, "controller": True, "blockOwnerDeletion": True}]},
            "spec": {"queueName": "team-a", "podSets": [{"name": "elastic" if owner.endswith("-elastic") else "base", "count": count,
                     "template": {"metadata": {"labels": {"hp.dev/job": "demo"}},
                                  "spec": {"restartPolicy": "Never", "containers": [{"name": "hp", "image": "hp:0.1.0"}]}}}]},
            "status": {"conditions": conds}}

def disruption(reason, msg):
    return {"type": "DisruptionTarget", "status": "True", "reason": reason, "message": msg, "lastTransitionTime": ts(30)}

def write(fname, header, events):
    with open(OUT / fname, "w") as f:
        f.write(json.dumps({"header": header}) + "\n")
        for t, typ, obj in events:
            f.write(json.dumps({"t": t, "event": {"type": typ, "object": obj}}, sort_keys=True) + "\n")

HAND = "Hand-built in the Kubernetes API's watch wire format ({type, object}); no API server runs here."

# 1. DisruptionTarget preemption of one elastic pod by kube-scheduler
ev = [(0, "ADDED", node("node-a")), (0, "ADDED", node("node-b")), (0, "ADDED", node("node-c"))]
for i, (g, n, idx, off) in enumerate([("base", "node-a", 0, 0), ("base", "node-b", 1, 0), ("elastic", "node-c", 0, 2)]):
    ev.append((1, "ADDED", pod(f"demo-{g}-0-{idx}-x{i}", f"p{i}", g, n, idx=idx, offset=off)))
for i, (g, n, idx, off) in enumerate([("base", "node-a", 0, 0), ("base", "node-b", 1, 0), ("elastic", "node-c", 0, 2)]):
    ev.append((5 + i, "MODIFIED", pod(f"demo-{g}-0-{idx}-x{i}", f"p{i}", g, n, "Running", True, idx=idx, offset=off)))
pre = disruption("PreemptionByScheduler", "hp-train-b: preempting to accommodate a higher priority pod")
ev.append((30, "MODIFIED", pod("demo-elastic-0-0-x2", "p2", "elastic", "node-c", "Running", True, [pre], idx=0, offset=2)))
ev.append((35, "MODIFIED", pod("demo-elastic-0-0-x2", "p2", "elastic", "node-c", "Failed", False, [pre], idx=0, offset=2)))
ev.append((36, "DELETED", pod("demo-elastic-0-0-x2", "p2", "elastic", "node-c", "Failed", False, [pre], idx=0, offset=2)))
write("disruption_target_preemption.jsonl", {"about": "kube-scheduler preempts the elastic group's pod for a higher-priority pod: DisruptionTarget True (PreemptionByScheduler), the pod fails (exit 143) and is deleted. " + HAND,
      "expect": [["capacity", 0], ["capacity", 0], ["capacity", 0], ["preemption", 1]], "final": {"hosts": 2, "preemption_requested": False, "phase": "running"}}, ev)

# 2. Kueue evicts the elastic JobSet's workload (split elastic), then re-admits it
ev = [(0, "ADDED", node("node-a")), (0, "ADDED", node("node-b")), (0, "ADDED", node("node-c"))]
adm = [cond("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cluster-queue"), cond("Admitted", "True", "Admitted", "The workload is admitted")]
ev.append((0, "ADDED", workload("jobset-demo-1a2b3", "demo", 1, adm)))
ev.append((0, "ADDED", workload("jobset-demo-elastic-4c5d6", "demo-elastic", 2, adm)))
ev.append((1, "ADDED", pod("demo-base-0-0-aa", "b0", "base", "node-a", "Running", True)))
ev.append((1, "ADDED", pod("demo-elastic-elastic-0-0-bb", "e0", "elastic", "node-b", "Running", True, js="demo-elastic", offset=1)))
ev.append((1, "ADDED", pod("demo-elastic-elastic-0-1-cc", "e1", "elastic", "node-c", "Running", True, js="demo-elastic", idx=1, offset=1)))
evict = [cond("QuotaReserved", "False", "Pending", "Preempted to accommodate a workload (UID: 1f2e) due to prioritization in the ClusterQueue", ts(40)),
         cond("Admitted", "False", "NoReservation", "The workload has no reservation", ts(40)),
         cond("Evicted", "True", "Preempted", "Preempted to accommodate a workload (UID: 1f2e) due to prioritization in the ClusterQueue", ts(40)),
         cond("Preempted", "True", "InClusterQueue", "Preempted to accommodate a workload (UID: 1f2e) due to prioritization in the ClusterQueue", ts(40))]
ev.append((40, "MODIFIED", workload("jobset-demo-elastic-4c5d6", "demo-elastic", 2, evict)))
ev.append((50, "DELETED", pod("demo-elastic-elastic-0-0-bb", "e0", "elastic", "node-b", "Failed", False, js="demo-elastic", offset=1)))
ev.append((50, "DELETED", pod("demo-elastic-elastic-0-1-cc", "e1", "elastic", "node-c", "Failed", False, js="demo-elastic", idx=1, offset=1)))
readm = [cond("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cluster-queue", ts(90)),
         cond("Admitted", "True", "Admitted", "The workload is admitted", ts(90)),
         cond("Evicted", "False", "QuotaReserved", "Previously: Preempted to accommodate a workload (UID: 1f2e) due to prioritization in the ClusterQueue", ts(90)),
         cond("Preempted", "False", "QuotaReserved", "Previously: Preempted to accommodate a workload (UID: 1f2e) due to prioritization in the ClusterQueue", ts(90))]
ev.append((90, "MODIFIED", workload("jobset-demo-elastic-4c5d6", "demo-elastic", 2, readm)))
write("kueue_eviction.jsonl", {"about": "Kueue preempts the elastic JobSet's Workload (Evicted/Preempted, InClusterQueue) while the base one keeps running; its two pods are deleted (no failure counted); later Kueue admits it again. " + HAND,
      "expect": [["capacity", 0], ["capacity", 0], ["capacity", 0], ["capacity", 0], ["capacity", 0], ["preemption", 2], ["capacity", 0]], "phases": {"9": "preempting", "10": "preempting", "11": "running", "12": "running"}, "final": {"hosts": 1, "preemption_requested": False, "phase": "running"}}, ev)

# 3. node NotReady: the node's pods count as failed after the grace
ev = [(0, "ADDED", node("node-a")), (0, "ADDED", node("node-b"))]
ev.append((1, "ADDED", pod("demo-base-0-0-aa", "b0", "base", "node-a", "Running", True)))
ev.append((1, "ADDED", pod("demo-base-0-1-bb", "b1", "base", "node-b", "Running", True, idx=1)))
ev.append((60, "MODIFIED", node("node-b", "Unknown")))
ev.append((70, "MODIFIED", node("node-a")))  # a heartbeat of another node: the clock moves past the grace
write("node_not_ready.jsonl", {"about": "node-b stops posting status (Ready Unknown, NodeStatusUnknown); with not_ready_grace_s=5 its pod counts as failed at the next event after the grace. " + HAND,
      "not_ready_grace_s": 5, "expect": [["capacity", 0], ["capacity", 0], ["failure", 1]], "final": {"hosts": 1, "preemption_requested": False, "phase": "running"}}, ev)

# 4. Kueue admission: pending workload admitted, then pods start
ev = [(0, "ADDED", node("node-a")), (0, "ADDED", node("node-b"))]
pend = [cond("QuotaReserved", "False", "Pending", "couldn't assign flavors to pod set base: insufficient unused quota for nvidia.com/gpu in flavor h100, 16 more needed")]
ev.append((0, "ADDED", workload("jobset-demo-1a2b3", "demo", 2, pend)))
ev.append((20, "MODIFIED", workload("jobset-demo-1a2b3", "demo", 2, [cond("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cluster-queue", ts(20)),
                                                                     cond("Admitted", "True", "Admitted", "The workload is admitted", ts(20))])))
ev.append((21, "ADDED", pod("demo-base-0-0-aa", "b0", "base", "")))
ev.append((22, "MODIFIED", pod("demo-base-0-0-aa", "b0", "base", "node-a", "Running", False)))
ev.append((25, "MODIFIED", pod("demo-base-0-0-aa", "b0", "base", "node-a", "Running", True)))
write("kueue_admission.jsonl", {"about": "A JobSet's Workload waits for quota (QuotaReserved False), Kueue admits it, its pod is scheduled, starts and becomes Ready. " + HAND,
      "expect": [["capacity", 0], ["capacity", 0]], "phases": {"3": "suspended", "4": "pending", "6": "pending", "7": "running"},
      "final": {"hosts": 1, "preemption_requested": False, "phase": "running"}}, ev)

# 5. capacity returning: an elastic pod was deleted without notice (failure), its replacement comes up
ev = [(0, "ADDED", node("node-a")), (0, "ADDED", node("node-b"))]
ev.append((1, "ADDED", pod("demo-base-0-0-aa", "b0", "base", "node-a", "Running", True)))
ev.append((1, "ADDED", pod("demo-elastic-0-0-bb", "e0", "elastic", "node-b", "Running", True, offset=1)))
ev.append((30, "DELETED", pod("demo-elastic-0-0-bb", "e0", "elastic", "node-b", "Running", True, offset=1)))
ev.append((31, "ADDED", pod("demo-elastic-0-0-dd", "e0b", "elastic", "", offset=1)))
ev.append((80, "MODIFIED", pod("demo-elastic-0-0-dd", "e0b", "elastic", "node-b", "Running", False, offset=1)))
ev.append((85, "MODIFIED", pod("demo-elastic-0-0-dd", "e0b", "elastic", "node-b", "Running", True, offset=1)))
write("capacity_returning.jsonl", {"about": "An elastic pod is deleted with no disruption announced (failure); the Job creates its replacement, which waits, is scheduled and becomes Ready: capacity again. " + HAND,
      "expect": [["capacity", 0], ["capacity", 0], ["failure", 1], ["capacity", 0]], "final": {"hosts": 2, "preemption_requested": False, "phase": "running"}}, ev)

"""Contract test of ``hp k8s watch`` acting on a running job: real ``hp controller``, three real ``hp run``
agents (the job's "pods", one rank each, elastic 2..3) training the exact-mode elastic demo, and the real
``hp k8s watch`` process with the real ``kubernetes`` client, watching a fake API server.

No Kubernetes API server exists here. The fake (http.server on a free loopback port) serves the three
watches hp k8s watch opens (the job's Pods by label selector, the Nodes, Kueue's Workloads: 404, as in a
cluster without Kueue) in the API's chunked watch format; every object it serves is first validated
against the official schema (kubernetes-validate, strict). The node that "fails" is made to: its agent
and workers are stopped (SIGSTOP: no heartbeat, no collective), as behind a dead kubelet, while the fake
reports its Node Ready=Unknown. The controller's heartbeat timeout is 120 s: only the watch can explain
the job going on without the node within seconds.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler

import kubernetes_validate
import pytest
from hp.core.schedulers.k8s.manifest import ManifestConfig, worker_pod_template
from hp.testing import fake_kubernetes_api

K8S_VERSION = "1.36.0"
JOB = "demo"


class WatchApi:
    """The fake API server's objects, and the open watches to tell of each change."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, dict]] = {"pods": {}, "nodes": {}}
        self.watchers: list[tuple[str, dict, queue.Queue]] = []
        self.version = 0
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.watches: list[dict] = []  # the query of each watch opened
        self.oldest = 0  # a watch from a resourceVersion older than this is told 410 Gone (compacted)

    def put(self, plural: str, obj: dict, kind: str = "MODIFIED") -> None:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # what a real API server would serve
        with self.lock:
            self.version += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self.version)
            if kind == "DELETED":
                self.objects[plural].pop(obj["metadata"]["name"], None)
            else:
                kind = kind if obj["metadata"]["name"] in self.objects[plural] or kind != "MODIFIED" else "ADDED"
                self.objects[plural][obj["metadata"]["name"]] = obj
            for p, selector, q in self.watchers:
                if p == plural and _selected(obj, selector):
                    q.put({"type": kind, "object": obj})


def _selected(obj: dict, selector: dict) -> bool:
    return all(obj["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())


class Handler(BaseHTTPRequestHandler):
    api: WatchApi
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _status(self, code: int, message: str) -> None:
        body = json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                           "message": message, "reason": "NotFound" if code == 404 else "Unauthorized",
                           "code": code}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        if self.headers.get("Authorization") != "Bearer test-token":
            return self._status(401, "Unauthorized")
        parts = url.path.strip("/").split("/")
        if parts == ["api", "v1", "nodes"]:
            plural = "nodes"
        elif parts[:3] == ["api", "v1", "namespaces"] and parts[4:] == ["pods"] and parts[3] == "default":
            plural = "pods"
        else:  # Kueue's workloads among them: not installed
            return self._status(404, "the server could not find the requested resource")
        if query.get("watch") not in ("true", "True", "1"):
            return self._status(404, "only watches are served here")
        selector = dict(kv.split("=", 1) for kv in query.get("labelSelector", "").split(",") if kv)
        since = int(query.get("resourceVersion") or 0)
        q: queue.Queue = queue.Queue()
        with self.api.lock:
            self.api.watches.append({"plural": plural, **query})
            if since and since < self.api.oldest:
                q.put({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                                    "status": "Failure", "reason": "Expired", "code": 410,
                                                    "message": f"too old resource version: {since}"}})
            for obj in self.api.objects[plural].values():  # without a resourceVersion: every object, ADDED
                if _selected(obj, selector) and int(obj["metadata"]["resourceVersion"]) > since:
                    q.put({"type": "ADDED" if not since else "MODIFIED", "object": obj})
            self.api.watchers.append((plural, selector, q))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        deadline = time.monotonic() + float(query.get("timeoutSeconds", 300))
        try:
            while time.monotonic() < deadline and not self.api.closed.is_set():
                try:
                    event = q.get(timeout=0.1)
                except queue.Empty:
                    continue
                line = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass
        finally:
            with self.api.lock:
                self.api.watchers.remove((plural, selector, q))


@pytest.fixture
def watch_api(tmp_path):
    api = WatchApi()
    with fake_kubernetes_api(type("BoundHandler", (Handler,), {"api": api}), tmp_path) as kubeconfig:
        api.kubeconfig = kubeconfig
        try:
            yield api
        finally:
            api.closed.set()  # the open watches end, so the server's shutdown does not wait on them


def node(name: str, ready: str = "True") -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "uid": f"node-{name}"},
            "status": {"conditions": [{"type": "Ready", "status": ready,
                                       "reason": "KubeletReady" if ready == "True" else "NodeStatusUnknown"}]}}


def pod(node_rank: int, uid: str, on: str, phase: str = "Running") -> dict:
    """The worker pod of ``node_rank`` as the JobSet's Jobs make it from hp k8s manifest's template (min 2,
    max 3: ranks 0 and 1 in the base group, 2 in the elastic one): its group's HP_RANK_OFFSET, its index
    annotation, scheduled on ``on``."""
    cfg = ManifestConfig(name=JOB, entrypoint="train.py", min_nodes=2, max_nodes=3, scaling_policy="min_replicas: 2\n")
    group, index = ("base", node_rank) if node_rank < 2 else ("elastic", node_rank - 2)
    template = worker_pod_template(cfg, group, "batch.kubernetes.io/job-completion-index")
    ready = "True" if phase == "Running" else "False"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{JOB}-{group}-0-{index}-{uid[-5:]}", "namespace": "default", "uid": uid,
                         "labels": {**template["metadata"]["labels"], "jobset.sigs.k8s.io/jobset-name": JOB},
                         "annotations": {"batch.kubernetes.io/job-completion-index": str(index)}},
            "spec": {**template["spec"], "nodeName": on},
            "status": {"phase": phase, "conditions": [{"type": "Ready", "status": ready}]}}


def test_a_watch_goes_on_from_its_last_resource_version_and_from_scratch_after_410(watch_api, monkeypatch):
    """The real client's watches against the fake: a watch that ends (its own timeoutSeconds) is opened
    again from the last resourceVersion seen, so nothing is sent twice; one told 410 Gone (its version
    compacted away) is opened again without one, and every object comes again as ADDED."""
    from hp.core.schedulers.k8s import operator
    from hp.core.schedulers.k8s.backend import KubernetesScheduler

    monkeypatch.setattr(operator, "STREAM_S", 1)
    monkeypatch.setattr(operator, "RETRY_S", (0.05, 0.1))
    watch_api.put("nodes", node("node-0"))
    said: list[str] = []
    scheduler = KubernetesScheduler(kubeconfig=watch_api.kubeconfig, env={"KUBERNETES_SERVICE_HOST": ""})
    streams = operator.Streams(scheduler, JOB, said.append).start()

    def take(n: int) -> list[tuple[str, str, str]]:
        got = [streams.events.get(timeout=30) for _ in range(n)]
        return [(e["type"], e["object"]["kind"], e["object"]["metadata"]["name"]) for e in got]

    def node_watches() -> list[dict]:
        return [w for w in watch_api.watches if w["plural"] == "nodes"]

    try:
        assert take(1) == [("ADDED", "Node", "node-0")]
        deadline = time.monotonic() + 30
        while len(node_watches()) < 2:  # the first one ended after 1 s and was opened again
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert node_watches()[1]["resourceVersion"] == "1"
        watch_api.put("nodes", node("node-0", ready="Unknown"))
        assert take(1) == [("MODIFIED", "Node", "node-0")]
        assert streams.events.empty()  # node-0 was not sent again
        watch_api.oldest = 100
        deadline = time.monotonic() + 30
        while not any("resourceVersion" not in w for w in node_watches()[1:]):
            assert time.monotonic() < deadline, node_watches()
            time.sleep(0.05)
        assert take(1) == [("ADDED", "Node", "node-0")]  # from scratch: the list again
        assert any("the Node watch broke" in m and "from scratch" in m for m in said), said
        assert any("no Kueue in the cluster" in m for m in said)
    finally:
        streams.stop()


def test_the_watch_refuses_bad_input_in_one_line(tmp_path):
    env = {**os.environ, "HP_JOB_TOKEN": "f" * 64}
    for args, message in ((["--job", "Bad_Name", "--controller", "127.0.0.1:1"], "--job"),
                          (["--job", "demo", "--controller", "nohost"], "--controller: expected HOST:PORT"),
                          (["--job", "demo", "--controller", "127.0.0.1:1", "--not-ready-grace", "-1"], "--not-ready-grace"),
                          (["--job", "demo", "--controller", "127.0.0.1:1", "--kubeconfig", str(tmp_path / "none")],
                           "no kubeconfig at")):
        r = subprocess.run([sys.executable, "-m", "hp.core.cli", "k8s", "watch", *args], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    r = subprocess.run([sys.executable, "-m", "hp.core.cli", "k8s", "watch", "--job", "demo", "--controller", "127.0.0.1:1"],
                       env={k: v for k, v in os.environ.items() if k != "HP_JOB_TOKEN"}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "HP_JOB_TOKEN" in r.stderr


def test_the_manifests_sidecar_command_is_one_hp_parses():
    from hp.core.cli import build_parser
    from hp.core.schedulers.k8s.manifest import watch_args

    args = build_parser().parse_args(watch_args(ManifestConfig(name=JOB, entrypoint="train.py")))
    assert (args.job, args.namespace, args.controller) == (JOB, "default", "$(HP_POD_IP):29400")


def test_a_node_not_ready_makes_the_job_go_on_without_it_at_once_bit_identical(watch_api, tmp_path):
    """3 pods train (elastic 2..3); a stale report (an earlier pod of node rank 1 seen Failed) changes
    nothing; then node-2 goes dark and its Node NotReady: hp k8s watch tells the controller, which loses
    the node at once (heartbeat timeout 120 s); the job shrinks to 2, and 5 steps later it is asked to end
    (`hp finish`, decided at run time): 0 lost steps, its losses and every rank's final state bit-identical to
    a fixed 2-rank run to the same step."""
    from hp.checkpointless.demo.run import RunResult, compare_state
    from hp.checkpointless.events import read_events
    from hp.testing import free_port, kill_tagged, tagged_pids
    from hp.elastic.demo.run import (
        POLICY,
        ElasticDemoConfig,
        _agent,
        _env,
        _Job,
        commits,
        lost_steps,
        reference_run,
        train_argv,
        world_by_step,
    )

    root = str(tmp_path)
    policy = os.path.join(root, "policy.yaml")
    with open(policy, "w") as f:
        f.write(POLICY.format(min=2, max=3, global_batch=48, micro_batch=4))
    demo = ElasticDemoConfig(steps=300, global_batch=48, micro_batch=4, log_dir=root, timeout_s=300)  # at most
    tag = f"HP_TEST_K8S_WATCH={uuid.uuid4().hex}"
    env, port = {**_env(), tag.split("=")[0]: tag.split("=")[1]}, free_port()
    for n in range(3):
        watch_api.put("nodes", node(f"node-{n}"))
    jobs = []
    try:
        decisions = os.path.join(root, "decisions.jsonl")
        jobs.append(_Job([sys.executable, "-m", "hp.core.cli", "controller", "--host", "127.0.0.1", "--port", str(port),
                          "--nnodes", "2:3", "--scaling-policy", policy, "--heartbeat-timeout", "120",
                          "--decision-log", decisions], os.path.join(root, "controller.out"), env))
        dirs = [os.path.join(root, f"node{r}") for r in range(3)]
        for r in range(3):
            flags = ["--nnodes", "2:3", "--scaling-policy", policy, "--nproc-per-node", "1", "--node-rank", str(r),
                     "--rdzv-endpoint", f"127.0.0.1:{port}", "--external-controller", "--heartbeat-timeout", "120"]
            jobs.append(_Job(_agent(dirs[r], flags) + train_argv(demo, policy), os.path.join(root, f"node{r}.out"),
                             {**env, "HP_NODE_INCARNATION": f"uid-{r}"}))
            watch_api.put("pods", pod(r, f"uid-{r}", f"node-{r}"))
        jobs.append(_Job([sys.executable, "-m", "hp.core.cli", "k8s", "watch", "--job", JOB, "--controller",
                          f"127.0.0.1:{port}", "--not-ready-grace", "0.5", "--kubeconfig", watch_api.kubeconfig],
                         os.path.join(root, "watch.out"), env))
        events = lambda: [e for d in dirs for e in read_events(os.path.join(d, "events"))]

        def wait_for(what, done, timeout=180.0):
            deadline = time.monotonic() + timeout
            while not done():
                assert time.monotonic() < deadline, f"{what}: " + "".join(j.tail() for j in jobs)
                time.sleep(0.1)

        def lost() -> list[dict]:
            if not os.path.exists(decisions):
                return []
            with open(decisions) as f:
                return [d for d in map(json.loads, f) if d["decision"] == "node_lost"]

        wait_for("10 steps at 3 ranks", lambda: sum(1 for w in world_by_step(events()).values() if w == 3) >= 10)
        watch_api.put("pods", pod(1, "uid-1-before", "node-1", phase="Failed"))  # an earlier run of node rank 1
        said = lambda: (tmp_path / "watch.out").read_text()
        wait_for("the stale report", lambda: "node 1 failed as uid-1-before, but the job's node 1 is uid-1" in said(), 60)
        assert lost() == [], "a report about an earlier pod of node rank 1 hit the running one"
        for pid in tagged_pids("HP_NODE_INCARNATION=uid-2"):  # node-2 goes dark: its agent and worker stop
            os.kill(pid, signal.SIGSTOP)
        dark = time.monotonic()
        watch_api.put("nodes", node("node-2", ready="Unknown"))
        wait_for("the node lost", lambda: lost(), 60)
        told_s = time.monotonic() - dark
        (decision,) = lost()
        for pid in tagged_pids("HP_NODE_INCARNATION=uid-2"):
            os.kill(pid, signal.SIGKILL)  # the dead node's processes never come back
        assert decision["node_rank"] == 2 and "node node-2 NotReady" in decision["cause"], decision
        print(f"node-2 lost {told_s:.2f} s after it went dark (not-ready grace 0.5 s)")
        assert told_s < 30, f"lost after {told_s:.1f} s: not the watch (the heartbeat timeout is 120 s)"
        wait_for("5 steps at 2 ranks", lambda: sum(1 for w in world_by_step(events()).values() if w == 2) >= 5)
        from hp.core.auth import OPERATOR
        from hp.core.control_plane import ControlClient

        ControlClient(f"127.0.0.1:{port}", env["HP_JOB_TOKEN"], node=OPERATOR).call("finish", {"reason": "the test"})
        for j in jobs[1:3]:
            assert j.proc.wait(timeout=300) == 0, j.tail()
    finally:
        for j in jobs:
            j.kill()
        kill_tagged(tag)  # workers live in sessions of their own
    got = events()
    sizes = world_by_step(got)
    assert sorted(set(sizes.values())) == [2, 3] and sizes[max(sizes)] == 2
    (end,) = {e["step"] for e in got if e["event"] == "finish_agreed"}  # both ranks after the same step
    assert end == max(sizes) < demo.steps - 1 and lost_steps(got, end + 1) == 0
    reference = reference_run(dataclasses.replace(demo, steps=end + 1), root, policy, ranks=2)
    assert reference.returncode == 0, reference.output
    want = {s: {e["loss"] for e in es} for s, es in commits(reference.events).items()}
    have = {s: {e["loss"] for e in es} for s, es in commits(got).items()}
    assert have == want and all(len(v) == 1 for v in have.values())
    state = compare_state(reference, RunResult(0, 0.0, got, ""), nproc=2)
    assert state["state_equal"], state["state_differences"]

"""Contract test of the `kubernetes` scheduler backend: submit, cancel, state, capacity and hosts through the
REAL `kubernetes` client (configured from a kubeconfig file) against a tiny fake API server.

No Kubernetes API server exists here. The fake (http.server on a free 127.0.0.1 port, started and stopped by a
fixture) speaks the API's REST paths and Status errors, validates every request body it is sent against the
same schemas as test_k8s_contract.py (kubernetes-validate strict for core and RBAC kinds, the vendored CRDs
for custom ones) and answers with recorded objects (the final state of the watch fixtures). It is a contract test: it
shows the backend sends valid objects to the right paths and reads real responses, not that a cluster runs
the job."""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import kubernetes_validate
import pytest

from hp.core import get_backend
from hp.core.errors import UsageError
from hp.core.schedulers.k8s import schemas
from hp.core.schedulers.k8s.backend import KubernetesError, KubernetesScheduler, parse_handle
from hp.core.schedulers.k8s.manifest import ManifestConfig
from hp.testing import fake_kubernetes_api

K8S_VERSION = "1.36.0"
DATA = Path(__file__).parent / "data" / "k8s_watch"
CORE = {"configmaps": "ConfigMap", "services": "Service", "pods": "Pod", "secrets": "Secret",
        "serviceaccounts": "ServiceAccount"}
RBAC = "rbac.authorization.k8s.io"
BUILTIN = {"": CORE, RBAC: {"roles": "Role", "rolebindings": "RoleBinding", "clusterroles": "ClusterRole",
                            "clusterrolebindings": "ClusterRoleBinding"}}  # group -> plural -> kind
CLUSTER_SCOPED = {"clusterroles", "clusterrolebindings"}
KEPT = {("default", "secrets", "demo-token"), ("team-a", "localqueues", "team-a-queue")}  # the fixture's own


def _final_objects(name: str) -> dict[tuple[str, str], dict]:
    """The objects a recorded stream leaves, by (kind, name): what a list returns at its end."""
    objects: dict[tuple[str, str], dict] = {}
    for line in (DATA / name).read_text().splitlines()[1:]:
        event = json.loads(line)["event"]
        key = (event["object"]["kind"], event["object"]["metadata"]["name"])
        if event["type"] == "DELETED":
            objects.pop(key, None)
        else:
            objects[key] = event["object"]
    return objects


class FakeApi:
    """The API server's state and the requests it was sent."""

    def __init__(self) -> None:
        self.namespaces = {"default", "team-a"}
        self.crds = {"jobset.x-k8s.io", "kueue.x-k8s.io", "batch.volcano.sh"}
        self.objects: dict[tuple[str | None, str, str], dict] = {}  # (namespace or None, plural, name) -> object
        self.nodes: list[dict] = []
        self.requests: list[tuple[str, str]] = []
        self.refuse: set[str] = set()  # plurals whose creation is refused (422)
        self.lock = threading.Lock()

    def load(self, name: str, namespace: str = "default") -> None:
        for (kind, obj_name), obj in _final_objects(name).items():
            if kind == "Node":
                self.nodes.append(obj)
            else:
                self.objects[(namespace, {"Pod": "pods", "Workload": "workloads"}[kind], obj_name)] = obj


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class Handler(BaseHTTPRequestHandler):
    api: FakeApi

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self) -> tuple[str | None, str | None, str | None, str | None, dict]:
        """(group, namespace, plural, name, query) of an API path."""
        url = urllib.parse.urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        query = dict(urllib.parse.parse_qsl(url.query))
        if parts[:2] == ["api", "v1"]:
            group, rest = "", parts[2:]
        elif parts[0] == "apis":
            group, rest = parts[1], parts[3:]
        else:
            return None, None, None, None, query
        if rest[:1] == ["namespaces"] and len(rest) >= 3:
            return group, rest[1], rest[2], (rest[3] if len(rest) > 3 else None), query
        if rest[:1] == ["namespaces"] and len(rest) == 2:
            return group, None, "namespaces", rest[1], query
        return group, None, rest[0], (rest[1] if len(rest) > 1 else None), query

    def _missing(self, group: str, namespace: str | None, plural: str) -> bool:
        if group in BUILTIN and (plural in CLUSTER_SCOPED) != (namespace is None):  # e.g. a namespaced clusterrole
            self._send(404, _status(404, "NotFound", "the server could not find the requested resource"))
            return True
        if group and group not in BUILTIN and group not in self.api.crds:
            self._send(404, _status(404, "NotFound", "the server could not find the requested resource"))
            return True
        if namespace is not None and namespace not in self.api.namespaces:
            self._send(404, _status(404, "NotFound", f'namespaces "{namespace}" not found'))
            return True
        return False

    def do_GET(self) -> None:
        group, namespace, plural, name, query = self._route()
        self.api.requests.append(("GET", self.path))
        if self.headers.get("Authorization") != "Bearer test-token":
            return self._send(401, _status(401, "Unauthorized", "Unauthorized"))
        if plural == "namespaces":
            if name in self.api.namespaces:
                return self._send(200, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
            return self._send(404, _status(404, "NotFound", f'namespaces "{name}" not found'))
        if plural == "nodes":
            return self._send(200, {"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": self.api.nodes})
        if self._missing(group, namespace, plural):
            return None
        if name is not None:
            obj = self.api.objects.get((namespace, plural, name))
            if obj is None:
                return self._send(404, _status(404, "NotFound", f'{plural} "{name}" not found'))
            return self._send(200, obj)
        selector = dict(kv.split("=", 1) for kv in query.get("labelSelector", "").split(",") if kv)
        items = [o for (ns, p, _), o in sorted(self.api.objects.items()) if ns == namespace and p == plural
                 and all(o["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())]
        return self._send(200, {"apiVersion": "v1", "kind": "List", "metadata": {}, "items": items})

    def do_POST(self) -> None:
        group, namespace, plural, _, _ = self._route()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.api.requests.append(("POST", self.path))
        if self._missing(group, namespace, plural):
            return None
        try:  # what the API server would check: the body against its schema
            if group in BUILTIN:
                assert body["kind"] == BUILTIN[group][plural], (body["kind"], plural)
                kubernetes_validate.validate(body, K8S_VERSION, strict=True)
            else:
                schemas.validate(body)
        except (schemas.SchemaError, kubernetes_validate.ValidationError, AssertionError, KeyError) as e:
            return self._send(422, _status(422, "Invalid", f"invalid body: {str(e)[:200]}"))
        name = body["metadata"]["name"]
        if body["metadata"].get("namespace", namespace) != namespace:  # cluster-scoped: none at all, hp sends none
            return self._send(400, _status(400, "BadRequest", "the namespace of the object does not match"))
        if plural in self.api.refuse:
            return self._send(422, _status(422, "Invalid", f'{body["kind"]}.{group} "{name}" is invalid: refused by the test'))
        with self.api.lock:
            if (namespace, plural, name) in self.api.objects:
                return self._send(409, _status(409, "AlreadyExists", f'{plural} "{name}" already exists'))
            self.api.objects[(namespace, plural, name)] = body
        return self._send(201, body)

    def do_DELETE(self) -> None:
        group, namespace, plural, name, _ = self._route()
        length = int(self.headers.get("Content-Length") or 0)
        options = json.loads(self.rfile.read(length)) if length else {}
        self.api.requests.append(("DELETE", self.path))
        if self._missing(group, namespace, plural):
            return None
        if options and options.get("kind") not in (None, "DeleteOptions"):
            return self._send(400, _status(400, "BadRequest", "not DeleteOptions"))
        with self.api.lock:
            obj = self.api.objects.pop((namespace, plural, name), None)
        if obj is None:
            return self._send(404, _status(404, "NotFound", f'{plural} "{name}" not found'))
        return self._send(200, obj)


@pytest.fixture
def fake_api(tmp_path):
    """A fake API server on a free loopback port, and a kubeconfig naming it."""
    api = FakeApi()
    api.objects[("default", "secrets", "demo-token")] = {"apiVersion": "v1", "kind": "Secret",
                                                         "metadata": {"name": "demo-token"}, "type": "Opaque"}
    api.objects[("team-a", "localqueues", "team-a-queue")] = {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
        "metadata": {"name": "team-a-queue", "namespace": "team-a"}, "spec": {"clusterQueue": "cluster-queue"}}
    with fake_kubernetes_api(type("BoundHandler", (Handler,), {"api": api}), tmp_path) as kubeconfig:
        api.kubeconfig = kubeconfig
        yield api


def _backend(api: FakeApi, **kwargs) -> KubernetesScheduler:
    return KubernetesScheduler(kubeconfig=api.kubeconfig, env={"KUBERNETES_SERVICE_HOST": ""}, **kwargs)


POLICY = "min_replicas: 1\nmax_replicas: 3\nglobal_batch: 12\nmicro_batch: 4\n"


def test_the_backend_is_registered():
    backend = get_backend("scheduler", "kubernetes")
    assert isinstance(backend, KubernetesScheduler) and backend.torchx_scheduler == "kubernetes"


@pytest.mark.parametrize("variant", ["jobset", "volcano"])
def test_submit_creates_valid_objects_in_order_then_state_and_cancel(fake_api, variant):
    cfg = ManifestConfig(name="demo", entrypoint="train.py", min_nodes=1, max_nodes=3, scaling_policy=POLICY,
                         variant=variant, memory="16Gi")
    backend = _backend(fake_api)
    handle = backend.submit(cfg)
    assert handle == f"kubernetes://default/{variant}/demo"
    posts = [path for method, path in fake_api.requests if method == "POST"]
    custom = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets" if variant == "jobset" \
        else "/apis/batch.volcano.sh/v1alpha1/namespaces/default/jobs"
    rbac = f"/apis/{RBAC}/v1"
    assert posts == ["/api/v1/namespaces/default/configmaps", "/api/v1/namespaces/default/serviceaccounts",
                     f"{rbac}/namespaces/default/roles", f"{rbac}/namespaces/default/rolebindings",
                     f"{rbac}/clusterroles", f"{rbac}/clusterrolebindings",
                     "/api/v1/namespaces/default/services", "/api/v1/namespaces/default/pods", custom]
    assert fake_api.objects[(None, "clusterrolebindings", "hp-watch-default.demo")]["subjects"] == [
        {"kind": "ServiceAccount", "name": "demo-watch", "namespace": "default"}]
    assert fake_api.objects[("default", "pods", "demo-controller")]["spec"]["serviceAccountName"] == "demo-watch"
    plural = "jobsets" if variant == "jobset" else "jobs"
    obj = fake_api.objects[("default", plural, "demo")]
    assert backend.state(handle) == "PENDING"
    if variant == "jobset":
        obj["status"] = {"replicatedJobsStatus": [{"name": "base", "ready": 1, "active": 0}]}
        assert backend.state(handle) == "RUNNING"
        obj["status"] = {"conditions": [{"type": "Completed", "status": "True", "reason": "AllJobsCompleted",
                                         "message": "jobset completed successfully", "lastTransitionTime": "2026-08-24T10:00:00Z"}]}
    else:
        obj["status"] = {"state": {"phase": "Completed"}}
    assert backend.wait(handle, poll_s=0.01) == "SUCCEEDED"
    fake_api.requests.clear()
    backend.cancel(handle)
    assert set(fake_api.objects) == KEPT
    assert [p for m, p in fake_api.requests if m == "DELETE"][-5:] == [  # the RBAC objects last, in reverse
        f"{rbac}/clusterrolebindings/hp-watch-default.demo", f"{rbac}/clusterroles/hp-watch-default.demo",
        f"{rbac}/namespaces/default/rolebindings/demo-watch", f"{rbac}/namespaces/default/roles/demo-watch",
        "/api/v1/namespaces/default/serviceaccounts/demo-watch"]
    assert backend.state(handle) is None  # gone
    backend.cancel(handle)  # twice is fine


def test_no_watch_or_a_named_account_creates_no_rbac_and_cancel_still_works(fake_api):
    backend = _backend(fake_api)
    for name, change in (("plain", {"watch": False}), ("named", {"service_account": "trainer"})):
        cfg = ManifestConfig(name=name, entrypoint="train.py", token_secret="demo-token", memory="16Gi", **change)
        fake_api.requests.clear()
        handle = backend.submit(cfg)
        assert [p.rsplit("/", 1)[1] for m, p in fake_api.requests if m == "POST"] == ["services", "pods", "jobsets"]
        backend.cancel(handle)  # the RBAC objects it never had: 404, fine
        assert set(fake_api.objects) == KEPT


def test_submit_with_a_kueue_queue_checks_it_exists(fake_api):
    fake_api.objects[("team-a", "secrets", "demo-token")] = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "demo-token"}}
    cfg = ManifestConfig(name="demo", entrypoint="train.py", namespace="team-a", queue="team-a-queue", memory="16Gi")
    assert _backend(fake_api).submit(cfg) == "kubernetes://team-a/jobset/demo"
    labels = fake_api.objects[("team-a", "jobsets", "demo")]["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "team-a-queue"
    cfg.name, cfg.queue = "demo2", "no-such-queue"
    with pytest.raises(KubernetesError, match="unknown Kueue LocalQueue 'no-such-queue'"):
        _backend(fake_api).submit(cfg)
    assert ("team-a", "jobsets", "demo2") not in fake_api.objects


@pytest.mark.parametrize("change,message", [
    ({"namespace": "nope"}, "unknown namespace 'nope'"),
    ({"token_secret": "missing-token"}, "create secret generic missing-token"),
    ({"cpu": "lots"}, "--cpu must be a positive Kubernetes quantity"),
])
def test_bad_input_is_one_line_before_anything_is_created(fake_api, change, message):
    cfg = ManifestConfig(name="demo", entrypoint="train.py", memory="16Gi", **change)
    with pytest.raises(UsageError) as info:
        _backend(fake_api).submit(cfg)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not [r for r in fake_api.requests if r[0] == "POST"]


def test_a_refused_object_rolls_back_what_was_created(fake_api):
    fake_api.refuse.add("jobsets")
    with pytest.raises(KubernetesError, match="422 JobSet.jobset.x-k8s.io \"demo\" is invalid"):
        _backend(fake_api).submit(ManifestConfig(name="demo", entrypoint="train.py", memory="16Gi"))
    rbac = f"/apis/{RBAC}/v1"
    assert [p for m, p in fake_api.requests if m == "DELETE"] == [
        "/api/v1/namespaces/default/pods/demo-controller", "/api/v1/namespaces/default/services/demo-controller",
        f"{rbac}/clusterrolebindings/hp-watch-default.demo", f"{rbac}/clusterroles/hp-watch-default.demo",
        f"{rbac}/namespaces/default/rolebindings/demo-watch", f"{rbac}/namespaces/default/roles/demo-watch",
        "/api/v1/namespaces/default/serviceaccounts/demo-watch"]
    assert set(fake_api.objects) == KEPT


def test_a_refused_rbac_object_rolls_back_and_is_one_line(fake_api):
    """A user who may not create ClusterRoles (a namespace admin): what was created goes, the error is one line."""
    fake_api.refuse.add("clusterroles")
    with pytest.raises(KubernetesError, match=r"create ClusterRole hp-watch-default.demo: 422") as info:
        _backend(fake_api).submit(ManifestConfig(name="demo", entrypoint="train.py", memory="16Gi"))
    assert "\n" not in str(info.value)
    assert [p.rsplit("/", 1)[1] for m, p in fake_api.requests if m == "DELETE"] == ["demo-watch"] * 3
    assert set(fake_api.objects) == KEPT


def test_a_cluster_without_the_jobset_crd_says_so(fake_api):
    fake_api.crds.discard("jobset.x-k8s.io")
    with pytest.raises(KubernetesError, match=r"the JobSet kind \(jobset.x-k8s.io/v1alpha2\) is not installed"):
        _backend(fake_api).submit(ManifestConfig(name="demo", entrypoint="train.py", memory="16Gi"))


def test_capacity_and_hosts_from_the_listed_objects(fake_api):
    fake_api.load("capacity_returning.jsonl")
    backend = _backend(fake_api, job="demo")
    cap = backend.capacity()
    assert (cap.hosts, cap.preemption_requested, cap.replicas) == (2, False, 2)
    assert backend.hosts() == ["node-a", "node-b"]
    assert backend.capacity("other-job").hosts == 0
    lists = [p for m, p in fake_api.requests if m == "GET" and "/pods" in p]
    assert "labelSelector=hp.dev%2Fjob%3Ddemo%2Chp.dev%2Frole%3Dworker" in lists[0]


def test_capacity_sees_a_kueue_eviction_under_way(fake_api):
    """The eviction stream cut just after the Workload was evicted, before its pods left."""
    fake_api.load("kueue_eviction.jsonl")
    stream = [json.loads(line)["event"] for line in (DATA / "kueue_eviction.jsonl").read_text().splitlines()[1:]]
    for event in stream[6:9]:  # the two elastic pods, still running, and the Workload just evicted
        kind = {"Pod": "pods", "Workload": "workloads"}[event["object"]["kind"]]
        fake_api.objects[("default", kind, event["object"]["metadata"]["name"])] = event["object"]
    assert stream[8]["object"]["status"]["conditions"][2] == {**stream[8]["object"]["status"]["conditions"][2],
                                                              "type": "Evicted", "status": "True"}
    cap = _backend(fake_api, job="demo").capacity()
    assert cap.preemption_requested and cap.hosts == 1


def test_hosts_inside_a_pod_from_the_downward_api():
    backend = KubernetesScheduler(env={"HP_NODE_NAME": "node-7", "HP_K8S_JOB": ""})
    assert backend.hosts() == ["node-7"]


def test_no_kubeconfig_is_one_line(tmp_path):
    backend = KubernetesScheduler(kubeconfig=str(tmp_path / "missing"), env={"KUBERNETES_SERVICE_HOST": ""}, job="demo")
    with pytest.raises(UsageError, match="no kubeconfig at"):
        backend.capacity()


def test_an_unreachable_server_is_one_line(fake_api, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    config = json.loads(Path(fake_api.kubeconfig).read_text())
    config["clusters"][0]["cluster"]["server"] = f"http://127.0.0.1:{port}"
    (tmp_path / "dead").write_text(json.dumps(config))
    backend = KubernetesScheduler(kubeconfig=str(tmp_path / "dead"), env={"KUBERNETES_SERVICE_HOST": ""}, job="demo")
    backend.api_client().configuration.retries = 0
    with pytest.raises(KubernetesError, match="cannot reach the API server"):
        backend.capacity()


@pytest.mark.parametrize("handle", ["demo", "kubernetes://default/demo", "kubernetes://default/slurm/demo",
                                    "kubernetes://Default/jobset/demo", "kubernetes://default/jobset/../x"])
def test_bad_handles_are_refused(handle):
    with pytest.raises(UsageError):
        parse_handle(handle)

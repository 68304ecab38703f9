"""The ``kubernetes`` scheduler backend: an hp job's objects, hosts, capacity and state through the API server.

Everything goes through the official ``kubernetes`` client (hp-core's ``kubernetes`` extra): ``CoreV1Api``
for the ConfigMap, ServiceAccount, Service and controller Pod, ``RbacAuthorizationV1Api`` for the watcher's
Role, RoleBinding, ClusterRole and ClusterRoleBinding (:mod:`hp.core.schedulers.k8s.rbac`), ``CustomObjectsApi`` for
the JobSet or Volcano Job and for Kueue's LocalQueues and Workloads. Configuration, first that applies: an
``api_client`` given, the in-cluster service account (``KUBERNETES_SERVICE_HOST``), ``kubeconfig`` (else
``$KUBECONFIG`` or ``~/.kube/config``).

``submit`` takes a :class:`hp.core.schedulers.k8s.manifest.ManifestConfig` (an ``AppDef`` goes to TorchX's
``kubernetes`` scheduler, a Volcano job of TorchX's shape), checks the namespace, the Kueue LocalQueue and the
token Secret exist, creates the objects in order and deletes what it created if one is refused. Its handle
is ``kubernetes://NAMESPACE/VARIANT/NAME``. ``capacity`` and ``hosts`` list the job's Pods, the Nodes and the
Workloads and fold them through :class:`hp.core.schedulers.k8s.watch.JobWatch`, the same decisions a watch gives.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hp.core.errors import BackendUnavailableError
from hp.core.schedulers.k8s import names
from hp.core.schedulers.k8s.manifest import JOB_LABEL, ROLE_LABEL, VARIANTS, ManifestConfig
from hp.core.schedulers.k8s.objects import manifests
from hp.core.schedulers.k8s.names import K8sConfigError
from hp.core.schedulers.k8s.rbac import object_names
from hp.core.schedulers.k8s.watch import JobWatch
from hp.core.schedulers.api import Capacity, SchedulerBackend

if TYPE_CHECKING:
    from torchx.specs import AppDef

KUEUE = ("kueue.x-k8s.io", "v1beta2")
CUSTOM = {"JobSet": ("jobset.x-k8s.io", "v1alpha2", "jobsets"), "Job": ("batch.volcano.sh", "v1alpha1", "jobs")}
# kind -> the typed client's method suffix: CoreV1Api's {create,delete}_namespaced_<suffix>, and
# RbacAuthorizationV1Api's {create,delete}_<suffix> (cluster-scoped where the suffix is not namespaced_*)
CORE_KINDS = {"ConfigMap": "config_map", "ServiceAccount": "service_account", "Service": "service", "Pod": "pod"}
RBAC_KINDS = {"Role": "namespaced_role", "RoleBinding": "namespaced_role_binding", "ClusterRole": "cluster_role",
              "ClusterRoleBinding": "cluster_role_binding"}
TERMINAL = frozenset({"SUCCEEDED", "FAILED"})
VOLCANO_PHASES = {"Completed": "SUCCEEDED", "Failed": "FAILED", "Aborted": "FAILED", "Terminated": "FAILED",
                  "Pending": "PENDING", "Running": "RUNNING", "Restarting": "RUNNING", "Completing": "RUNNING",
                  "Aborting": "RUNNING", "Terminating": "RUNNING"}


class KubernetesError(K8sConfigError):
    """The API server refused a request, or cannot be reached: one line, with its own message."""


class KubernetesScheduler(SchedulerBackend):
    name = "kubernetes"
    torchx_scheduler = "kubernetes"

    def __init__(self, namespace: str | None = None, job: str | None = None, kubeconfig: str | None = None,
                 context: str | None = None, api_client: Any = None, env: Mapping[str, str] | None = None) -> None:
        self._env = {**os.environ, **(env or {})}
        self.namespace = namespace or self._env.get("HP_K8S_NAMESPACE") or "default"
        self.job = job or self._env.get("HP_K8S_JOB") or None
        self.kubeconfig, self.context, self._api = kubeconfig, context, api_client

    # --- the client -----------------------------------------------------------------------------------------

    def api_client(self) -> Any:
        if self._api is not None:
            return self._api
        try:
            from kubernetes import client, config
        except ImportError:
            raise BackendUnavailableError("kubernetes: the client is not installed (pip install 'hp-core[kubernetes]')") from None
        try:
            if self.kubeconfig is None and self._env.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config()
                self._api = client.ApiClient()
            else:
                path = self.kubeconfig or self._env.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
                if not os.path.isfile(path):
                    raise KubernetesError(f"kubernetes: no kubeconfig at {path} (give --kubeconfig, or set KUBECONFIG)")
                configuration = client.Configuration()
                config.load_kube_config(config_file=path, context=self.context, client_configuration=configuration)
                self._api = client.ApiClient(configuration)
        except (config.ConfigException, ValueError, TypeError, KeyError) as e:
            raise KubernetesError(f"kubernetes: bad configuration: {str(e).splitlines()[0] if str(e) else e!r}") from None
        return self._api

    def core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.api_client())

    def custom(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self.api_client())

    def _rbac(self) -> Any:
        from kubernetes import client

        return client.RbacAuthorizationV1Api(self.api_client())

    def _typed(self, verb: str, kind: str) -> tuple[Any, bool]:
        """The typed client's method that does ``verb`` (create, delete) to a ``kind`` of
        :data:`CORE_KINDS` or :data:`RBAC_KINDS`, and whether that kind lives in a namespace."""
        if kind in CORE_KINDS:
            return getattr(self.core(), f"{verb}_namespaced_{CORE_KINDS[kind]}"), True
        return getattr(self._rbac(), f"{verb}_{RBAC_KINDS[kind]}"), RBAC_KINDS[kind].startswith("namespaced_")

    def _call(self, what: str, fn: Any, *args: Any, missing_ok: bool = False, missing: str | None = None,
              **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``; an API refusal or an unreachable server is one :class:`KubernetesError`
        (``missing``: its message for a 404; ``missing_ok``: None for a 404)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(*args, _request_timeout=30, **kwargs)
        except ApiException as e:
            if missing_ok and e.status == 404:
                return None
            if missing is not None and e.status == 404:
                raise KubernetesError(f"kubernetes: {missing}") from None
            raise KubernetesError(f"kubernetes: {what}: {e.status} {_api_message(e)}") from None
        except (HTTPError, OSError) as e:
            raise KubernetesError(f"kubernetes: {what}: cannot reach the API server ({type(e).__name__})") from None

    # --- submission -----------------------------------------------------------------------------------------

    def submit(self, app: ManifestConfig | AppDef, cfg: dict | None = None) -> str:
        """Create the objects of ``app`` (a :class:`ManifestConfig`); the handle. An ``AppDef`` is submitted
        through TorchX's ``kubernetes`` scheduler instead."""
        if not isinstance(app, ManifestConfig):
            return super().submit(app, cfg)
        objects = manifests(app)
        self._check_exists(app)
        created: list[dict] = []
        try:
            for obj in objects:
                self._create(obj)
                created.append(obj)
        except KubernetesError:
            for obj in reversed(created):
                self._delete(obj["kind"], obj["metadata"]["name"], app.namespace)
            raise
        return f"kubernetes://{app.namespace}/{app.variant}/{app.name}"

    def _check_exists(self, cfg: ManifestConfig) -> None:
        core = self.core()
        if self._call(f"namespace {cfg.namespace}", core.read_namespace, cfg.namespace, missing_ok=True) is None:
            raise KubernetesError(f"kubernetes: unknown namespace {cfg.namespace!r}")
        if cfg.queue is not None and cfg.variant == "jobset":
            group, version = KUEUE
            if self._call(f"LocalQueue {cfg.queue}", self.custom().get_namespaced_custom_object, group, version,
                          cfg.namespace, "localqueues", cfg.queue, missing_ok=True) is None:
                raise KubernetesError(f"kubernetes: unknown Kueue LocalQueue {cfg.queue!r} in namespace {cfg.namespace!r}")
        if self._call(f"Secret {cfg.secret_name}", core.read_namespaced_secret, cfg.secret_name, cfg.namespace,
                      missing_ok=True) is None:
            raise KubernetesError(f"kubernetes: no Secret {cfg.secret_name!r} in {cfg.namespace!r}: create it with "
                                  f"kubectl -n {cfg.namespace} create secret generic {cfg.secret_name} "
                                  f"--from-literal={cfg.token_key}=$(hp token)")

    def _create(self, obj: dict) -> None:
        kind, name, ns = obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace")
        if kind in CUSTOM:
            group, version, plural = CUSTOM[kind]
            self._call(f"create {kind} {name}", self.custom().create_namespaced_custom_object, group, version, ns,
                       plural, obj, missing=f"the {kind} kind ({group}/{version}) is not installed in the cluster")
            return
        create, namespaced = self._typed("create", kind)
        self._call(f"create {kind} {name}", create, *([ns] if namespaced else []), obj)

    def _delete(self, kind: str, name: str, namespace: str) -> None:
        """Delete one object (its dependents in the background); gone already is fine."""
        if kind in CUSTOM:
            group, version, plural = CUSTOM[kind]
            self._call(f"delete {kind} {name}", self.custom().delete_namespaced_custom_object, group, version,
                       namespace, plural, name, propagation_policy="Background", missing_ok=True)
            return
        delete, namespaced = self._typed("delete", kind)
        self._call(f"delete {kind} {name}", delete, name, *([namespace] if namespaced else []), missing_ok=True)

    def cancel(self, handle: str) -> None:
        """Delete every object of the job (the workers first; the pods get their grace period), the watcher's
        RBAC objects last (the sidecar keeps reading while its pod stops; a job without them: 404, fine)."""
        namespace, variant, name = parse_handle(handle)
        if variant == "volcano":
            self._delete("Job", name, namespace)
        else:
            for js in (name, f"{name}-elastic"):
                self._delete("JobSet", js, namespace)
        for kind, obj in (("Pod", f"{name}-controller"), ("Service", f"{name}-controller"), ("ConfigMap", f"{name}-policy"),
                          *reversed(object_names(namespace, name))):
            self._delete(kind, obj, namespace)

    # --- state ----------------------------------------------------------------------------------------------

    def state(self, handle: str) -> str | None:
        """PENDING, RUNNING, SUSPENDED, SUCCEEDED or FAILED (the JobSet's conditions, the Volcano Job's phase);
        None once the object is gone."""
        namespace, variant, name = parse_handle(handle)
        kind = "Job" if variant == "volcano" else "JobSet"
        group, version, plural = CUSTOM[kind]
        obj = self._call(f"get {kind} {name}", self.custom().get_namespaced_custom_object, group, version, namespace,
                         plural, name, missing_ok=True)
        if obj is None:
            return None
        status = obj.get("status") or {}
        if variant == "volcano":
            return VOLCANO_PHASES.get((status.get("state") or {}).get("phase", "Pending"), "RUNNING")
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        for condition, state in (("Completed", "SUCCEEDED"), ("Failed", "FAILED"), ("Suspended", "SUSPENDED")):
            if conditions.get(condition) == "True":
                return state
        ready = sum(int(r.get("ready") or 0) + int(r.get("active") or 0) for r in status.get("replicatedJobsStatus") or [])
        return "RUNNING" if ready else "PENDING"

    def wait(self, handle: str, poll_s: float = 1.0):  # noqa: ANN201  (a state, not a TorchX AppStatus)
        """Block until the job ended; SUCCEEDED, FAILED, or None if it was deleted first."""
        while (state := self.state(handle)) is not None and state not in TERMINAL:
            time.sleep(poll_s)
        return state

    # --- hosts and capacity ---------------------------------------------------------------------------------

    def observe(self, job: str | None = None, nproc_per_node: int = 1) -> JobWatch:
        """The job's Pods, the Nodes and the namespace's Kueue Workloads, listed now and folded into a
        :class:`JobWatch` (as the ADDED events a watch starts with)."""
        job = job or self.job
        if job is None:
            raise KubernetesError("kubernetes: name the job (its hp.dev/job label; HP_K8S_JOB inside its pods)")
        names.dns_label(job, "the job name")
        core = self.core()
        if self._call(f"namespace {self.namespace}", core.read_namespace, self.namespace, missing_ok=True) is None:
            raise KubernetesError(f"kubernetes: unknown namespace {self.namespace!r}")
        watch = JobWatch(job, nproc_per_node)
        pods = self._call("list pods", core.list_namespaced_pod, self.namespace,
                          label_selector=f"{JOB_LABEL}={job},{ROLE_LABEL}=worker")
        nodes = self._call("list nodes", core.list_node)
        workloads = self._call("list workloads", self.custom().list_namespaced_custom_object, *KUEUE, self.namespace,
                               "workloads", missing_ok=True)  # no Kueue in the cluster: 404
        api = self.api_client()
        for kind, items in (("Node", nodes.items), ("Pod", pods.items)):
            for item in items:
                watch.feed({"type": "ADDED", "object": {"kind": kind, **api.sanitize_for_serialization(item)}})
        for item in (workloads or {}).get("items", []):
            watch.feed({"type": "ADDED", "object": {"kind": "Workload", **item}})
        return watch

    def hosts(self) -> list[str]:
        """The nodes of the job's ready worker pods; inside a worker pod with no job named, its own node
        (``HP_NODE_NAME``, from the downward API)."""
        if self.job is None and self._env.get("HP_NODE_NAME"):
            return [self._env["HP_NODE_NAME"]]
        return self.observe().hosts()

    def capacity(self, source: str | None = None) -> Capacity:
        """``source``: the job (default: this backend's). Hosts: its worker pods running and ready on ready
        nodes; ``preemption_requested``: a pod with ``DisruptionTarget``, or an evicted Workload."""
        return self.observe(source).capacity()

    def localqueues(self) -> list[str]:
        """The Kueue LocalQueues of the namespace (``kueue.x-k8s.io/queue-name`` values a job may use)."""
        found = self._call("list localqueues", self.custom().list_namespaced_custom_object, *KUEUE, self.namespace,
                           "localqueues", missing_ok=True)
        return sorted(q["metadata"]["name"] for q in (found or {}).get("items", []))


def parse_handle(handle: str) -> tuple[str, str, str]:
    """``kubernetes://NAMESPACE/VARIANT/NAME`` -> (namespace, variant, name), each checked."""
    prefix = "kubernetes://"
    parts = handle[len(prefix):].split("/") if isinstance(handle, str) and handle.startswith(prefix) else []
    if len(parts) != 3 or parts[1] not in VARIANTS:
        raise KubernetesError(f"kubernetes: {handle!r} is not a handle of this backend (kubernetes://NAMESPACE/"
                              f"{'|'.join(VARIANTS)}/NAME)")
    return names.dns_label(parts[0], "the handle's namespace"), parts[1], names.dns_label(parts[2], "the handle's name")


def _api_message(e: Any) -> str:
    import json

    try:
        message = json.loads(e.body or "{}").get("message") or e.reason
    except (ValueError, AttributeError):
        message = e.reason
    return str(message or "").splitlines()[0][:300] if message else ""


"""The parts of one hp job's Kubernetes objects, from one config: pure functions, no cluster needed.

:func:`hp.core.schedulers.k8s.objects.manifests` assembles them, in apply order; :class:`ManifestConfig` is
the config and its validation; the worker pod template, the controller pod and the JobSet are here,
the RBAC objects in :mod:`hp.core.schedulers.k8s.rbac` and the Volcano job in :mod:`hp.core.schedulers.k8s.volcano`.

A worker's ``--node-rank`` is its group's offset plus its index in the group: the Job controller writes
the index into the pod annotation ``batch.kubernetes.io/job-completion-index`` (Volcano:
``volcano.sh/task-index``), which the pod reads through the downward API (``HP_INDEX``). Each group is one
replicated job with ``replicas: 1`` so ``jobset.sigs.k8s.io/job-index`` is always 0 and plays no part.
The pod's uid (``HP_NODE_INCARNATION``, downward API too) is the agent's at join and the watcher's when it
reports the node failed: a report about a pod never hits the pod that replaced it under the same name.

Preemption: kube-scheduler preempts single elastic pods (lower PriorityClass); Kueue (``queue``) admits
and evicts whole workloads, one per JobSet, so with ``split_elastic`` the elastic group is a JobSet of its
own that Kueue can take back without touching the base group. A pod told to leave (SIGTERM) that left
cleanly exits 143, not 0: its index is not "succeeded", and the pod failure policy (``Ignore`` on the
``DisruptionTarget`` condition or exit code 143, never counted against ``backoffLimit``) makes the Job
create it again, pending until capacity returns, when it joins the running job.

The job token is never in a manifest: pods read ``HP_JOB_TOKEN`` from the Secret ``token_secret``, which
the user creates (``kubectl create secret generic NAME --from-literal=token=$(hp token)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import yaml

from hp.core.config import check_name
from hp.core.schedulers.k8s import names
from hp.core.schedulers.k8s.names import K8sConfigError, account_name

IMAGE_NAME = "hp"          # docker/Dockerfile's org.opencontainers.image.title
IMAGE_TAG = "0.1.0"        # its org.opencontainers.image.version (hp-core's version)
DEFAULT_IMAGE = f"{IMAGE_NAME}:{IMAGE_TAG}"
CONTROL_PORT = 29400
POLICY_DIR, POLICY_FILE = "/etc/hp/policy", "policy.yaml"
POLICY_PATH = f"{POLICY_DIR}/{POLICY_FILE}"
JOB_LABEL, ROLE_LABEL, GROUP_LABEL = "hp.dev/job", "hp.dev/role", "hp.dev/group"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
JOB_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
VOLCANO_INDEX_ANNOTATION = "volcano.sh/task-index"
RUN_AS_UID = 1000          # the image's non-root user
MAX_NAME = 40              # <name>-elastic-0-<index>-<5 random>: pod hostnames stay within 63 characters
BASE, ELASTIC = "base", "elastic"
VARIANTS = ("jobset", "volcano")
# POSIX sh: the node rank from the group's index; SIGTERM forwarded to `hp run`; a clean leave after
# SIGTERM exits 143, so the Job does not count the index as succeeded and creates the pod again.
WRAPPER = """: "${HP_INDEX:?HP_INDEX is not set: not a pod of an Indexed Job or Volcano task}"
term=0 pid=""
trap 'term=1; [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null' TERM
hp run --node-rank "$((HP_RANK_OFFSET + HP_INDEX))" "$@" &
pid=$!
if [ "$term" = 1 ]; then kill -TERM "$pid" 2>/dev/null; fi
wait "$pid"; rc=$?
while kill -0 "$pid" 2>/dev/null; do wait "$pid"; rc=$?; done
if [ "$term" = 1 ] && [ "$rc" = 0 ]; then rc=143; fi
exit "$rc"
"""


@dataclass
class ManifestConfig:
    """One hp job on Kubernetes. Every field's default is what ``hp k8s manifest`` uses."""

    name: str                                   # DNS-1123 label: every object is named after it
    entrypoint: str                             # the training script (or module, with ``module``) in the image
    args: list[str] = field(default_factory=list)
    module: bool = False
    namespace: str = "default"
    image: str = DEFAULT_IMAGE                  # docker/Dockerfile's image, pushed where the cluster pulls from
    variant: str = "jobset"                     # or "volcano"
    min_nodes: int = 1                          # the base group: pods of the high PriorityClass
    max_nodes: int | None = None                # elastic: the elastic group has max_nodes - min_nodes pods
    scaling_policy: str | None = None           # elastic: the ScalingPolicy YAML text (not a path)
    nproc_per_node: int = 1
    gpus_per_node: int = 0                      # nvidia.com/gpu per worker pod
    cpu: str = "4"
    memory: str = "32Gi"                        # the limit, which /dev/shm (a memory emptyDir) counts against
    shm_size: str | None = None                 # None: from ckpt_state_gib, else 2Gi
    ckpt_state_gib: float | None = None         # one node's checkpoint state (GiB), to size the memory tier
    ckpt_replicas: int = 1                      # hp-tiered-ckpt's --replicas
    grace_period_s: float = 30.0                # hp run --grace-period
    grace_margin_s: int = 15                    # terminationGracePeriodSeconds = grace + margin
    heartbeat_timeout_s: float = 30.0
    max_restarts: int = 0                       # JobSet failurePolicy.maxRestarts / Volcano maxRetry
    run_id: str | None = None                   # default: the name
    token_secret: str | None = None             # default: <name>-token
    token_key: str = "token"
    queue: str | None = None                    # Kueue LocalQueue (JobSet) or Volcano Queue
    workload_priority_class: str | None = None  # Kueue WorkloadPriorityClass of the (base) JobSet
    elastic_workload_priority_class: str | None = None  # of the elastic JobSet (split_elastic)
    split_elastic: bool = False                 # the elastic group as a JobSet of its own (own Kueue workload)
    base_priority_class: str = "hp-base"        # PriorityClass names (cluster objects the admin creates)
    elastic_priority_class: str = "hp-elastic"
    service_account: str | None = None          # the controller's and workers' (with watch: no RBAC generated)
    watch: bool = True                          # `hp k8s watch` beside the controller (and its RBAC objects)
    not_ready_grace_s: float = 10.0             # its wait before a NotReady node's pods count as failed
    node_selector: dict[str, str] = field(default_factory=dict)

    @property
    def elastic_nodes(self) -> int:
        return (self.max_nodes or self.min_nodes) - self.min_nodes

    @property
    def nnodes(self) -> str:
        return f"{self.min_nodes}:{self.max_nodes}" if self.max_nodes is not None else str(self.min_nodes)

    @property
    def secret_name(self) -> str:
        return self.token_secret or f"{self.name}-token"

    @property
    def controller_host(self) -> str:
        return f"{self.name}-controller.{self.namespace}.svc"

    @property
    def termination_grace_s(self) -> int:
        return math.ceil(self.grace_period_s) + self.grace_margin_s

    @property
    def shm(self) -> str:
        """The memory tier: two slots in rotation (hp-tiered-ckpt keeps one complete step while the next is
        written) of this node's state and of the ``ckpt_replicas`` peers' it holds, plus 1 GiB for NCCL and
        data loaders."""
        if self.shm_size is not None:
            return self.shm_size
        if self.ckpt_state_gib is None:
            return "2Gi"
        return f"{math.ceil(self.ckpt_state_gib * 2 * (1 + self.ckpt_replicas)) + 1}Gi"

    def validate(self) -> ManifestConfig:
        """Raise :class:`K8sConfigError` (one line) for anything the API server or hp would refuse."""
        names.dns_label(self.name, "--name", MAX_NAME)
        names.dns_label(self.namespace, "--namespace")
        names.image(self.image)
        if self.variant not in VARIANTS:
            raise K8sConfigError(f"--variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")
        if not isinstance(self.entrypoint, str) or not self.entrypoint.strip() or "\0" in self.entrypoint:
            raise K8sConfigError(f"the entrypoint must be a non-empty script or module, got {self.entrypoint!r}")
        if any(not isinstance(a, str) or "\0" in a for a in self.args):
            raise K8sConfigError("the training script's arguments must be strings without NUL")
        _int(self.min_nodes, "--nnodes MIN", 1)
        if self.max_nodes is not None:
            _int(self.max_nodes, "--nnodes MAX", self.min_nodes)
            if self.scaling_policy is None:
                raise K8sConfigError("--nnodes MIN:MAX makes an elastic job: give its --scaling-policy FILE")
            _policy(self.scaling_policy)
        elif self.split_elastic:
            raise K8sConfigError("--split-elastic needs an elastic job (--nnodes MIN:MAX)")
        _int(self.nproc_per_node, "--nproc-per-node", 1)
        _int(self.gpus_per_node, "--gpus-per-node", 0)
        _int(self.ckpt_replicas, "--ckpt-replicas", 0)
        _int(self.grace_margin_s, "--grace-margin", 0)
        _int(self.max_restarts, "--max-restarts", 0)
        for value, what in ((self.grace_period_s, "--grace-period"), (self.heartbeat_timeout_s, "--heartbeat-timeout")):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
                raise K8sConfigError(f"{what} must be in (0, 86400] seconds, got {value!r}")
        if not isinstance(self.watch, bool):
            raise K8sConfigError(f"watch must be true or false, got {self.watch!r}")
        value = self.not_ready_grace_s
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
            raise K8sConfigError(f"--not-ready-grace must be in (0, 3600] seconds, got {value!r}")
        if self.ckpt_state_gib is not None and (not isinstance(self.ckpt_state_gib, (int, float))
                                                or not 0 < self.ckpt_state_gib <= 1 << 20):
            raise K8sConfigError(f"--ckpt-state-gib must be > 0 and at most {1 << 20} (1 PiB), got {self.ckpt_state_gib!r}")
        names.quantity(self.cpu, "--cpu")
        names.quantity(self.memory, "--memory")
        names.quantity(self.shm, "--shm-size")
        if names.to_number(self.shm) >= names.to_number(self.memory):
            raise K8sConfigError(f"/dev/shm ({self.shm}) counts against the pod's memory limit and must be below "
                                 f"--memory ({self.memory})")
        check_name(self.run_id or self.name, "--run-id")
        names.dns_subdomain(self.secret_name, "--token-secret")
        names.secret_key(self.token_key, "--token-key")
        for value, what in ((self.base_priority_class, "--base-priority-class"),
                            (self.elastic_priority_class, "--elastic-priority-class")):
            names.dns_subdomain(value, what)
        for value, what in ((self.queue, "--queue"), (self.workload_priority_class, "--workload-priority-class"),
                            (self.elastic_workload_priority_class, "--elastic-workload-priority-class"),
                            (self.service_account, "--service-account")):
            if value is not None:
                names.dns_subdomain(value, what)
                names.label_value(value, what)
        if self.variant == "volcano" and (self.split_elastic or self.workload_priority_class
                                          or self.elastic_workload_priority_class):
            raise K8sConfigError("--split-elastic and the workload priority classes are Kueue's: not with --variant volcano")
        for key, value in self.node_selector.items():
            names.label_value(value, f"--node-selector {key}")
            names.dns_subdomain(key.rpartition("/")[0] or "x", f"--node-selector key {key!r}")
            names.label_value(key.rpartition("/")[2], f"--node-selector key {key!r}")
        return self


def _int(value: object, what: str, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 100_000:
        raise K8sConfigError(f"{what} must be an integer >= {low}, got {value!r}")


def _policy(text: object) -> None:
    try:
        doc = yaml.safe_load(text) if isinstance(text, str) else None
    except yaml.YAMLError as e:
        raise K8sConfigError(f"--scaling-policy is not YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(doc, dict):
        raise K8sConfigError("--scaling-policy must be a YAML mapping (min_replicas, max_replicas, ...)")


def k8s_object(api_version: str, kind: str, name: str, cfg: ManifestConfig, body: dict[str, Any]) -> dict[str, Any]:
    meta = {"name": name, "namespace": cfg.namespace, "labels": {JOB_LABEL: cfg.name}}
    return {"apiVersion": api_version, "kind": kind, "metadata": meta, **body}


def jobset(cfg: ManifestConfig, groups: list[str], name: str, workload_priority: str | None) -> dict[str, Any]:
    """A JobSet of ``groups``; it succeeds when its first group's Job has (the base group ends the job)."""
    replicated = [{"name": g, "replicas": 1, "template": {"metadata": {"labels": {JOB_LABEL: cfg.name, GROUP_LABEL: g}},
                                                          "spec": _job_spec(cfg, g)}} for g in groups]
    js = k8s_object("jobset.x-k8s.io/v1alpha2", "JobSet", name, cfg, {"spec": {
        "replicatedJobs": replicated,
        "successPolicy": {"operator": "All", "targetReplicatedJobs": [groups[0]]},
        "failurePolicy": _failure_policy(cfg, groups),
    }})
    if cfg.queue is not None:
        js["metadata"]["labels"][KUEUE_QUEUE_LABEL] = cfg.queue
        if workload_priority is not None:
            js["metadata"]["labels"][KUEUE_PRIORITY_LABEL] = workload_priority
    return js


def _failure_policy(cfg: ManifestConfig, groups: list[str]) -> dict[str, Any]:
    """A failed elastic Job (past its backoffLimit) is created again alone; any other failure restarts the
    JobSet, at most ``max_restarts`` times."""
    policy: dict[str, Any] = {"maxRestarts": cfg.max_restarts}
    if ELASTIC in groups:
        policy["rules"] = [{"name": "restart-elastic", "action": "RestartJobAndIgnoreMaxRestarts",
                            "targetReplicatedJobs": [ELASTIC]}]
    return policy


def group_size(cfg: ManifestConfig, group: str) -> int:
    return cfg.min_nodes if group == BASE else cfg.elastic_nodes


def group_offset(cfg: ManifestConfig, group: str) -> int:
    return 0 if group == BASE else cfg.min_nodes


def _job_spec(cfg: ManifestConfig, group: str) -> dict[str, Any]:
    n = group_size(cfg, group)
    return {
        "parallelism": n, "completions": n, "completionMode": "Indexed", "backoffLimit": max(1, cfg.max_restarts) * n,
        "podFailurePolicy": {"rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "Ignore", "onExitCodes": {"containerName": "hp", "operator": "In", "values": [143]}},
        ]},
        "template": worker_pod_template(cfg, group, JOB_INDEX_ANNOTATION),
    }


def hp_run_args(cfg: ManifestConfig) -> list[str]:
    """``hp run``'s arguments after ``--node-rank`` (which the wrapper computes from the pod's index)."""
    args = ["--nnodes", cfg.nnodes, "--nproc-per-node", str(cfg.nproc_per_node),
            "--rdzv-endpoint", f"{cfg.controller_host}:{CONTROL_PORT}", "--external-controller",
            "--run-id", cfg.run_id or cfg.name, "--grace-period", f"{cfg.grace_period_s:g}",
            "--heartbeat-timeout", f"{cfg.heartbeat_timeout_s:g}"]
    if cfg.scaling_policy is not None:
        args += ["--scaling-policy", POLICY_PATH]
    if cfg.module:
        args.append("-m")
    return [*args, cfg.entrypoint, *cfg.args]


def worker_pod_template(cfg: ManifestConfig, group: str, index_annotation: str) -> dict[str, Any]:
    env = [{"name": "HP_RANK_OFFSET", "value": str(group_offset(cfg, group))},
           {"name": "HP_INDEX", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{index_annotation}']"}}},
           {"name": "HP_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
           {"name": "HP_K8S_JOB", "value": cfg.name},  # the backend's default job (no API token here)
           {"name": "HP_K8S_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
           {"name": "HP_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "HP_NODE_INCARNATION", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}]
    container = _container(cfg, ["/bin/sh", "-c", WRAPPER, "hp-run", *hp_run_args(cfg)], env, worker=True)
    spec = _pod_spec(cfg, container, cfg.base_priority_class if group == BASE else cfg.elastic_priority_class, "Never")
    spec["automountServiceAccountToken"] = False  # workers never call the API: no token to steal there
    spec["volumes"].append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": cfg.shm}})
    return {"metadata": {"labels": {JOB_LABEL: cfg.name, ROLE_LABEL: "worker", GROUP_LABEL: group}}, "spec": spec}


def controller_spec(cfg: ManifestConfig) -> dict[str, Any]:
    args = ["controller", "--host", "$(HP_POD_IP)", "--port", str(CONTROL_PORT), "--nnodes", cfg.nnodes,
            "--heartbeat-timeout", f"{cfg.heartbeat_timeout_s:g}", "--max-restarts", str(cfg.max_restarts)]
    if cfg.scaling_policy is not None:
        args += ["--scaling-policy", POLICY_PATH]
    env = [{"name": "HP_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    container = _container(cfg, ["hp", *args], env, worker=False)
    container["readinessProbe"] = {"tcpSocket": {"port": CONTROL_PORT}, "periodSeconds": 5}
    spec = _pod_spec(cfg, container, cfg.base_priority_class, "OnFailure")
    if cfg.watch:
        spec["initContainers"] = [_watch_container(cfg)]
        spec.setdefault("serviceAccountName", account_name(cfg.name))  # the user's, else rbac.py's
    return spec


def watch_args(cfg: ManifestConfig) -> list[str]:
    """The sidecar's command after ``hp``: ``hp k8s watch`` of this job, telling the controller of the same
    pod (at the pod IP it binds) what the job's pods, the nodes and Kueue's workloads do."""
    return ["k8s", "watch", "--job", cfg.name, "--namespace", cfg.namespace,
            "--controller", f"$(HP_POD_IP):{CONTROL_PORT}", "--nproc-per-node", str(cfg.nproc_per_node),
            "--not-ready-grace", f"{cfg.not_ready_grace_s:g}"]


def _watch_container(cfg: ManifestConfig) -> dict[str, Any]:
    """The native sidecar (``restartPolicy: Always``): the controller's image, user and token, small
    resources, no port and no volume."""
    env = [{"name": "HP_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    container = _container(cfg, ["hp", *watch_args(cfg)], env, worker=False)
    del container["name"], container["ports"], container["volumeMounts"]
    small = {"cpu": "100m", "memory": "256Mi"}
    return {"name": "watch", "restartPolicy": "Always", **container,
            "resources": {"requests": dict(small), "limits": dict(small)}}


def _container(cfg: ManifestConfig, command: list[str], env: list[dict], worker: bool) -> dict[str, Any]:
    env = [*env, {"name": "HP_JOB_TOKEN",
                  "valueFrom": {"secretKeyRef": {"name": cfg.secret_name, "key": cfg.token_key}}}]
    if worker:
        requests = {"cpu": cfg.cpu, "memory": cfg.memory}
        if cfg.gpus_per_node:
            requests["nvidia.com/gpu"] = str(cfg.gpus_per_node)
    else:
        requests = {"cpu": "1", "memory": "2Gi"}
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}] if worker else []
    if cfg.scaling_policy is not None:
        mounts.append({"name": "policy", "mountPath": POLICY_DIR, "readOnly": True})
    container = {"name": "hp", "image": cfg.image, "imagePullPolicy": "IfNotPresent", "command": command, "env": env,
                 "resources": {"requests": dict(requests), "limits": dict(requests)}, "volumeMounts": mounts,
                 "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_UID, "allowPrivilegeEscalation": False,
                                     "capabilities": {"drop": ["ALL"]}}}
    if not worker:
        container["ports"] = [{"name": "control", "containerPort": CONTROL_PORT, "protocol": "TCP"}]
    return container


def _pod_spec(cfg: ManifestConfig, container: dict, priority_class: str, restart: str) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = []
    if cfg.scaling_policy is not None:
        volumes.append({"name": "policy", "configMap": {"name": f"{cfg.name}-policy"}})
    spec: dict[str, Any] = {"restartPolicy": restart, "priorityClassName": priority_class,
                            "terminationGracePeriodSeconds": cfg.termination_grace_s,
                            "containers": [container], "volumes": volumes,
                            "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_UID, "fsGroup": RUN_AS_UID}}
    if cfg.service_account is not None:
        spec["serviceAccountName"] = cfg.service_account
    if cfg.node_selector:
        spec["nodeSelector"] = dict(cfg.node_selector)
    return spec

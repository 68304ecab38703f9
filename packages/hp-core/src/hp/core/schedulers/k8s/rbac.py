"""The RBAC objects of one hp job: what the controller pod's ``hp k8s watch`` sidecar may read, and nothing more.

The watcher lists and watches the job's Pods, the cluster's Nodes and the namespace's Kueue Workloads
(:class:`hp.core.schedulers.k8s.watch.JobWatch`'s three streams). :func:`rbac_objects` returns, in apply order, the
objects that allow it, for a job with ``watch`` on and no ``service_account``:

1. ``ServiceAccount <name>-watch``: the controller pod's ``serviceAccountName``. Worker pods mount no
   service account token (``automountServiceAccountToken: false``): they never call the API.
2. ``Role <name>-watch``: :data:`NAMESPACED_RULES` in the job's namespace (pods; Kueue's workloads).
3. ``RoleBinding <name>-watch``: that Role to that ServiceAccount.
4. ``ClusterRole hp-watch-<namespace>.<name>``: :data:`CLUSTER_RULES` (nodes are cluster-scoped, so only a
   ClusterRole can grant them). The ``.`` (never in a namespace or a job name) keeps the name of one job
   apart from another's: ``hp-watch-team-a-x`` would be both namespace ``team-a`` job ``x`` and
   namespace ``team`` job ``a-x``, and cancelling one would delete the other's access.
5. ``ClusterRoleBinding hp-watch-<namespace>.<name>``: that ClusterRole to that ServiceAccount.

A service account the user names (``service_account``, ``--service-account``) gets no object: the
cluster's admin grants it what the watcher needs, ``get``, ``list`` and ``watch`` on ``pods`` (core group)
and ``workloads`` (``kueue.x-k8s.io``) in the job's namespace, and on ``nodes`` (core group) cluster-wide;
without them the watcher's requests are refused (403).
"""

from __future__ import annotations

from typing import Any

from hp.core.schedulers.k8s import names
from hp.core.schedulers.k8s.names import account_name
from hp.core.schedulers.k8s.manifest import JOB_LABEL, ManifestConfig

RBAC_API = "rbac.authorization.k8s.io"
NAMESPACE_LABEL = "hp.dev/namespace"  # on the cluster-scoped objects: which namespace's job they serve
VERBS = ("get", "list", "watch")  # of every rule: the watcher only reads
NAMESPACED_RULES = (("", "pods"), ("kueue.x-k8s.io", "workloads"))  # (apiGroup, resource)
CLUSTER_RULES = (("", "nodes"),)


def cluster_name(namespace: str, name: str) -> str:
    """The ClusterRole and ClusterRoleBinding of job ``name`` in ``namespace``: a DNS-1123 subdomain of at
    most 9 + 63 + 1 + 40 characters (checked anyway: the API server would refuse anything else)."""
    return names.dns_subdomain(f"hp-watch-{namespace}.{name}", "the watcher's ClusterRole name")


def object_names(namespace: str, name: str) -> list[tuple[str, str]]:
    """(kind, name) of :func:`rbac_objects`, in apply order: what a job's handle is enough to delete."""
    own, cluster = account_name(name), cluster_name(namespace, name)
    return [("ServiceAccount", own), ("Role", own), ("RoleBinding", own),
            ("ClusterRole", cluster), ("ClusterRoleBinding", cluster)]


def rbac_objects(cfg: ManifestConfig) -> list[dict[str, Any]]:
    """The objects of the module docstring, for ``cfg`` (already validated)."""
    own, cluster = account_name(cfg.name), cluster_name(cfg.namespace, cfg.name)
    return [
        _object("v1", "ServiceAccount", own, cfg, {}),
        _object(f"{RBAC_API}/v1", "Role", own, cfg, {"rules": _rules(NAMESPACED_RULES)}),
        _object(f"{RBAC_API}/v1", "RoleBinding", own, cfg, _binding(cfg, "Role", own)),
        _object(f"{RBAC_API}/v1", "ClusterRole", cluster, cfg, {"rules": _rules(CLUSTER_RULES)}, namespaced=False),
        _object(f"{RBAC_API}/v1", "ClusterRoleBinding", cluster, cfg, _binding(cfg, "ClusterRole", cluster),
                namespaced=False),
    ]


def _rules(rules: tuple[tuple[str, str], ...]) -> list[dict[str, Any]]:
    """Fresh lists in each rule: no object shares one with another (nor does the YAML show anchors)."""
    return [{"apiGroups": [group], "resources": [resource], "verbs": list(VERBS)} for group, resource in rules]


def _binding(cfg: ManifestConfig, kind: str, role: str) -> dict[str, Any]:
    """``role`` (a ``kind``) to the watcher's ServiceAccount."""
    return {"roleRef": {"apiGroup": RBAC_API, "kind": kind, "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": account_name(cfg.name), "namespace": cfg.namespace}]}


def _object(api_version: str, kind: str, name: str, cfg: ManifestConfig, body: dict[str, Any],
            namespaced: bool = True) -> dict[str, Any]:
    """One object; a cluster-scoped one has no namespace, and says in a label which one it serves."""
    meta: dict[str, Any] = {"name": name, "namespace": cfg.namespace, "labels": {JOB_LABEL: cfg.name}}
    if not namespaced:
        del meta["namespace"]
        meta["labels"][NAMESPACE_LABEL] = cfg.namespace
    return {"apiVersion": api_version, "kind": kind, "metadata": meta, **body}

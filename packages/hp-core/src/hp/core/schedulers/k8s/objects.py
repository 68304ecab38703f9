"""The Kubernetes objects of one hp job, from one config: a pure function, no cluster needed.

:func:`manifests` returns, in the order to apply them:

1. ``ConfigMap <name>-policy`` (elastic jobs): the ``ScalingPolicy`` YAML, mounted at :data:`hp.core.schedulers.k8s.manifest.POLICY_PATH`.
2. ``watch`` on, no ``service_account``: the watcher's ``ServiceAccount``, ``Role``, ``RoleBinding``,
   ``ClusterRole`` and ``ClusterRoleBinding`` (:mod:`hp.core.schedulers.k8s.rbac`, which says what a named one needs).
3. ``Service <name>-controller``: headless, so its DNS name resolves to the controller pod's IP. The
   controller tells agents its store's address (the ``--host`` it binds, the pod IP) and a random port:
   only a headless Service reaches that port.
4. ``Pod <name>-controller``: ``hp controller`` (``restartPolicy: OnFailure``), so every worker pod may
   leave. A bare pod, not a Deployment: it exits 0 when the job succeeded and must stay done; a
   controller restarted elsewhere would hold none of the job's state anyway (that is ``--store etcd``).
   With ``watch``, ``hp k8s watch`` (:func:`hp.core.schedulers.k8s.manifest.watch_args`: pod, node and Kueue events to the controller)
   runs beside it as a native sidecar (``restartPolicy: Always``, Kubernetes >= 1.29), stopped when
   ``hp controller`` ends, so the pod still completes.
5. The workers: a ``JobSet`` (jobset.x-k8s.io/v1alpha2) with two replicated jobs, ``base`` (``min_nodes``
   pods, the high PriorityClass) and ``elastic`` (``max_nodes - min_nodes`` pods, the low one), each one
   Indexed ``batch/v1`` Job; or, with ``variant="volcano"``, one Volcano ``Job`` (batch.volcano.sh/v1alpha1)
   with the two groups as tasks, gang-scheduled at ``minAvailable = min_nodes``.

The parts and what they mean: :mod:`hp.core.schedulers.k8s.manifest`.
"""

from __future__ import annotations

from typing import Any

from hp.core.schedulers.k8s.manifest import (BASE, CONTROL_PORT, ELASTIC, JOB_LABEL, POLICY_FILE, ROLE_LABEL, ManifestConfig,
                                             controller_spec, jobset, k8s_object)
from hp.core.schedulers.k8s.rbac import rbac_objects
from hp.core.schedulers.k8s.volcano import volcano_job


def manifests(cfg: ManifestConfig) -> list[dict[str, Any]]:
    """Every object of the job, in apply order (see the module docstring). Validates ``cfg`` first."""
    cfg.validate()
    out: list[dict[str, Any]] = []
    if cfg.scaling_policy is not None:
        out.append(k8s_object("v1", "ConfigMap", f"{cfg.name}-policy", cfg, {"data": {POLICY_FILE: cfg.scaling_policy}}))
    if cfg.watch and cfg.service_account is None:
        out += rbac_objects(cfg)
    out.append(k8s_object("v1", "Service", f"{cfg.name}-controller", cfg, {"spec": {
        "clusterIP": "None", "publishNotReadyAddresses": True,
        "selector": {JOB_LABEL: cfg.name, ROLE_LABEL: "controller"},
        "ports": [{"name": "control", "port": CONTROL_PORT, "targetPort": CONTROL_PORT, "protocol": "TCP"}]}}))
    controller = k8s_object("v1", "Pod", f"{cfg.name}-controller", cfg, {"spec": controller_spec(cfg)})
    controller["metadata"]["labels"][ROLE_LABEL] = "controller"
    out.append(controller)
    if cfg.variant == "volcano":
        out.append(volcano_job(cfg))
    elif cfg.split_elastic:
        out.append(jobset(cfg, [BASE], cfg.name, cfg.workload_priority_class))
        out.append(jobset(cfg, [ELASTIC], f"{cfg.name}-elastic", cfg.elastic_workload_priority_class))
    else:
        out.append(jobset(cfg, [BASE, ELASTIC] if cfg.elastic_nodes else [BASE], cfg.name, cfg.workload_priority_class))
    return out

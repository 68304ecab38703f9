"""The worker groups as one Volcano ``Job`` (batch.volcano.sh/v1alpha1): the variant for clusters that
schedule with Volcano instead of kube-scheduler + Kueue.

Volcano gang-schedules the job at ``minAvailable = min_nodes`` (the ``base`` task); the ``elastic`` task's
pods start as capacity allows. Volcano writes each pod's index in its task into the annotation
``volcano.sh/task-index`` (set for every pod, no ``env`` plugin needed), read through the downward API
like a Job's completion index. Policies: an evicted or failed elastic pod is recreated alone
(``RestartPod``); the base task below its minimum restarts the job (hp resumes from its checkpoint).
``queue`` is a Volcano Queue here, not a Kueue LocalQueue.
"""

from __future__ import annotations

from typing import Any

from hp.core.schedulers.k8s.manifest import (
    BASE, ELASTIC, JOB_LABEL, VOLCANO_INDEX_ANNOTATION, ManifestConfig, group_size, worker_pod_template,
)


def volcano_job(cfg: ManifestConfig) -> dict[str, Any]:
    tasks = []
    for group in (BASE, ELASTIC) if cfg.elastic_nodes else (BASE,):
        n = group_size(cfg, group)
        policies = ([{"events": ["PodEvicted", "PodFailed"], "action": "RestartPod"}] if group == ELASTIC
                    else [{"event": "PodEvicted", "action": "RestartJob"}, {"event": "PodFailed", "action": "RestartJob"}])
        tasks.append({"name": group, "replicas": n, "minAvailable": n if group == BASE else 0,
                      "template": worker_pod_template(cfg, group, VOLCANO_INDEX_ANNOTATION), "policies": policies})
    return {
        "apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job",
        "metadata": {"name": cfg.name, "namespace": cfg.namespace, "labels": {JOB_LABEL: cfg.name}},
        "spec": {"schedulerName": "volcano", "minAvailable": cfg.min_nodes, "maxRetry": max(1, cfg.max_restarts),
                 "queue": cfg.queue or "default", "priorityClassName": cfg.base_priority_class, "tasks": tasks},
    }

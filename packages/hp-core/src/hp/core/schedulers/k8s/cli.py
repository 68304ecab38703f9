"""``hp k8s manifest``: print an hp job's Kubernetes objects (a YAML stream, or JSON), from flags.

Nothing is sent anywhere and nothing is written but stdout: apply the output with ``kubectl apply -f -``
(or submit it with :class:`hp.core.schedulers.k8s.backend.KubernetesScheduler`). Bad input is one line on stderr and
exit 2, with nothing on stdout. The job token is never printed: the pods read it from a Secret, and the
``kubectl`` line that creates it goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from hp.core.errors import UsageError
from hp.core.schedulers.k8s import watch_cli
from hp.core.schedulers.k8s.manifest import DEFAULT_IMAGE, VARIANTS, ManifestConfig
from hp.core.schedulers.k8s.objects import manifests


def add_parser(sub: argparse._SubParsersAction) -> None:
    k8s = sub.add_parser("k8s", help="run hp jobs on Kubernetes (JobSet or Volcano, Kueue quotas)")
    commands = k8s.add_subparsers(title="k8s commands", metavar="COMMAND", required=True)
    p = commands.add_parser("manifest", help="print the job's Kubernetes objects (YAML stream; --json for JSON)")
    a = p.add_argument
    a("--name", required=True, help="the job: every object's name starts with it (DNS-1123 label, <= 40 characters)")
    a("--namespace", default="default")
    a("--image", default=DEFAULT_IMAGE, help=f"the hp image (docker/Dockerfile) as the cluster pulls it (default {DEFAULT_IMAGE})")
    a("--variant", choices=VARIANTS, default="jobset", help="the workers as a JobSet (default) or a Volcano Job")
    a("--nnodes", default="1", help="worker pods: N, or MIN:MAX for an elastic job (MIN in the base group, the rest "
                                    "in the elastic group; needs --scaling-policy)")
    a("--scaling-policy", default=None, metavar="FILE", help="elastic: the ScalingPolicy YAML, put in a ConfigMap")
    a("--nproc-per-node", type=int, default=1, help="hp run --nproc-per-node")
    a("--gpus-per-node", type=int, default=0, help="nvidia.com/gpu per worker pod")
    a("--cpu", default="4", help="CPU per worker pod (a quantity)")
    a("--memory", default="32Gi", help="memory limit per worker pod (includes /dev/shm)")
    a("--shm-size", default=None, help="/dev/shm size (default: from --ckpt-state-gib, else 2Gi)")
    a("--ckpt-state-gib", type=float, default=None, help="one node's checkpoint state in GiB: sizes the memory tier")
    a("--ckpt-replicas", type=int, default=1, help="hp-tiered-ckpt --replicas (memory-tier copies held for peers)")
    a("--grace-period", type=float, default=30.0, help="hp run --grace-period (seconds)")
    a("--grace-margin", type=int, default=15, help="terminationGracePeriodSeconds = grace period + this")
    a("--heartbeat-timeout", type=float, default=30.0)
    a("--max-restarts", type=int, default=0, help="JobSet failurePolicy.maxRestarts / Volcano maxRetry")
    a("--run-id", default=None, help="hp run --run-id (default: --name)")
    a("--token-secret", default=None, help="the Secret holding the job token (default: NAME-token)")
    a("--token-key", default="token", help="its key")
    a("--queue", default=None, help="Kueue LocalQueue (JobSet) or Volcano Queue")
    a("--workload-priority-class", default=None, help="Kueue WorkloadPriorityClass (kueue.x-k8s.io/priority-class)")
    a("--elastic-workload-priority-class", default=None, help="the elastic JobSet's (with --split-elastic)")
    a("--split-elastic", action="store_true", help="the elastic group as a JobSet of its own: Kueue can evict it alone")
    a("--base-priority-class", default="hp-base", help="PriorityClass of the controller and the base group")
    a("--elastic-priority-class", default="hp-elastic", help="PriorityClass of the elastic group (lower)")
    a("--service-account", default=None, help="the pods' service account; with the watcher, the cluster's admin "
                                                "gives it its rules (hp.core.schedulers.k8s.rbac) and no RBAC object is printed")
    a("--no-watch", action="store_true", help="no `hp k8s watch` sidecar beside the controller, and no RBAC objects: "
                                              "the job learns of lost pods from heartbeats alone")
    a("--not-ready-grace", type=float, default=10.0, metavar="SECONDS",
      help="the watcher's wait before a NotReady node's pods count as failed (default 10)")
    a("--node-selector", action="append", default=[], metavar="KEY=VALUE", help="repeatable")
    a("--json", action="store_true", help="print a JSON list instead of a YAML stream")
    a("-m", "--module", action="store_true", help="the entrypoint is a Python module")
    a("entrypoint", help="the training script (or module), as a path inside the image")
    a("args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(handler=_manifest)
    watch_cli.add_parser(commands)


def config_from_args(args: argparse.Namespace) -> ManifestConfig:
    from hp.core.config import parse_nnodes

    low, high = parse_nnodes(args.nnodes)
    policy = None
    if args.scaling_policy is not None:
        from hp.core.plugins import load_scaler

        load_scaler(args.scaling_policy)  # the same check as `hp run --scaling-policy`: one line if bad
        try:
            with open(args.scaling_policy, encoding="utf-8") as f:
                policy = f.read(1 << 20)
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--scaling-policy {args.scaling_policy}: {getattr(e, 'strerror', None) or e}") from None
    selector = {}
    for item in args.node_selector:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--node-selector: expected KEY=VALUE with a non-empty KEY, got {item!r}")
        selector[key] = value
    return ManifestConfig(
        name=args.name, entrypoint=args.entrypoint, args=list(args.args), module=args.module, namespace=args.namespace,
        image=args.image, variant=args.variant, min_nodes=low, max_nodes=high, scaling_policy=policy,
        nproc_per_node=args.nproc_per_node, gpus_per_node=args.gpus_per_node, cpu=args.cpu, memory=args.memory,
        shm_size=args.shm_size, ckpt_state_gib=args.ckpt_state_gib, ckpt_replicas=args.ckpt_replicas,
        grace_period_s=args.grace_period, grace_margin_s=args.grace_margin, heartbeat_timeout_s=args.heartbeat_timeout,
        max_restarts=args.max_restarts, run_id=args.run_id, token_secret=args.token_secret, token_key=args.token_key,
        queue=args.queue, workload_priority_class=args.workload_priority_class,
        elastic_workload_priority_class=args.elastic_workload_priority_class, split_elastic=args.split_elastic,
        base_priority_class=args.base_priority_class, elastic_priority_class=args.elastic_priority_class,
        service_account=args.service_account, watch=not args.no_watch, not_ready_grace_s=args.not_ready_grace,
        node_selector=selector,
    )


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the policy, the pod's shell wrapper) as ``|`` blocks, readable in review."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def render(objects: list[dict], as_json: bool) -> str:
    if as_json:
        return json.dumps(objects, indent=2) + "\n"
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False, explicit_start=True)


def _manifest(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    text = render(manifests(cfg), args.json)  # everything is checked before anything is printed
    sys.stdout.write(text)
    sys.stdout.flush()
    print(f"hp k8s: the pods read the job token from Secret {cfg.secret_name!r} (key {cfg.token_key!r}); create it once:\n"
          f"  kubectl -n {cfg.namespace} create secret generic {cfg.secret_name} --from-literal={cfg.token_key}=$(hp token)",
          file=sys.stderr)
    return 0

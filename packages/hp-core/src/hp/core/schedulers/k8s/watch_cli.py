"""``hp k8s watch``: the controller pod's sidecar that acts on the job's Kubernetes events
(:mod:`hp.core.schedulers.k8s.operator`). Bad input is one line on stderr and exit 2, before any watch opens; SIGTERM
(the pod ending) stops it with exit 0."""

from __future__ import annotations

import argparse
import signal
import threading


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("watch", help="act on the job's pod, node and Kueue events (the controller pod's sidecar)")
    a = p.add_argument
    a("--job", required=True, help="the job's name (its pods' hp.dev/job label)")
    a("--namespace", default="default")
    a("--controller", required=True, metavar="HOST:PORT", help="hp controller's endpoint")
    a("--nproc-per-node", type=int, default=1, help="ranks per worker pod")
    a("--not-ready-grace", type=float, default=10.0, metavar="SECONDS",
      help="a node NotReady this long counts as failed (its pods' ranks are lost now)")
    a("--kubeconfig", default=None, help="default: the pod's service account, else $KUBECONFIG or ~/.kube/config")
    a("--context", default=None)
    a("--token-file", default=None, help="file holding the job token (default: $HP_JOB_TOKEN)")
    p.set_defaults(handler=_watch)


def _watch(args: argparse.Namespace) -> int:
    from hp.core.auth import read_token
    from hp.core.config import parse_endpoint
    from hp.core.errors import UsageError
    from hp.core.schedulers.k8s import names
    from hp.core.schedulers.k8s.backend import KubernetesScheduler
    from hp.core.schedulers.k8s.operator import Reactions, run
    from hp.core.node_failure import FailureReport

    names.dns_label(args.job, "--job")
    names.dns_label(args.namespace, "--namespace")
    endpoint = str(parse_endpoint(args.controller, "--controller"))
    if isinstance(args.nproc_per_node, bool) or args.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if not 0 <= args.not_ready_grace <= 3600:
        raise UsageError(f"--not-ready-grace must be in [0, 3600] seconds, got {args.not_ready_grace:g}")
    token = read_token(args, required=True)
    scheduler = KubernetesScheduler(namespace=args.namespace, job=args.job, kubeconfig=args.kubeconfig,
                                    context=args.context)
    scheduler.api_client()  # a bad kubeconfig is one line now, not a watch that keeps failing
    reactions = Reactions(FailureReport(endpoint, token).report_all)
    reactions.log(f"watching job {args.job} in {args.namespace}; failures go to the controller at {endpoint}")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    run(scheduler, args.job, reactions, args.nproc_per_node, args.not_ready_grace, stop)
    return 0

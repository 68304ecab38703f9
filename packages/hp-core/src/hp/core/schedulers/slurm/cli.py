"""``hp slurm``: run an elastic hp job on Slurm (:mod:`hp.core.schedulers.slurm.job`, :mod:`hp.core.schedulers.slurm.units`).

    hp slurm submit --nnodes 2:4 --scaling-policy policy.yaml --base-partition high --unit-partition low \\
        --job-dir /shared/jobs/run1 -- -m hp.elastic.demo.train --exact

``submit`` is what a user types, ``capacity`` what they ask (idle nodes, the QOS quota, preemption); ``base`` (the base job's batch step) and ``agent`` (one node's ``srun``
task: it becomes that node's ``hp run``) are what the generated scripts run.
"""

from __future__ import annotations

import argparse
import os
import uuid

from hp.core import auth
from hp.core.config import parse_endpoint, parse_nnodes
from hp.core.errors import UsageError
from hp.core.hookspecs import hookimpl


def _submit(args: argparse.Namespace) -> int:
    from hp.core.schedulers.slurm.backend import SlurmCli
    from hp.core.schedulers.slurm.job import SlurmJobSpec, submit

    low, high = parse_nnodes(args.nnodes)
    entrypoint = args.entrypoint[1:] if args.entrypoint[:1] == ["--"] else args.entrypoint
    run_id = args.run_id or uuid.uuid4().hex[:12]
    spec = SlurmJobSpec(
        entrypoint=entrypoint, job_dir=os.path.abspath(args.job_dir or f"hp-slurm-{run_id}"), min_nodes=low,
        max_nodes=high or low, nproc_per_node=args.nproc_per_node,
        scaling_policy=os.path.abspath(args.scaling_policy) if args.scaling_policy else None,
        base_partition=args.base_partition, unit_partition=args.unit_partition, port=args.port, run_id=run_id,
        grace_period_s=args.grace_period, run_flags=list(args.run_flag), sbatch_options=list(args.sbatch_option))
    token = auth.token_from_env()
    token = auth.check_token(token, f"${auth.TOKEN_ENV}") if token else auth.new_token()
    os.environ.pop(auth.TOKEN_ENV, None)  # sbatch exports this environment: the token goes by file only
    job_id = submit(spec.validate(), token, SlurmCli())
    print(f"hp slurm: submitted base job {job_id} (job dir {spec.job_dir}); units are submitted by it")
    return 0


def _base(args: argparse.Namespace) -> int:
    from hp.core.schedulers.slurm.backend import SlurmCli
    from hp.core.schedulers.slurm.job import SlurmJobSpec
    from hp.core.schedulers.slurm.units import run_base

    job_id, nodelist = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_JOB_NODELIST")
    if not job_id or not nodelist:
        raise UsageError("hp slurm base: not inside a Slurm job (SLURM_JOB_ID / SLURM_JOB_NODELIST unset)")
    return run_base(SlurmJobSpec.load(args.spec), SlurmCli(), job_id, nodelist)


def _agent(args: argparse.Namespace) -> int:
    from hp.core.schedulers.slurm.job import SlurmJobSpec, agent_argv

    spec = SlurmJobSpec.load(args.spec)
    parse_endpoint(args.endpoint)
    rank = args.node_rank
    if rank is None:
        node_id = os.environ.get("SLURM_NODEID", "")
        if not node_id.isdigit():
            raise UsageError("hp slurm agent: no --node-rank and no SLURM_NODEID (not an srun task)")
        rank = int(node_id) + args.node_rank_offset
    if not 0 <= rank < spec.max_nodes:
        raise UsageError(f"hp slurm agent: node rank {rank} outside 0..{spec.max_nodes - 1}")
    argv = agent_argv(spec, rank, args.endpoint, os.environ.get("SLURM_JOB_ID", "0"))
    os.execv(argv[0], argv)  # the srun task becomes the node's agent: Slurm's signals reach hp run
    return 1  # not reached


def _capacity(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from hp.core.config import check_name
    from hp.core.schedulers.slurm.backend import SlurmScheduler
    from hp.core.schedulers.slurm.job import job_name

    names = tuple(job_name(check_name(args.run_id, "--run-id"), slot) for slot in (None, *range(args.max_nodes))) \
        if args.run_id else ()
    cap = SlurmScheduler(job_names=names, qos=args.qos).capacity(args.partition)
    print(json.dumps(asdict(cap)) if args.json else
          f"{cap.hosts} node(s) of {cap.slots_per_host} CPUs; QOS quota: "
          f"{'none' if cap.quota_hosts is None else f'{cap.quota_hosts} node(s)'}; preemption pending: "
          f"{'yes' if cap.preemption_requested else 'no'}")
    return 0


def _add_slurm(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("slurm", help="run an elastic hp job on Slurm: a base allocation plus scaling units")
    verbs = p.add_subparsers(dest="slurm_verb", required=True)
    s = verbs.add_parser("submit", help="sbatch the base job; it keeps one unit job per slot above MIN")
    a = s.add_argument
    a("--nnodes", default="1", help="MIN:MAX nodes: MIN in the base job, one unit job per node above it")
    a("--nproc-per-node", type=int, default=1)
    a("--scaling-policy", default=None, metavar="FILE", help="the ScalingPolicy YAML (needed when MIN < MAX)")
    a("--base-partition", default=None, help="partition of the base job (high priority; default: the cluster's)")
    a("--unit-partition", default=None, help="partition of the scaling units (low priority, preemptible)")
    a("--port", type=int, default=29400, help="the controller's port on the base job's first node")
    a("--job-dir", default=None, help="the job's directory, on a file system every node sees "
                                      "(default ./hp-slurm-RUNID): spec, token (0600), logs")
    a("--run-id", default=None)
    a("--grace-period", type=float, default=30.0,
      help="hp run --grace-period: keep it below the unit partition's GraceTime")
    a("--run-flag", action="append", default=[], metavar="FLAG", help="one more `hp run` flag (repeatable)")
    a("--sbatch-option", action="append", default=[], metavar="OPT",
      help="one more sbatch option for the base and every unit, e.g. --sbatch-option=--gres=gpu:8")
    a("entrypoint", nargs=argparse.REMAINDER, help="-- then the training script and its arguments, as for hp run")
    s.set_defaults(handler=_submit)
    b = verbs.add_parser("base", help="(run by the base job) start the agents and keep the units")
    b.add_argument("spec")
    b.set_defaults(handler=_base)
    c = verbs.add_parser("capacity", help="nodes a job could use now: idle ones and its own, within its QOS quota")
    c.add_argument("--partition", default=None, help="default: the job's own (inside one), else the cluster's default")
    c.add_argument("--qos", default=None, help="whose quota applies (default: the job's, else SLURM_JOB_QOS)")
    c.add_argument("--run-id", default=None, help="an hp slurm job's run id: its base and units count as held")
    c.add_argument("--max-nodes", type=int, default=64, help="with --run-id: its unit slots to look for")
    c.add_argument("--json", action="store_true")
    c.set_defaults(handler=_capacity)
    g = verbs.add_parser("agent", help="(an srun task) become this node's hp run")
    g.add_argument("spec")
    g.add_argument("--endpoint", required=True, help="the controller's HOST:PORT")
    g.add_argument("--node-rank", type=int, default=None, help="default: SLURM_NODEID + --node-rank-offset")
    g.add_argument("--node-rank-offset", type=int, default=0, help="added to SLURM_NODEID (a step of the base "
                                                                    "that leaves out its first node)")
    g.set_defaults(handler=_agent)


@hookimpl
def hp_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    _add_slurm(subparsers)

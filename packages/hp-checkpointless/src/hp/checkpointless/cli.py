"""hp-checkpointless's sub-command: ``hp demo``."""

from __future__ import annotations

import argparse
import json

from hp.checkpointless.demo.workload import add_workload_args
from hp.checkpointless.faults import PHASES
from hp.core.errors import UsageError
from hp.core.hookspecs import hookimpl


def _demo(args: argparse.Namespace) -> int:
    from hp.checkpointless.demo.run import DemoConfig, format_table, run_demo
    from hp.core.plugins import get_backend

    if args.fault_rank is None:
        args.fault_rank = min(1, args.nproc - 1)
    if args.nproc < 1 or not 0 <= args.fault_rank < args.nproc:
        raise UsageError("--nproc must be >= 1 and --fault-rank in [0, nproc)")
    if args.nproc == 1 and args.fault != "exception":
        raise UsageError(f"--nproc 1 recovers only from --fault exception: a lone rank's {args.fault} leaves no "
                         "peer holding its state")
    if args.steps < 4 or args.spares < 0:
        raise UsageError("--steps must be >= 4 and --spares >= 0")
    get_backend("transport", args.transport).check_available()  # nccl without CUDA: one line, nothing started
    cfg = DemoConfig(fault=args.fault, phase=args.phase, steps=args.steps, fault_step=args.fault_step,
                     fault_rank=args.fault_rank, nproc=args.nproc, spares=args.spares,
                     model_size=args.model_size, hang_timeout_s=args.hang_timeout, log_dir=args.log_dir,
                     train_args=_train_args(args), transport=args.transport)
    result = run_demo(cfg)
    print(format_table(result))
    if result.get("error_tail"):
        print("\nlast output of the failed job:\n" + result["error_tail"])
    if args.json:
        print(json.dumps(result))
    # the demo's claim is a recovery that loses nothing: a job that diverged fails it like one that crashed
    return 0 if result["completed"] and result["bitwise_equal"] and result["state_equal"] else 1


def _train_args(args: argparse.Namespace) -> list[str]:
    """The demo job's flags for the kind of state it keeps."""
    if sum(bool(x) for x in (args.zero, args.fsdp, args.hsdp)) > 1:
        raise UsageError("--zero, --fsdp and --hsdp are alternatives: pick one")
    if args.hsdp and (args.hsdp < 2 or args.nproc % args.hsdp):
        raise UsageError(f"--hsdp R needs R >= 2 replica groups dividing --nproc ({args.nproc})")
    if args.hsdp:
        return ["--hsdp", str(args.hsdp)]
    return ["--zero"] if args.zero else ["--fsdp"] if args.fsdp else []


@hookimpl
def hp_forkserver_preload() -> list[str]:
    """What a script that uses hp's runtime imports (the modules behind this package's names): a forked
    worker or spare finds them imported (~1 CPU s each on the 2-core box)."""
    from hp.checkpointless import RUNTIME_MODULES

    return list(RUNTIME_MODULES)


@hookimpl
def hp_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="reference run vs the same job with a fault: recovery time, "
                                           "lost steps, bit-identical losses")
    p.add_argument("--fault", choices=("kill", "hang", "exception", "unhealthy"), default="kill")
    p.add_argument("--phase", choices=PHASES[:-1], default="allreduce", help="step phase the fault hits")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--fault-step", type=int, default=None, help="default: the middle of the run")
    p.add_argument("--fault-rank", type=int, default=None, help="default: 1 (0 with --nproc 1)")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--spares", type=int, default=1)
    add_workload_args(p, "model_size", choices=True)
    p.add_argument("--hang-timeout", type=float, default=2.0, help="seconds of silence before a hang is killed")
    p.add_argument("--zero", action="store_true",
                   help="shard the optimizer state (ZeroRedundancyOptimizer; shards replicated to a buddy rank)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the model with FSDP2 over every rank (shards and their gradients copied to a buddy rank)")
    p.add_argument("--hsdp", type=int, default=0, metavar="R",
                   help="HSDP: R replica groups, FSDP2 within each (a lost shard comes from its replica group)")
    p.add_argument("--transport", choices=("gloo", "nccl"), default="gloo",
                   help="nccl: one GPU per rank, the model and its state on cuda:LOCAL_RANK")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.set_defaults(handler=_demo)

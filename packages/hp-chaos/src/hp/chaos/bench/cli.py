"""``hp bench <benchmark>``: the one place the group and every benchmark's sub-command are registered.

A benchmark is a module of this package with ``add_arguments(parser)`` and ``run_cli(args)`` (listed in
:data:`MODULE_BENCHES`), or, for the ones that check their arguments against a config they import late
(``recovery``, ``goodput``, ``elastic``, ``all``), a pair of functions here. Nothing heavy is imported
while the parser is built (every ``hp`` invocation builds it): no torch, and the code of the distributions
a benchmark drives (hp-checkpointless, hp-elastic, hp-tiered-ckpt) only once it runs. Where one of them
is missing, its benchmarks stay listed and say in one line what to install.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable

from hp.core.errors import UsageError
from hp.core.hookspecs import hookimpl

SIZES_HELP = "tiny | small | 25m"


def _demo_bench(name: str, model_size: str):
    """The module of a benchmark that runs the demo job (hp-checkpointless and torch must be installed)."""
    try:
        module = importlib.import_module(f"hp.chaos.bench.{name}")
        from hp.checkpointless.demo.sizes import MODEL_SIZES
    except ImportError as e:
        raise UsageError(f"hp bench {name} needs hp-checkpointless and torch ({e}); "
                         "pip install packages/hp-checkpointless") from None
    if model_size not in MODEL_SIZES:
        raise UsageError(f"--model-size must be one of {sorted(MODEL_SIZES)}, got {model_size!r}")
    return module


def _recovery(args: argparse.Namespace) -> int:
    from hp.chaos.bench.meta import print_result

    bench = _demo_bench("recovery", args.model_size)
    from hp.chaos.bench import recovery_common as common

    if args.nproc < 2:
        raise UsageError("--nproc must be >= 2 (rank 1 is the one killed)")
    if args.ckpt_every < 1 or args.corpus_mb < 1 or (args.vocab is not None and args.vocab < 2) \
            or args.torchft_heartbeat_timeout_ms < 1:
        raise UsageError("--ckpt-every, --corpus-mb and --torchft-heartbeat-timeout-ms must be >= 1, --vocab >= 2")
    if args.fault_step < 1 or args.steps - args.fault_step - 1 < common.MIN_STEPS_AFTER:
        raise UsageError(f"--fault-step must be >= 1 with at least {common.MIN_STEPS_AFTER} steps after it: "
                         f"{args.steps} steps allow --fault-step <= {args.steps - 1 - common.MIN_STEPS_AFTER}")
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1 (>= {common.MIN_REPEATS} for a figure to quote: a median with its spread)")
    variants = tuple(v for v in args.variants.split(",") if v)
    known = (*common.VARIANTS, *(v for v in common.HP_VARIANTS if v not in common.VARIANTS))
    if not variants or set(variants) - set(known):
        raise UsageError(f"--variants: a comma-separated subset of {','.join(known)}, got {args.variants!r}")
    cfg = common.BenchConfig(model_size=args.model_size, vocab=args.vocab, seq=args.seq, nproc=args.nproc,
                            steps=args.steps, fault_step=args.fault_step, ckpt_every=args.ckpt_every,
                            corpus_mb=args.corpus_mb, log_dir=args.log_dir, timeout_s=args.timeout,
                            torchft_heartbeat_timeout_ms=args.torchft_heartbeat_timeout_ms, repeats=args.repeats,
                            pin=not args.no_pin, variants=variants)
    from hp.chaos.bench.recovery_table import format_table

    result = bench.run_bench(cfg)
    return print_result(result, format_table(result), args.json)


def _recovery_args(p: argparse.ArgumentParser) -> None:
    from hp.checkpointless.demo.workload import add_workload_args

    add_workload_args(p, "model_size", "vocab", "seq", model_size="25m", vocab=None,
                      helps={"model_size": f"{SIZES_HELP} (default 25m: INFRA.md's baseline model)",
                             "vocab": "default: 8192 for 25m (~27 M params), else 256"})
    p.add_argument("--nproc", type=int, default=2, help="ranks per variant (hp adds one hot spare, NVRx one idle "
                                                        "rank); default: one per core of a 2-core machine")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--fault-step", type=int, default=6, help="rank 1 is SIGKILLed right after committing it")
    p.add_argument("--repeats", type=int, default=3, help="faulted jobs per variant (default 3: a README quotes "
                                                                  "a median over >= 3; fewer is a smoke run)")
    p.add_argument("--variants", default="hp,torchrun_dcp,torchft,nvrx_default,nvrx_tuned")
    p.add_argument("--no-pin", action="store_true", help="do not pin each rank to a core of its own")
    p.add_argument("--ckpt-every", type=int, default=4, help="baseline: DCP save after each step s, s %% K == 0")
    add_workload_args(p, "corpus_mb")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job before it is killed")
    p.add_argument("--torchft-heartbeat-timeout-ms", type=int, default=5000,
                   help="torchft: how long its Lighthouse waits for a silent replica group (torchft's default)")
    p.add_argument("--log-dir", default=None, help="default: a new temporary directory")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")


def _goodput(args: argparse.Namespace) -> int:
    from hp.chaos.bench.meta import print_result

    if args.nproc < 2 or args.spares < 1:
        raise UsageError("--nproc must be >= 2 and --spares >= 1 (faults go through spares)")
    if not 0 < args.fault_every < args.duration or args.corpus_mb < 1:
        raise UsageError("need 0 < --fault-every < --duration and --corpus-mb >= 1")
    bench = _demo_bench("goodput", args.model_size)
    cfg = bench.GoodputConfig(duration_s=args.duration, fault_every_s=args.fault_every, nproc=args.nproc,
                              spares=args.spares, model_size=args.model_size, corpus_mb=args.corpus_mb,
                              seed=args.seed, pin=not args.no_pin, log_dir=args.log_dir)
    result = bench.run_bench(cfg)
    return print_result(result, bench.format_table(result), args.json)


def _goodput_args(p: argparse.ArgumentParser) -> None:
    from hp.checkpointless.demo.workload import add_workload_args

    p.add_argument("--duration", type=float, default=300.0, help="seconds of training, fault-free and under faults")
    p.add_argument("--fault-every", type=float, default=30.0, help="seconds between two SIGKILLs")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default: one per core of a 2-core machine)")
    p.add_argument("--no-pin", action="store_true", help="do not pin each rank to a core of its own")
    p.add_argument("--spares", type=int, default=1, help="hot spares; each promoted one is replaced")
    add_workload_args(p, "model_size", "corpus_mb", "seed",
                      helps={"model_size": SIZES_HELP, "seed": "picks the ranks killed"})
    p.add_argument("--log-dir", default=None, help="default: a new temporary directory")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")


def _elastic_slurm(args: argparse.Namespace) -> int:
    from hp.chaos.bench import elastic_slurm as bench
    from hp.chaos.bench.meta import print_result

    if args.cycles < 1:
        raise UsageError(f"--cycles must be >= 1, got {args.cycles}")
    if args.global_batch % args.micro_batch or args.micro_batch < 1:
        raise UsageError(f"--global-batch {args.global_batch} must be a multiple of --micro-batch {args.micro_batch}")
    cfg = bench.SlurmBenchConfig(cycles=args.cycles, steps=args.steps or bench.SlurmBenchConfig.steps,
                                 global_batch=args.global_batch, micro_batch=args.micro_batch,
                                 model_size=args.model_size, log_dir=args.log_dir)
    result = bench.run_bench(cfg)
    if args.out:
        from hp.chaos.bench.elastic import write_result

        write_result(result, args.out)
    return print_result(result, bench.format_table(result), args.json)


def _elastic(args: argparse.Namespace) -> int:
    from hp.chaos.bench.meta import print_result

    if args.scheduler == "slurm":
        args.global_batch = args.global_batch or 48
        return _elastic_slurm(args)
    args.steps, args.global_batch = args.steps or 200, args.global_batch or 24
    if args.steps < 60 or not 2 <= args.kill_step < args.steps // 4:
        raise UsageError("need --steps >= 60 and 2 <= --kill-step < steps/4 (four scale events must fit)")
    if args.global_batch % args.micro_batch or args.micro_batch < 1:
        raise UsageError(f"--global-batch {args.global_batch} must be a multiple of --micro-batch {args.micro_batch}")
    bench = _demo_bench("elastic", args.model_size)
    try:
        from hp.elastic.demo import run  # noqa: F401
    except ImportError as e:
        raise UsageError(f"hp bench elastic needs hp-elastic ({e}); pip install packages/hp-elastic") from None
    cfg = bench.ElasticBenchConfig(steps=args.steps, global_batch=args.global_batch, micro_batch=args.micro_batch,
                                   kill_step=args.kill_step, model_size=args.model_size, log_dir=args.log_dir)
    result = bench.run_bench(cfg)
    if args.out:
        bench.write_result(result, args.out)
    return print_result(result, bench.format_table(result), args.json)


def _elastic_args(p: argparse.ArgumentParser) -> None:
    from hp.checkpointless.demo.workload import add_workload_args

    p.add_argument("--scheduler", choices=("local", "slurm"), default="local",
                   help="slurm: the job follows a local Slurm (hp slurm submit; preemption by a high-priority "
                        "job, capacity back) -> shrink_s, grow_s, baseline_s")
    p.add_argument("--steps", type=int, default=None, help="default 200 (local), 700 (slurm)")
    p.add_argument("--global-batch", type=int, default=None, help="default 24 (local), 48 (slurm)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--kill-step", type=int, default=12)
    p.add_argument("--cycles", type=int, default=3, help="slurm: preemptions, each followed by capacity back")
    add_workload_args(p, "model_size", helps={"model_size": SIZES_HELP})
    p.add_argument("--log-dir", default=None, help="default: a new temporary directory")
    p.add_argument("--out", default=None, help="also write the result JSON here (hp bench all collects it into benchmarks/results/)")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")


def _all(args: argparse.Namespace) -> int:
    from hp.chaos.bench import suite

    names = [n for n in args.only.split(",") if n] if args.only else list(suite.SUITE)
    if not names or set(names) - set(suite.SUITE):
        raise UsageError(f"--only: a comma-separated subset of {','.join(suite.SUITE)}, got {args.only!r}")
    if not args.out.endswith(".json") or os.path.isdir(args.out):
        raise UsageError(f"--out must name a .json file, got {args.out!r}")
    def log(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    result = suite.run_all(names, args.quick, log)
    suite.write(result, args.out)
    if {"recovery", "ckpt", "elastic"} <= set(names):  # the simulation's measured inputs
        result["goodput_simulation"] = suite.simulate(args.out, log)
        result["completed"] = result["completed"] and result["goodput_simulation"]["completed"]
        suite.write(result, args.out)
    print(suite.format_table(result), f"\nwritten: {args.out}", sep="", flush=True)
    return 0 if result["completed"] else 1


def _all_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="results file, e.g. benchmarks/results/<name>.json")
    p.add_argument("--only", default=None, help="comma-separated subset (default: all)")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run of the suite, not figures")


# benchmarks whose module has add_arguments and run_cli: name -> (module, the distribution it drives, help)
MODULE_BENCHES = {
    "exact": ("hp.chaos.bench.exact", "hp-elastic", "step-time cost of exact mode (W-independent integer reduction) "
                                                    "against the float all-reduce, one rank per core"),
    "step": ("hp.chaos.bench.step", "hp-checkpointless", "steady-state step time of hp's step transaction against "
                                                         "plain DDP, same model and ranks, one rank per core"),
    "start": ("hp.chaos.bench.start", "hp-checkpointless", "a node's start (to the first committed step) and end, "
                                                           "workers forked from one server vs started cold"),
    "hydrate": ("hp.chaos.bench.hydrate", "hp-checkpointless", "a hot spare's hydration on one node (shared memory, "
                                                               "and over gloo) against a memcpy of the same bytes"),
    "ckpt": ("hp.chaos.bench.ckpt", "hp-tiered-ckpt", "training-loop stall per save: hp memory tier vs DCP to S3 "
                                                      "(sync, async)"),
    "init": ("hp.chaos.bench.init", "hp-core", "process-group init time at 8/16/32 ranks: rootless (a node agent's "
                                               "store, hosted by no rank) against TCPStore hosted by rank 0, and on "
                                               "etcd; and the HA controller's failover time"),
    "control": ("hp.chaos.bench.control", "hp-core", "store requests per rank at idle and generation fan-out time: "
                                                     "per-rank polling against the per-node relay (hp.core.fanout), "
                                                     "projected to 16k ranks"),
}
# the benchmarks defined here: name -> (add_arguments, handler, the distribution they drive, help)
LOCAL_BENCHES: dict[str, tuple[Callable, Callable, str, str]] = {
    "recovery": (_recovery_args, _recovery, "hp-checkpointless",
                 "downtime after a SIGKILL of rank 1, one rank per core: hp with a hot spare vs torchrun + DCP vs "
                 "torchft vs NVRx in-process restart"),
    "goodput": (_goodput_args, _goodput, "hp-checkpointless",
                "goodput while a random rank is SIGKILLed every N s (spares replenished), against a fault-free run "
                "of the same job for the same time"),
    "elastic": (_elastic_args, _elastic, "hp-elastic",
                "pause per scale event (shrink on a kill, grow, preemption): hp in process vs torchrun "
                "--nnodes MIN:MAX + DCP checkpoint-restart"),
    "all": (_all_args, _all, "hp-chaos", "every benchmark, one after the other, into one results file "
                                         "(commit, machine, each benchmark's JSON)"),
}
ORDER = ("recovery", "goodput", "elastic", "exact", "step", "start", "hydrate", "all", "ckpt", "init", "control")


def _missing(what: str, dist: str, e: Exception) -> int:
    raise UsageError(f"{what} needs {dist} ({e}); pip install packages/{dist}")


def _add_bench(bench: argparse._SubParsersAction, name: str) -> None:
    """``hp bench NAME``: its arguments and command; where building its arguments needs a distribution that
    is not installed, a command that says so in one line."""
    if name in MODULE_BENCHES:
        module, dist, help_text = MODULE_BENCHES[name]

        def add_arguments(p: argparse.ArgumentParser) -> Callable:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            return mod.run_cli
    else:
        add, handler, dist, help_text = LOCAL_BENCHES[name]

        def add_arguments(p: argparse.ArgumentParser) -> Callable:
            add(p)
            return handler
    p = bench.add_parser(name, help=help_text)
    try:
        p.set_defaults(handler=add_arguments(p))
    except ImportError as e:
        p.set_defaults(handler=lambda args, e=e: _missing(f"hp bench {name}", dist, e))


@hookimpl
def hp_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks of hp against the traditional ways to do the same")
    bench = p.add_subparsers(title="benchmarks", metavar="BENCHMARK", required=True)
    for name in ORDER:
        _add_bench(bench, name)

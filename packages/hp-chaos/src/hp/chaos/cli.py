"""hp-chaos's sub-commands: ``hp bench <benchmark>`` and ``hp chaos run|report|faults``.

``hp bench`` is a group so that each benchmark (``recovery`` now; ``goodput`` and ``ckpt`` later) is
one more ``_add_<name>`` function here and one flat module beside it. Nothing heavy is imported
while the parser is built: every ``hp`` invocation builds it, and hp-chaos must import without
hp-checkpointless (it is a dependency of the benchmarks, not of the distribution).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from hp.core.errors import UsageError
from hp.core.hookspecs import hookimpl


def _demo_bench(name: str, model_size: str):
    """The module of a benchmark that runs the demo job (hp-checkpointless and torch must be installed)."""
    try:
        module = importlib.import_module(f"hp.chaos.bench_{name}")
        from hp.checkpointless.demo.sizes import MODEL_SIZES
    except ImportError as e:
        raise UsageError(f"hp bench {name} needs hp-checkpointless and torch ({e}); "
                         "pip install packages/hp-checkpointless") from None
    if model_size not in MODEL_SIZES:
        raise UsageError(f"--model-size must be one of {sorted(MODEL_SIZES)}, got {model_size!r}")
    return module


def _print_result(result: dict, table: str, as_json: bool, ok: str = "completed") -> int:
    """The table for people, then (``--json``) the result as the last stdout line; the exit code."""
    print(table, flush=True)
    if as_json:
        print(json.dumps(result), flush=True)
    return 0 if result[ok] else 1


def _recovery(args: argparse.Namespace) -> int:
    bench = _demo_bench("recovery", args.model_size)
    if args.nproc < 2:
        raise UsageError("--nproc must be >= 2 (rank 1 is the one killed)")
    if args.ckpt_every < 1 or args.corpus_mb < 1 or (args.vocab is not None and args.vocab < 2) \
            or args.torchft_heartbeat_timeout_ms < 1:
        raise UsageError("--ckpt-every, --corpus-mb and --torchft-heartbeat-timeout-ms must be >= 1, --vocab >= 2")
    if args.fault_step < 1 or args.steps - args.fault_step - 1 < bench.MIN_STEPS_AFTER:
        raise UsageError(f"--fault-step must be >= 1 with at least {bench.MIN_STEPS_AFTER} steps after it: "
                         f"{args.steps} steps allow --fault-step <= {args.steps - 1 - bench.MIN_STEPS_AFTER}")
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1 (>= {bench.MIN_REPEATS} for a figure to quote: a median with its spread)")
    variants = tuple(v for v in args.variants.split(",") if v)
    known = (*bench.VARIANTS, *(v for v in bench.HP_VARIANTS if v not in bench.VARIANTS))
    if not variants or set(variants) - set(known):
        raise UsageError(f"--variants: a comma-separated subset of {','.join(known)}, got {args.variants!r}")
    cfg = bench.BenchConfig(model_size=args.model_size, vocab=args.vocab, seq=args.seq, nproc=args.nproc,
                            steps=args.steps, fault_step=args.fault_step, ckpt_every=args.ckpt_every,
                            corpus_mb=args.corpus_mb, log_dir=args.log_dir, timeout_s=args.timeout,
                            torchft_heartbeat_timeout_ms=args.torchft_heartbeat_timeout_ms, repeats=args.repeats,
                            pin=not args.no_pin, variants=variants)
    from hp.chaos.bench_recovery_table import format_table

    result = bench.run_bench(cfg)
    return _print_result(result, format_table(result), args.json)


def _add_recovery(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("recovery", help="downtime after a SIGKILL of rank 1, one rank per core: hp with a hot "
                                          "spare vs torchrun + DCP vs torchft vs NVRx in-process restart")
    p.add_argument("--model-size", default="25m", help="tiny | small | 25m (default 25m: INFRA.md's baseline model)")
    p.add_argument("--vocab", type=int, default=None, help="default: 8192 for 25m (~27 M params), else 256")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--nproc", type=int, default=2, help="ranks per variant (hp adds one hot spare, NVRx one idle "
                                                        "rank); default: one per core of a 2-core machine")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--fault-step", type=int, default=6, help="rank 1 is SIGKILLed right after committing it")
    p.add_argument("--repeats", type=int, default=3, help="faulted jobs per variant (default 3: a README quotes "
                                                                  "a median over >= 3; fewer is a smoke run)")
    p.add_argument("--variants", default="hp,torchrun_dcp,torchft,nvrx_default,nvrx_tuned")
    p.add_argument("--no-pin", action="store_true", help="do not pin each rank to a core of its own")
    p.add_argument("--ckpt-every", type=int, default=4, help="baseline: DCP save after each step s, s %% K == 0")
    p.add_argument("--corpus-mb", type=int, default=16)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job before it is killed")
    p.add_argument("--torchft-heartbeat-timeout-ms", type=int, default=5000,
                   help="torchft: how long its Lighthouse waits for a silent replica group (torchft's default)")
    p.add_argument("--log-dir", default=None, help="default: a new temporary directory")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.set_defaults(handler=_recovery)


def _goodput(args: argparse.Namespace) -> int:
    if args.nproc < 2 or args.spares < 1:
        raise UsageError("--nproc must be >= 2 and --spares >= 1 (faults go through spares)")
    if not 0 < args.fault_every < args.duration or args.corpus_mb < 1:
        raise UsageError("need 0 < --fault-every < --duration and --corpus-mb >= 1")
    bench = _demo_bench("goodput", args.model_size)
    cfg = bench.GoodputConfig(duration_s=args.duration, fault_every_s=args.fault_every, nproc=args.nproc,
                              spares=args.spares, model_size=args.model_size, corpus_mb=args.corpus_mb,
                              seed=args.seed, pin=not args.no_pin, log_dir=args.log_dir)
    result = bench.run_bench(cfg)
    return _print_result(result, bench.format_table(result), args.json)


def _add_goodput(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("goodput", help="goodput while a random rank is SIGKILLed every N s (spares replenished), "
                                         "against a fault-free run of the same job for the same time")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of training, fault-free and under faults")
    p.add_argument("--fault-every", type=float, default=30.0, help="seconds between two SIGKILLs")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default: one per core of a 2-core machine)")
    p.add_argument("--no-pin", action="store_true", help="do not pin each rank to a core of its own")
    p.add_argument("--spares", type=int, default=1, help="hot spares; each promoted one is replaced")
    p.add_argument("--model-size", default="tiny", help="tiny | small | 25m")
    p.add_argument("--corpus-mb", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="picks the ranks killed")
    p.add_argument("--log-dir", default=None, help="default: a new temporary directory")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.set_defaults(handler=_goodput)


def _elastic_slurm(args: argparse.Namespace) -> int:
    from hp.chaos import bench_slurm_elastic as bench

    if args.cycles < 1:
        raise UsageError(f"--cycles must be >= 1, got {args.cycles}")
    if args.global_batch % args.micro_batch or args.micro_batch < 1:
        raise UsageError(f"--global-batch {args.global_batch} must be a multiple of --micro-batch {args.micro_batch}")
    cfg = bench.SlurmBenchConfig(cycles=args.cycles, steps=args.steps or bench.SlurmBenchConfig.steps,
                                 global_batch=args.global_batch, micro_batch=args.micro_batch,
                                 model_size=args.model_size, log_dir=args.log_dir)
    result = bench.run_bench(cfg)
    if args.out:
        from hp.chaos.bench_elastic import write_result

        write_result(result, args.out)
    return _print_result(result, bench.format_table(result), args.json)


def _elastic(args: argparse.Namespace) -> int:
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
    return _print_result(result, bench.format_table(result), args.json)


def _add_elastic(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("elastic", help="pause per scale event (shrink on a kill, grow, preemption): hp in "
                                         "process vs torchrun --nnodes MIN:MAX + DCP checkpoint-restart")
    p.add_argument("--scheduler", choices=("local", "slurm"), default="local",
                   help="slurm: the job follows a local Slurm (hp slurm submit; preemption by a high-priority "
                        "job, capacity back) -> shrink_s, grow_s, baseline_s")
    p.add_argument("--steps", type=int, default=None, help="default 200 (local), 700 (slurm)")
    p.add_argument("--global-batch", type=int, default=None, help="default 24 (local), 48 (slurm)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--kill-step", type=int, default=12)
    p.add_argument("--cycles", type=int, default=3, help="slurm: preemptions, each followed by capacity back")
    p.add_argument("--model-size", default="tiny", help="tiny | small | 25m")
    p.add_argument("--log-dir", default=None, help="default: a new temporary directory")
    p.add_argument("--out", default=None, help="also write the result JSON here (hp bench all collects it into benchmarks/results/)")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.set_defaults(handler=_elastic)


# benches whose code (and arguments) live in another distribution: name -> (module, dist, help)
MODULE_BENCHES = {
    "exact": ("hp.elastic.bench_exact", "hp-elastic", "step-time cost of exact mode (W-independent integer reduction) "
                                                       "against the float all-reduce, one rank per core"),
    "step": ("hp.checkpointless.bench_step", "hp-checkpointless", "steady-state step time of hp's step transaction "
                                                                 "against plain DDP, same model and ranks, one rank per core"),
    "start": ("hp.checkpointless.bench_start", "hp-checkpointless", "a node's start (to the first committed step) and "
                                                                    "end, workers forked from one server vs started cold"),
    "hydrate": ("hp.checkpointless.bench_hydrate", "hp-checkpointless", "a hot spare's hydration on one node (shared "
                                                                        "memory, and over gloo) against a memcpy of the same bytes"),
}


def _add_module_bench(bench: argparse._SubParsersAction, name: str) -> None:
    """``hp bench NAME`` of another distribution: its module's own arguments and command; a one-line error
    naming the distribution when it is not installed. The module imports no torch at import time (the CLI
    loads every plugin on every call)."""
    module, dist, help_text = MODULE_BENCHES[name]
    p = bench.add_parser(name, help=help_text)
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        p.set_defaults(handler=lambda args, e=e: _missing(f"hp bench {name}", dist, e))
        return
    mod.add_arguments(p)
    p.set_defaults(handler=mod.run_cli)


def _all(args: argparse.Namespace) -> int:
    from hp.chaos import bench_all

    names = [n for n in args.only.split(",") if n] if args.only else list(bench_all.SUITE)
    if not names or set(names) - set(bench_all.SUITE):
        raise UsageError(f"--only: a comma-separated subset of {','.join(bench_all.SUITE)}, got {args.only!r}")
    if not args.out.endswith(".json") or os.path.isdir(args.out):
        raise UsageError(f"--out must name a .json file, got {args.out!r}")
    def log(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    result = bench_all.run_all(names, args.quick, log)
    bench_all.write(result, args.out)
    if {"recovery", "ckpt", "elastic"} <= set(names):  # the simulation's measured inputs
        result["goodput_simulation"] = bench_all.simulate(args.out, log)
        result["completed"] = result["completed"] and result["goodput_simulation"]["completed"]
        bench_all.write(result, args.out)
    print(bench_all.format_table(result), f"\nwritten: {args.out}", sep="", flush=True)
    return 0 if result["completed"] else 1


def _add_all(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("all", help="every benchmark, one after the other, into one results file "
                                     "(commit, machine, each benchmark's JSON)")
    p.add_argument("--out", required=True, help="results file, e.g. benchmarks/results/<name>.json")
    p.add_argument("--only", default=None, help="comma-separated subset (default: all)")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run of the suite, not figures")
    p.set_defaults(handler=_all)


def _missing(what: str, dist: str, e: Exception) -> int:
    raise UsageError(f"{what} needs {dist} ({e}); pip install packages/{dist}")


def _chaos_run(args: argparse.Namespace) -> int:
    try:
        from hp.chaos.report import format_table
        from hp.chaos.runner import run_scenario, write_result
        from hp.chaos.scenario import ScenarioError, load_scenario
    except ImportError as e:
        raise UsageError(f"hp chaos run needs hp-checkpointless and torch ({e}); "
                         "pip install packages/hp-checkpointless") from None
    try:
        scenario = load_scenario(args.file)
    except ScenarioError as e:
        raise UsageError(f"scenario {args.file}: {e}") from None
    try:
        result = run_scenario(scenario, log_dir=args.log_dir)
    except NotImplementedError as e:
        raise UsageError(f"scenario {args.file}: not supported yet: {e}") from None
    except RuntimeError as e:
        from hp.chaos.topology import TopologyError

        if not isinstance(e, TopologyError):
            raise
        raise UsageError(f"scenario {args.file}: cannot build the node namespaces: {e}") from None
    out = args.out or os.path.join(result["log_dir"], "result.json")
    write_result(result, out)
    print(format_table(result), flush=True)
    print(f"result written to {out} (picture: hp chaos report {out})", flush=True)
    if args.json:
        summary = {k: result[k] for k in ("passed", "bitwise_equal", "lost_steps", "recovery_s", "goodput", "failures")}
        if "elastic" in result:  # an elastic job: how its world size went, and each scale event's pause
            summary.update({k: result["elastic"][k] for k in ("world_sizes", "pause_s")})
        if result["job"].get("store") == "etcd":  # the agents elect the controller: each controller fault's failover
            summary["failover_s"] = result["failover_s"]
        print(json.dumps({"name": result["name"], **summary, "result": out}), flush=True)
    return 0 if result["passed"] else 1


def _chaos_report(args: argparse.Namespace) -> int:
    from hp.chaos.report import check_result, format_table, write_png

    try:
        with open(args.result) as f:
            result = check_result(json.load(f))
    except OSError as e:
        raise UsageError(f"{args.result}: {e.strerror}") from None
    except ValueError as e:  # JSONDecodeError is one
        raise UsageError(f"{args.result}: {str(e).splitlines()[0]}") from None
    png = args.out or os.path.splitext(args.result)[0] + ".png"
    write_png(result, png)
    print(format_table(result))
    print(f"picture written to {png}", flush=True)
    return 0


def _chaos_faults(args: argparse.Namespace) -> int:
    from hp.chaos.faults import fault_kinds

    kinds = fault_kinds()
    rows = [{"kind": k.name, "targets": list(k.targets), "phase": k.phased, "params": sorted(k.params),
             "doc": k.summary} for k in sorted(kinds.values(), key=lambda k: k.name)]
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        where = ", ".join(r["targets"]) + (" (at a phase on rank)" if r["phase"] else "")
        params = f"; params: {', '.join(r['params'])}" if r["params"] else ""
        print(f"{r['kind']:<10} {r['doc']}\n{'':<10} targets: {where}{params}")
    return 0


def _add_chaos(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chaos", help="fault scenarios: reference vs faulted job, expectations checked")
    chaos = p.add_subparsers(title="chaos commands", metavar="COMMAND", required=True)
    r = chaos.add_parser("run", help="run a scenario file: exit 0 if every expectation holds, 1 if not, 2 if malformed")
    r.add_argument("file", help="scenario YAML (name, job, faults, expect)")
    r.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    r.add_argument("--log-dir", default=None, help="default: a new temporary directory")
    r.add_argument("--out", default=None, help="result JSON path (default: LOG_DIR/result.json)")
    r.set_defaults(handler=_chaos_run)
    rep = chaos.add_parser("report", help="PNG (loss per step, fault markers, recovery bars) and a table")
    rep.add_argument("result", help="result JSON written by hp chaos run")
    rep.add_argument("--out", default=None, help="PNG path (default: RESULT with .png)")
    rep.set_defaults(handler=_chaos_report)
    f = chaos.add_parser("faults", help="the fault kinds discovered (plugin family fault)")
    f.add_argument("--json", action="store_true")
    f.set_defaults(handler=_chaos_faults)


@hookimpl
def hp_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks of hp against the traditional ways to do the same")
    bench = p.add_subparsers(title="benchmarks", metavar="BENCHMARK", required=True)
    _add_recovery(bench)
    _add_goodput(bench)
    _add_elastic(bench)
    for name in MODULE_BENCHES:
        _add_module_bench(bench, name)
    _add_all(bench)
    _add_chaos(subparsers)
    importlib.import_module("hp.chaos.goodput_cli").add_goodput(subparsers)  # hp goodput simulate

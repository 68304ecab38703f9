"""hp-chaos's sub-commands: ``hp chaos run|report|faults`` and ``hp goodput`` (``hp bench`` is
:mod:`hp.chaos.bench.cli`'s).

Nothing heavy is imported while the parser is built: every ``hp`` invocation builds it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os

from hp.core.errors import UsageError
from hp.core.hookspecs import hookimpl


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
    _add_chaos(subparsers)
    importlib.import_module("hp.chaos.goodput_cli").add_goodput(subparsers)  # hp goodput simulate

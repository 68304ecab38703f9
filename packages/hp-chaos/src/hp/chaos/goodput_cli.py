"""``hp goodput simulate``: goodput vs cluster size from a results file and published failure rates.

This module parses flags, reads the results file (``hp bench all``'s JSON), states every input with
its source, prints a table (and ``--json``: one JSON object as the last stdout line) and draws the
PNG. The model lives in :mod:`hp.chaos.goodput_sim`. Only the standard library is imported while the
parser is built; matplotlib is imported for the PNG alone.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
from typing import Any

from hp.core.errors import UsageError

KEYS = {
    "hp_downtime_s": "benchmarks.recovery.variants.hp.downtime_s.values",
    "restart_s_measured": "benchmarks.recovery.variants.torchrun_dcp.recovery_s.values",
    "save_s": "benchmarks.ckpt.dcp_sync_s.median",
    "hp_stall_s": "benchmarks.ckpt.hp_stall_s.warm.median",
    "elastic_events": "benchmarks.elastic.hp.events",
}
PUBLISHED_RESTART_S = 600.0  # the worked example's recovery: 10 minutes
DEFAULT_REINIT_S = 30.0
SCALE_NOTE = ("measured on the results file's machine (small model, few CPU ranks), assumed to hold per rank at "
              "cluster scale (weak scaling: a rank's shard stays about the same size)")
PLOT_HINT = "pip install matplotlib (a dependency of hp-chaos)"


MAX_RESULTS_BYTES = 64 << 20  # a results file of `hp bench all` is a few hundred KB


def _has_every_key(path: str) -> bool:
    """Whether ``path`` is a results file this simulation can use (``hp bench all``'s: every key of KEYS);
    other files in the folder (test-suite durations, single benchmarks) are passed over."""
    try:
        if os.path.getsize(path) > MAX_RESULTS_BYTES:
            return False
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        for dotted in KEYS.values():
            _get(doc, dotted, path)
        return True
    except (OSError, ValueError, UsageError):
        return False


def find_results(start: str) -> str | None:
    """The newest ``benchmarks/results/*.json`` that has every key the simulation needs, in ``start`` or the
    nearest parent whose ``benchmarks/results`` has one."""
    d = os.path.abspath(start)
    while True:
        found = [p for p in glob.glob(os.path.join(d, "benchmarks", "results", "*.json")) if _has_every_key(p)]
        if found:
            return max(found, key=os.path.getmtime)
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def _get(doc: Any, dotted: str, path: str) -> Any:
    cur = doc
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise UsageError(f"results file {path}: missing key {dotted}")
        cur = cur[part]
    return cur


def _seconds(value: Any, dotted: str, path: str, many: bool) -> list[float]:
    xs = value if many else [value]
    if not isinstance(xs, list) or not xs or not all(isinstance(x, (int, float)) and x >= 0 for x in xs):
        what = "a non-empty list of seconds >= 0" if many else "seconds >= 0"
        raise UsageError(f"results file {path}: key {dotted} must be {what}")
    return [float(x) for x in xs]


def read_measured(path: str) -> dict[str, tuple[list[float], str]]:
    """Every measured input of the results file: name -> (values, source)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise UsageError(f"--results {path}: {e.strerror}") from None
    except ValueError as e:
        raise UsageError(f"--results {path}: not JSON ({str(e).splitlines()[0]})") from None
    out = {}
    for name in ("hp_downtime_s", "restart_s_measured", "save_s", "hp_stall_s"):
        key = KEYS[name]
        out[name] = (_seconds(_get(doc, key, path), key, path, many=key.endswith(".values")),
                     f"results file {path} key {key}")
    events = _get(doc, KEYS["elastic_events"], path)
    if not isinstance(events, list):
        raise UsageError(f"results file {path}: key {KEYS['elastic_events']} must be a list of events")
    for kind in ("shrink", "grow"):
        pauses = [e["pause_s"] for e in events if isinstance(e, dict) and e.get("kind") == kind
                  and isinstance(e.get("pause_s"), (int, float))]
        src = f"results file {path} key {KEYS['elastic_events']} (kind {kind})"
        if not pauses and kind == "grow" and "shrink_s" in out:
            pauses, src = out["shrink_s"][0], f"{out['shrink_s'][1]}; assumption: no grow event, grow pause = shrink pause"
        if not pauses:
            raise UsageError(f"results file {path}: key {KEYS['elastic_events']} has no '{kind}' event with a pause_s")
        out[f"{kind}_s"] = (_seconds(pauses, KEYS["elastic_events"], path, many=True), src)
    return out


def resolve_inputs(args: argparse.Namespace, path: str) -> tuple[Any, dict[str, dict[str, Any]]]:
    """The simulator's :class:`Costs` and ``inputs`` (each ``{value, source}``): measured, flag or assumed."""
    from hp.chaos.goodput_sim import MTTF_SOURCES, Costs, gpu_mttf_s

    measured = read_measured(path)
    inputs: dict[str, dict[str, Any]] = {}

    def pick(name: str, flag: float | None, note: str = SCALE_NOTE) -> list[float]:
        if flag is not None:
            inputs[name] = {"value": flag, "source": "flag"}
            return [flag]
        values, src = measured[name]
        inputs[name] = {"value": statistics.median(values), "n": len(values), "source": f"{src}; {note}"}
        return values

    save = pick("save_s", args.save_s)
    hp_down = pick("hp_downtime_s", args.hp_downtime_s)
    stall = pick("hp_stall_s", args.hp_stall_s)
    shrink = pick("shrink_s", args.shrink_s)
    grow = pick("grow_s", args.grow_s)
    values, src = measured["restart_s_measured"]
    inputs["restart_s_measured"] = {"value": statistics.median(values), "n": len(values),
                                    "source": f"{src}; reported beside, used with --measured-restart"}
    if args.restart_s is not None:
        restart, inputs["restart_s"] = [args.restart_s], {"value": args.restart_s, "source": "flag"}
    elif args.measured_restart:
        restart, inputs["restart_s"] = values, {"value": statistics.median(values), "source": f"{src} (--measured-restart)"}
    else:
        restart = [PUBLISHED_RESTART_S]
        inputs["restart_s"] = {"value": PUBLISHED_RESTART_S, "source": (
            "published: the worked example's 10 min recovery (job rescheduling, NCCL init and checkpoint load at "
            "cluster scale are minutes, not the seconds of a small box; DESIGN.md cites 5 min at 16-256 GPUs and "
            "15-30 min at 2,000+, so 10 min favours checkpoint-restart at the largest sizes)")}
    inputs["reinit_s"] = {"value": args.reinit_s, "source": "flag" if args.reinit_s != DEFAULT_REINIT_S else (
        "assumption: process-group re-init at cluster scale, absent from the small-box measurement, added to every "
        "hp pause (recovery, shrink, grow); MegaScale (NSDI'24) reports < 30 s to initialise 10k+ GPUs")}
    inputs["replace_s"] = {"value": args.replace_min * 60, "source": "flag" if args.replace_min != 30 else (
        "assumption: a consumed spare node is replaced (cloud instance or repaired node, health-checked) in 30 min")}
    inputs["spares_per_1k_gpus"] = {"value": args.spares_per_1k_gpus, "source": "flag" if args.spares_per_1k_gpus != 1 else (
        "assumption: 1 hot spare node per 1,024 GPUs (rounded up, >= 1): ~0.8 % extra nodes, outside goodput")}
    inputs["gpus_per_node"] = {"value": args.gpus_per_node, "source": "flag" if args.gpus_per_node != 8 else (
        "assumption: 8 GPUs per node (one instance); a GPU failure takes its node out")}
    gpus, mttf_h, cite = MTTF_SOURCES[args.mttf_source]
    inputs["mttf_gpu_h"] = {"value": gpu_mttf_s(args.mttf_source) / 3600, "source": (
        f"{cite}; per-GPU MTTF = {mttf_h:.2f} h x {gpus:,} GPUs, MTTF(N) = MTTF_gpu / N (--mttf-source "
        f"{args.mttf_source})")}
    for name in MTTF_SOURCES:
        if name != args.mttf_source:
            inputs[f"mttf_gpu_h_{name}"] = {"value": gpu_mttf_s(name) / 3600, "source": MTTF_SOURCES[name][2]
                                            + "; cross-check, not used"}
    costs = Costs(save_s=save[0] if len(save) == 1 else statistics.median(save), restart_s=tuple(restart),
                  hp_downtime_s=tuple(hp_down), hp_stall_s=stall[0] if len(stall) == 1 else statistics.median(stall),
                  shrink_s=tuple(shrink), grow_s=tuple(grow), reinit_s=args.reinit_s, replace_s=args.replace_min * 60,
                  spares_per_1k_gpus=args.spares_per_1k_gpus, gpus_per_node=args.gpus_per_node)
    return costs, inputs


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole result (the JSON of ``--json``), without printing."""
    from hp.chaos import goodput_sim as sim

    if args.days <= 0 or args.seeds < 1 or args.gpus_per_node < 1 or args.replace_min < 0 \
            or args.spares_per_1k_gpus < 0 or args.reinit_s < 0:
        raise UsageError("need --days > 0, --seeds >= 1, --gpus-per-node >= 1 and --replace-min, "
                         "--spares-per-1k-gpus, --reinit-s >= 0")
    for flag in ("restart_s", "save_s", "hp_downtime_s", "hp_stall_s", "shrink_s", "grow_s"):
        if getattr(args, flag) is not None and getattr(args, flag) < 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 0")
    if not 16 <= args.min_gpus <= args.max_gpus:
        raise UsageError("need 16 <= --min-gpus <= --max-gpus")
    path = args.results or find_results(os.getcwd())
    if path is None:
        raise UsageError("no benchmarks/results/*.json with every key the simulation needs found from here upward "
                         "(a results file of `hp bench all`): pass --results PATH or run `hp bench all`")
    costs, inputs = resolve_inputs(args, path)
    sizes = [2 ** k for k in range(16) if args.min_gpus <= 2 ** k <= args.max_gpus] or [args.min_gpus]
    rows = sim.simulate(costs, args.mttf_source, sizes, args.days, args.seeds, args.seed)
    largest = rows[-1]
    summary = {"gpus": largest["gpus"], **largest["goodput"], "goal": sim.GOAL_GOODPUT,
               "hp_meets_goal": largest["goodput"]["hp"] >= sim.GOAL_GOODPUT,
               "hp_breakeven_downtime_s": sim.hp_breakeven_downtime_s(largest["gpus"], costs, args.mttf_source)}
    return {
        "rows": rows,
        "worked_example": sim.worked_example(),
        "hp_worked_example": {"instances": 256, "usd_per_instance_h": 55.0,
                              **sim.disruption_costs(costs, args.mttf_source)},
        "goodput_at_16k": summary if largest["gpus"] == 16384 else None,
        "goodput_at_largest": summary,
        "inputs": inputs,
        "config": {"results": path, "mttf_source": args.mttf_source, "days": args.days, "seeds": args.seeds,
                   "seed": args.seed, "sizes": sizes},
        "png": None,
    }


def format_table(r: dict[str, Any]) -> str:
    lines = ["inputs"]
    width = max(len(k) for k in r["inputs"])
    for name, i in r["inputs"].items():
        lines.append(f"  {name:<{width}}  {i['value']:>10.4g}  {i['source']}")
    c = r["config"]
    lines += ["", f"goodput vs cluster size ({c['seeds']} runs x {c['days']:g} days each: mean [min-max]; "
              f"MTTF {c['mttf_source']})",
              f"  {'GPUs':>6}  {'MTTF':>7}  {'ckpt every':>10}  {'spares':>6}  {'ckpt-restart':>22}  "
              f"{'(analytic)':>10}  {'hp':>22}  {'hp elastic':>22}"]
    for row in r["rows"]:
        g, s = row["goodput"], row["spread"]
        cell = {k: f"{g[k]:.4f} [{s[k]['min']:.4f}-{s[k]['max']:.4f}]" for k in g}
        lines.append(f"  {row['gpus']:>6}  {row['mttf_h']:>6.1f}h  {row['ckpt_interval_s'] / 60:>8.1f}m  "
                     f"{row['spare_nodes']:>6}  {cell['ckpt_restart']:>22}  {row['analytic']['ckpt_restart']:>10.4f}  "
                     f"{cell['hp']:>22}  {cell['hp_elastic']:>22}")
    w, h = r["worked_example"], r["hp_worked_example"]
    lines += ["", f"one disruption on {w['instances']} instances at ${w['usd_per_instance_h']:g}/instance-hour "
              f"(monthly: {w['disruptions_per_month']} a month)",
              f"  published worked example (ckpt every {w['ckpt_every_min']:g} min: {w['lost_work_min']:g} min lost + "
              f"{w['recovery_min']:g} min recovery): {w['instance_h_per_disruption']:.1f} instance-h = "
              f"${w['cost_per_disruption_usd']:,.2f}; ${w['monthly_cost_usd']:,.0f}/month, {w['delay_h']:.1f} h delay"]
    for name in ("ckpt_restart", "hp", "hp_elastic_no_spare"):
        x = h[name]
        lines.append(f"  {name:<20} {x['job_seconds']:>8.1f} s of job time: {x['instance_h_per_disruption']:.2f} "
                     f"instance-h = ${x['cost_per_disruption_usd']:,.2f}; ${x['monthly_cost_usd']:,.0f}/month, "
                     f"{x['delay_h']:.2f} h delay")
    s = r["goodput_at_largest"]
    lines += ["", f"at {s['gpus']:,} GPUs: checkpoint-restart {s['ckpt_restart']:.4f}, hp {s['hp']:.4f}, "
              f"hp elastic {s['hp_elastic']:.4f} (goal {s['goal']:.0%}: {'met' if s['hp_meets_goal'] else 'NOT met'}; "
              f"hp stays >= {s['goal']:.0%} while its downtime per failure is <= {s['hp_breakeven_downtime_s']:.0f} s)"]
    if r["png"]:
        lines.append(f"png: {r['png']}")
    return "\n".join(lines)


def write_png(r: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise UsageError(f"the PNG needs matplotlib: {PLOT_HINT} (or pass --no-png)") from None
    matplotlib.use("Agg")  # files only: no display here or in CI
    import matplotlib.pyplot as plt

    labels = {"ckpt_restart": "checkpoint-restart (Daly interval)", "hp": "hp in-process + spares",
              "hp_elastic": "hp + elastic shrink"}
    styles = {"ckpt_restart": ("#d62728", "o-"), "hp": ("#1f77b4", "s-"), "hp_elastic": ("#2ca02c", "^--")}
    x = [row["gpus"] for row in r["rows"]]
    fig, ax = plt.subplots(figsize=(8.5, 5))
    for name, label in labels.items():
        color, fmt = styles[name]
        ax.plot(x, [row["goodput"][name] for row in r["rows"]], fmt, color=color, label=label, ms=5)
        ax.fill_between(x, [row["spread"][name]["min"] for row in r["rows"]],
                        [row["spread"][name]["max"] for row in r["rows"]], color=color, alpha=0.15, lw=0)
    ax.axhline(r["goodput_at_largest"]["goal"], color="#7f7f7f", ls=":", lw=1, label="goal: 97 %")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [f"{g:,}" for g in x], fontsize=8, rotation=45)
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("goodput (useful compute / wall time)")
    c = r["config"]
    ax.set_title(f"goodput vs cluster size: MTTF {c['mttf_source']}, restart {r['inputs']['restart_s']['value']:g} s, "
                 f"{c['seeds']} x {c['days']:g} days", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _simulate(args: argparse.Namespace) -> int:
    result = run(args)
    if not args.no_png:
        write_png(result, args.png)
        result["png"] = os.path.abspath(args.png)
    print(format_table(result), flush=True)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


def add_goodput(subparsers: argparse._SubParsersAction) -> None:
    """Register ``hp goodput simulate``."""
    p = subparsers.add_parser("goodput", help="goodput at cluster scale: simulation from measured and published inputs")
    sub = p.add_subparsers(title="goodput commands", metavar="COMMAND", required=True)
    s = sub.add_parser("simulate", help="discrete-event simulation of goodput vs GPUs (16 ... 16,384): "
                                        "checkpoint-restart vs hp with spares vs hp elastic")
    s.add_argument("--results", default=None, help="results JSON (default: the newest benchmarks/results/*.json "
                                                   "from the current directory upward)")
    s.add_argument("--mttf-source", choices=["meta-16k", "meta-1k", "llama3"], default="meta-16k",
                   help="published failure figure the per-GPU failure rate is fitted to (default meta-16k)")
    s.add_argument("--days", type=float, default=30.0, help="simulated wall time per run")
    s.add_argument("--seeds", type=int, default=10, help="independent runs per size and strategy")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--min-gpus", type=int, default=16)
    s.add_argument("--max-gpus", type=int, default=16384)
    s.add_argument("--gpus-per-node", type=int, default=8)
    s.add_argument("--spares-per-1k-gpus", type=float, default=1.0, help="hot spare nodes per 1,024 GPUs (rounded up)")
    s.add_argument("--replace-min", type=float, default=30.0, help="minutes until a consumed spare is replaced")
    s.add_argument("--reinit-s", type=float, default=DEFAULT_REINIT_S,
                   help="seconds added to every hp pause for process-group re-init at cluster scale")
    s.add_argument("--restart-s", type=float, default=None,
                   help="checkpoint-restart's restart cost (default: the published 10 min)")
    s.add_argument("--measured-restart", action="store_true",
                   help="use the results file's measured restart distribution instead of the published 10 min")
    for flag, what in (("save-s", "checkpoint-restart's blocking save"), ("hp-downtime-s", "hp's downtime per fault"),
                       ("hp-stall-s", "hp's checkpoint stall per save"), ("shrink-s", "hp elastic's shrink pause"),
                       ("grow-s", "hp elastic's grow pause")):
        s.add_argument(f"--{flag}", type=float, default=None, help=f"{what} (default: the results file's)")
    s.add_argument("--png", default="goodput_vs_gpus.png", help="PNG path (default ./goodput_vs_gpus.png)")
    s.add_argument("--no-png", action="store_true", help="skip the PNG")
    s.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    s.set_defaults(handler=_simulate)

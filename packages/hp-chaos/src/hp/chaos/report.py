"""A scenario result for people: a table for the terminal and a PNG (``hp chaos report``).

The PNG has the loss per step of the reference and of the faulted run (a step committed twice
shows twice: lost work), a marker at each fault's step, and one bar per fault with its recovery
time split into phases.
"""

from __future__ import annotations

import math

PHASE_COLORS = {"detect": "#d62728", "abort": "#ff7f0e", "spare_attach": "#bcbd22", "pg_init": "#2ca02c",
                "hydrate": "#1f77b4", "replay": "#9467bd"}
RESULT_KEYS = ("name", "passed", "bitwise_equal", "lost_steps", "recovery_s", "goodput", "failures", "faults",
               "losses")


def check_result(result: object) -> dict:
    """``result`` must look like what ``hp chaos run --json`` wrote; ValueError names what is missing."""
    if not isinstance(result, dict):
        raise ValueError("not a scenario result: expected a JSON object")
    missing = [k for k in RESULT_KEYS if k not in result]
    if missing:
        raise ValueError(f"not a scenario result (from `hp chaos run --json`): missing {', '.join(missing)}")
    return result


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def format_table(r: dict) -> str:
    rows = [
        ("scenario", r["name"]),
        ("verdict", "PASSED" if r["passed"] else "FAILED"),
        ("completed", "yes" if r.get("completed") else f"no (exit {r.get('returncode')})"),
        ("losses bit-identical", "yes" if r["bitwise_equal"] else "NO"),
        ("lost steps", str(r["lost_steps"])),
        ("goodput", "-" if r["goodput"] is None else f"{r['goodput']:.3f}"),
        ("recoveries", str(r.get("recoveries", "-"))),
    ]
    if r.get("step_time_s") is not None and not math.isnan(r["step_time_s"]):
        rows.append(("step time (reference)", f"{r['step_time_s'] * 1000:.0f} ms"))
    rows += _elastic_rows(r.get("elastic"))
    for f in r["faults"]:
        failover = f", failover {_secs(f['failover_s'])}" if f.get("failover_s") is not None else ""
        rows.append((f["fault"], ("recovery " + _secs(f["recovery_s"]) + failover) if f["fired"] else "NEVER FIRED"))
        rows += [(f"  {name}", f"{secs * 1000:.0f} ms") for name, secs in f["phases"].items()]
    if r.get("orphans_killed"):
        rows.append(("orphans", f"{r['orphans_killed']} processes outlived their agent (killed by the harness)"))
    rows += [("unmet", msg) for msg in r["failures"]]
    if r.get("log_dir"):
        rows.append(("logs", r["log_dir"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _elastic_rows(e: dict | None) -> list[tuple[str, str]]:
    """World sizes, each scale event's pause, and (exact mode) what bit-equality compared."""
    if not e:
        return []
    rows = [("world sizes", " -> ".join(map(str, e["world_sizes"])))]
    for c in e["scale_events"]:
        pause = "-" if c["pause_s"] is None else f"{c['pause_s']:.3f} s"
        rows.append((f"{c['kind']} {c['from']} -> {c['to']}", f"pause {pause} before step {c['first_step_after']} "
                                                             f"(gap {c['gap_s']:.3f} s)"))
    if e.get("exact"):
        rows.append(("every rank's losses", "bit-identical" if e["losses_equal"] else
                     f"DIFFER at steps {e['losses_differ'][:10]}"))
        rows.append(("every rank's final state", "bit-identical" if e["state_equal"] else
                     "DIFFERS: " + "; ".join(e["state_differences"][:4])))
    return rows


def write_png(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here or in CI
    import matplotlib.pyplot as plt

    faults = r["faults"]
    fig, (ax, bars) = plt.subplots(2, 1, figsize=(9, 6.5), height_ratios=[3, max(1, len(faults)) * 0.6 + 0.6])
    ref = {int(s): v[0] for s, v in r["losses"]["reference"].items()}
    ax.plot(sorted(ref), [ref[s] for s in sorted(ref)], "-", color="#7f7f7f", lw=2.5, label="reference (no fault)")
    got = [(int(s), x, i) for s, v in r["losses"]["faulted"].items() for i, x in enumerate(v)]
    first = [(s, x) for s, x, i in got if i == 0]
    again = [(s, x) for s, x, i in got if i > 0]
    ax.plot([s for s, _ in first], [x for _, x in first], "o", ms=4, color="#1f77b4", label="faulted run")
    if again:
        ax.plot([s for s, _ in again], [x for _, x in again], "x", ms=8, color="#d62728",
                label="step committed again (lost work)")
    for i, f in enumerate(faults):
        ax.axvline(f["step"], color="#d62728", ls="--", lw=1)
        ax.annotate(f"F{i}", (f["step"], 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", color="#d62728", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (rank 0, global mean)")
    verdict = "PASSED" if r["passed"] else "FAILED"
    gp = "-" if r["goodput"] is None else f"{r['goodput']:.2f}"
    sizes = f" | world {'->'.join(map(str, r['elastic']['world_sizes']))}" if r.get("elastic") else ""
    ax.set_title(f"{r['name']}: {verdict} | bit-identical: {'yes' if r['bitwise_equal'] else 'NO'} | "
                 f"lost steps: {r['lost_steps']} | goodput: {gp}{sizes}", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)

    seen = set()
    for i, f in enumerate(faults):
        left = 0.0
        # nothing failed (a slow rank, a resumed hang, a dead spare): only the wait for the next commit
        phases = {"no failure: to next commit": f["phases"]["replay"]} if list(f["phases"]) == ["replay"] \
            else f["phases"]
        for name, secs in phases.items():
            bars.barh(i, secs, left=left, color=PHASE_COLORS.get(name, "#c7c7c7"), label=name)
            seen.add(name)
            left += secs
        text = "never fired" if not f["fired"] else ("no commit after it" if f["recovery_s"] is None
                                                     else f"{f['recovery_s']:.2f} s")
        bars.text(left, i, f"  {text}", va="center", fontsize=8)
    bars.set_yticks(range(len(faults)), [f"F{i}: {f['fault']}" for i, f in enumerate(faults)], fontsize=8)
    bars.invert_yaxis()
    bars.set_xlabel("recovery: fault -> next committed step (s)")
    xmax = max([f["recovery_s"] or 0 for f in faults] + [0.1])
    bars.set_xlim(0, xmax * 1.35)
    if seen:  # one entry per phase, in the order recovery goes through them
        handles = dict(zip(*reversed(bars.get_legend_handles_labels())))
        order = [p for p in [*PHASE_COLORS, "no failure: to next commit"] if p in handles]
        bars.legend([handles[p] for p in order], order, fontsize=7, ncol=7, loc="upper center",
                    bbox_to_anchor=(0.5, -0.35), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

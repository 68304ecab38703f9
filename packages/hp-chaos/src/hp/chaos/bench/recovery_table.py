"""The table ``hp bench recovery`` prints: one column per variant, each figure its median [min-max]."""

from __future__ import annotations

from typing import Any

TITLES = {"hp": "hp (1 hot spare)", "hp_fsdp": "hp, FSDP2 (1 hot spare)", "torchrun_dcp": "torchrun + DCP", "torchft": "torchft (heal from peer)",
          "nvrx_default": "NVRx (default intervals)", "nvrx_tuned": "NVRx (tuned intervals)"}


def _spread(value: dict[str, Any] | None) -> str:
    if not value:
        return "-"
    return f"{value['median']:.3f} s [{value['min']:.3f}-{value['max']:.3f}]"


def _verdict(v: dict[str, Any]) -> str:
    for key, note in (("bitwise_equal", "losses + state vs reference"),
                      ("recompute_bitwise_equal", "recomputed vs first run"),
                      ("losses_equal", "losses vs reference")):
        if key in v:
            return f"{'yes' if v[key] else 'NO'} ({note})"
    return "-"


def format_table(r: dict[str, Any]) -> str:
    f, variants = r["fault"], r["variants"]
    head = (f"recovery bench v{r['definition_version']}: model {r['model_size']} ({r['params'] / 1e6:.1f} M params, "
            f"vocab {r['vocab']}), {r['world_size']} ranks{' pinned one per core' if r['one_rank_per_core'] else ''}, "
            f"SIGKILL of rank {f['rank']} after step {f['after_step']} of {r['steps']} ({f['steps_after']} steps "
            f"follow), {r['repeats']} faults per variant; median [min-max]"
            f"{'' if r['repeats'] >= 3 else ' (a smoke run: too few faults for a figure to quote)'}")
    ran = {k: v for k, v in variants.items() if "skipped" not in v}

    def row(label: str, cell) -> tuple[str, ...]:
        return (label, *(cell(v) for v in ran.values()))

    rows = [
        ("", *(TITLES.get(k, k) for k in ran)),
        row("completed", lambda v: "yes" if v.get("completed") else "NO"),
        row("step time before the fault", lambda v: _spread(v.get("step_time_s"))),
        row(f"fault -> step {f['after_step'] + 1} on every rank", lambda v: _spread(v.get("to_next_step_s"))),
        row("downtime (that - step time)", lambda v: _spread(v.get("downtime_s"))),
        row("recovery overhead", lambda v: _spread(v.get("recovery_s"))),
        row("lost / recomputed steps", lambda v: str(v.get("lost_steps", v.get("recomputed_steps", "-")))),
        row("bit-identical", _verdict),
    ]
    width = [max(len(x[i]) for x in rows) for i in range(len(rows[0]))]
    lines = [head, *("  ".join(c.ljust(w) for c, w in zip(x, width)).rstrip() for x in rows)]
    for name, v in ran.items():
        if v.get("phases"):
            lines.append(f"{name} phases (median): " + ", ".join(
                f"{k} {s['median']:.3f} s" for k, s in v["phases"].items() if s))
    if "torchft" in ran and ran["torchft"].get("all_ranks_back_s"):
        lines.append(f"torchft: survivors go on at a smaller world; the restarted group committed again "
                     f"{_spread(ran['torchft']['all_ranks_back_s'])} after the fault (not bit-identical by design)")
    for name, v in variants.items():
        if "skipped" in v:
            lines.append(f"{name}: skipped: {v['skipped']}")
    ratios = ", ".join(f"{k.removesuffix('_over_hp')} / hp {x:.1f}x" for k, x in r["ratios"].items() if x)
    lines += [f"downtime ratios (medians): {ratios or '-'}", f"logs: {r['log_dir']}"]
    for name, v in ran.items():
        tails = [run["error_tail"] for run in v.get("runs", []) if run.get("error_tail")]
        if tails:
            lines.append(f"\nlast output of a failed {name} job:\n{tails[-1]}")
    return "\n".join(lines)

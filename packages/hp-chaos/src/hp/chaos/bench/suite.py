"""``hp bench all --out benchmarks/results/<name>.json``: the whole suite, one file a README can quote.

Each benchmark runs as its own ``hp bench <name> --json`` process (its own argument checks, its own
clean-up, nothing left in this process between two benchmarks), one after the other: two benchmarks
at once would share the cores each of them takes care to give one rank apiece. The file holds the
commit and whether the tree was clean (a figure from uncommitted code cannot be traced), the command,
the machine and every benchmark's own JSON (definition version, machine, load before/after,
spreads, the baseline of the same run), then ``hp goodput simulate`` fed by those measurements
(``goodput_simulation``, its PNG beside the file) when the suite holds the inputs it needs.

A README figure quotes the file with a link whose target names the value:
``[0.79 s](benchmarks/results/<name>.json#benchmarks.recovery.variants.hp.downtime_s.median)``;
``integration/test_readme_figures.py`` resolves every such link and fails when the text is not the
value the file holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from typing import Any

from hp.chaos.bench.meta import machine

SCHEMA = "hp-bench-results/1"

# name -> the arguments of the full run and of --quick (a smoke run of the suite, e.g. for a test)
SUITE: dict[str, tuple[list[str], list[str]]] = {
    "recovery": ([], ["--model-size", "tiny", "--steps", "12", "--fault-step", "6", "--corpus-mb", "2"]),
    "goodput": (["--duration", "120", "--fault-every", "30"],
                ["--duration", "20", "--fault-every", "8", "--corpus-mb", "2"]),
    "ckpt": (["--params", "25e6"], ["--params", "2e6", "--saves", "3", "--rounds", "3"]),
    "elastic": ([], ["--steps", "60", "--kill-step", "4"]),
    "exact": ([], ["--model-size", "tiny", "--steps", "6"]),
    # hp's steady-state step against plain DDP (the 25m model, vocab 8192)
    "step": ([], ["--model-size", "tiny", "--vocab", "256", "--steps", "4", "--warmup", "1", "--repeats", "1",
                  "--corpus-mb", "1"]),
    # a spare's hydration on one node (shared memory, gloo) against a memcpy
    "hydrate": ([], ["--model-size", "tiny", "--vocab", "256", "--repeats", "1"]),
    # a node's start and end, workers forked from one server vs started cold
    "start": (["--repeats", "5"], ["--repeats", "1", "--steps", "3"]),
    "init": ([], ["--ranks", "2,4", "--repeats", "1"]),  # rootless vs TCPStore process-group init
    # what learning about generations costs the store, per-rank polling vs the node relay
    "control": ([], ["--sizes", "16,32", "--processes", "2", "--repeats", "1", "--changes", "2", "--idle", "1"]),
    # hp bench elastic --scheduler slurm: a job following a local Slurm (preemption, capacity back) vs torchrun + DCP
    "elastic_slurm": (["--scheduler", "slurm"], ["--scheduler", "slurm", "--cycles", "1", "--steps", "400"]),
    # hp bench recovery of an FSDP2 model (a shard from its buddy's shadow) beside the replicated one and torchrun + DCP
    "recovery_fsdp": (["--variants", "hp,hp_fsdp,torchrun_dcp"],
                      ["--variants", "hp,hp_fsdp", "--model-size", "tiny", "--steps", "12", "--fault-step", "6",
                       "--corpus-mb", "2"]),
}
COMMANDS = {"elastic_slurm": "elastic", "recovery_fsdp": "recovery"}  # a suite entry that is another entry's command with other arguments


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def source() -> dict[str, Any]:
    """The commit the suite ran from and whether the tree had uncommitted changes to tracked files."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": _git("rev-parse", "HEAD"), "clean_tree": status == "" if status is not None else None}


def run_one(name: str, args: list[str], log=print, command: tuple[str, ...] = ("bench",)) -> dict[str, Any]:
    """``hp bench <name> --json ARGS`` (``hp <name>`` for ``command=()``) in a child process: its JSON
    (the last stdout line), or why not."""
    cmd = [sys.executable, "-m", "hp.core.cli", *command, COMMANDS.get(name, name), "--json", *args]
    log(f"hp bench all: {' '.join(cmd[3:])}")
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    if not isinstance(result, dict):
        return {"completed": False, "returncode": proc.returncode, "args": args,
                "error_tail": (proc.stdout + proc.stderr)[-3000:]}
    result.setdefault("completed", proc.returncode == 0)
    return {**result, "returncode": proc.returncode, "args": args, "suite_wall_s": time.monotonic() - start}


def run_all(names: list[str], quick: bool, log=print) -> dict[str, Any]:
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    results = {name: run_one(name, SUITE[name][1 if quick else 0], log) for name in names}
    # hp demo's own table (README's first figures): the product as a new user first sees it
    demo = run_one("demo", [] if not quick else ["--steps", "8"], log, command=())
    return {"schema": SCHEMA, "created": started, **source(), "quick": quick, "demo": demo,
            "command": " ".join(["hp", "bench", "all", *sys.argv[3:]]) if sys.argv[1:3] == ["bench", "all"] else None,
            "machine": machine(), "benchmarks": results,
            "completed": all(r.get("completed") for r in [*results.values(), demo])}


def simulate(path: str, log=print) -> dict[str, Any]:
    """``hp goodput simulate`` fed by the file just written (its measured inputs), PNG beside it: the
    cluster-scale figures a README quotes live in the same file as the measurements behind them."""
    png = path.removesuffix(".json") + "_goodput_vs_gpus.png"
    cmd = [sys.executable, "-m", "hp.core.cli", "goodput", "simulate", "--results", path, "--png", png, "--json"]
    log(f"hp bench all: {' '.join(cmd[3:])}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"completed": False, "returncode": proc.returncode, "error_tail": (proc.stdout + proc.stderr)[-3000:]}
    return {"completed": True, **json.loads(lines[-1]), "png": os.path.basename(png)}


def write(result: dict[str, Any], path: str) -> None:
    """Write the file atomically (a killed run leaves the previous file, not half of one)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def format_table(r: dict[str, Any]) -> str:
    lines = [f"hp bench all at {r['commit'] or '?'} ({'clean tree' if r['clean_tree'] else 'UNCOMMITTED CHANGES'}), "
             f"{r['machine']['cores']} cores"]
    for name, b in r["benchmarks"].items():
        wall = b.get("suite_wall_s")
        lines.append(f"  {name:10} {'ok' if b.get('completed') else 'FAILED'}"
                     f"{f'  ({wall:.0f} s)' if wall is not None else ''}"
                     f"{'  definition v' + str(b['definition_version']) if 'definition_version' in b else ''}")
        if not b.get("completed") and b.get("error_tail"):  # a failure says why, not only that it failed
            lines += [f"    | {line}" for line in b["error_tail"].strip().splitlines()[-8:]]
    return "\n".join(lines)

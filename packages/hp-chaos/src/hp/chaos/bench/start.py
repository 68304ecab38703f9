"""``hp bench start``: how long a node takes to start its workers and to end, per ``hp run --start-method``.

The same fault-free job (``hp demo``'s training, :mod:`hp.checkpointless.demo.train`: the tiny model, a
few steps, ``nproc`` ranks and ``spares`` hot spares on this node) runs under ``hp run`` once per start
method and repeat, the methods alternating (in order, then reversed, ...) so that neither always runs
first. The token cache is built by one untimed job beforehand, so no job pays for it.

* ``spawn``: each worker and spare is a new interpreter started by torch elastic (as torchrun does): it
  imports torch, and ``torch._dynamo`` at its first optimizer, and tears all of it down at exit;
* ``forkserver`` (the default): one server per node imports them once, before the node joins, and forks
  every worker; a forked worker ends without the interpreter's teardown (:mod:`hp.core.forkserver`).

Per job, from its events (wall clock): ``first_commit_s``, from ``hp run`` started to the first committed
step (the agent's start, the rendezvous, every worker's start, the group, step 0); ``exit_s``, from the
last rank's ``final_state`` to ``hp run``'s exit (the workers' and the agent's ends); ``total_s``, the
job's wall time. ``ratio`` is the forkserver median over the spawn median of each. The ranks are not
pinned: a node's workers start together on its cores, which is what is measured (``cores`` says how
many there were for how many processes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hp.chaos.bench.meta import BenchRun, report, spread
from hp.core.errors import UsageError

METHODS = ("spawn", "forkserver")
DEFINITION_VERSION = 1
FIGURES = ("first_commit_s", "exit_s", "total_s")


@dataclass
class StartBenchConfig:
    nproc: int = 2  # ranks on this node (one per core on the 2-core box)
    spares: int = 1
    steps: int = 10
    repeats: int = 3  # jobs per start method, alternating
    model_size: str = "tiny"
    corpus_mb: int = 2
    timeout_s: float = 600.0

    def check(self) -> None:
        for name, low in (("nproc", 1), ("spares", 0), ("steps", 1), ("repeats", 1), ("corpus_mb", 1)):
            if getattr(self, name) < low:
                raise UsageError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")


def _job(cfg: StartBenchConfig, method: str, log_dir: Path, env: dict[str, str]) -> dict[str, float]:
    from hp.checkpointless.demo.run import DemoConfig, job_command
    from hp.checkpointless.events import read_events

    demo = DemoConfig(steps=cfg.steps, nproc=cfg.nproc, spares=cfg.spares, model_size=cfg.model_size,
                      corpus_mb=cfg.corpus_mb, hang_timeout_s=30.0)
    started = time.time()
    done = subprocess.run(job_command(demo, str(log_dir), ["--start-method", method]), env=env,
                          capture_output=True, text=True, timeout=cfg.timeout_s)
    ended = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"hp bench start: the {method} job failed ({done.returncode}): "
                           f"{(done.stdout + done.stderr)[-2000:]}")
    events = read_events(str(log_dir / "events"))
    commits = [e["t"] for e in events if e["event"] == "commit"]
    finals = [e["t"] for e in events if e["event"] == "final_state"]
    if len(finals) != cfg.nproc or not commits:
        raise RuntimeError(f"hp bench start: the {method} job left {len(finals)} final states of {cfg.nproc}")
    return {"first_commit_s": min(commits) - started, "exit_s": ended - max(finals), "total_s": ended - started}


def run(cfg: StartBenchConfig) -> dict[str, Any]:
    cfg.check()
    bench = BenchRun("start", DEFINITION_VERSION)
    times: dict[str, dict[str, list[float]]] = {m: {f: [] for f in FIGURES} for m in METHODS}
    with tempfile.TemporaryDirectory(prefix="hp-bench-start-") as tmp:
        env = {**os.environ, "HP_FAULTS": "[]", "HP_DATA_CACHE_DIR": os.path.join(tmp, "cache")}
        _job(cfg, "forkserver", Path(tmp) / "warmup", env)  # builds the token cache: no timed job pays for it
        for r in range(cfg.repeats):
            for method in (METHODS if r % 2 == 0 else METHODS[::-1]):
                got = _job(cfg, method, Path(tmp) / f"{method}-{r}", env)
                for figure, value in got.items():
                    times[method][figure].append(value)
    result: dict[str, Any] = {**asdict(cfg), "cores": len(os.sched_getaffinity(0)),
                              "processes": cfg.nproc + cfg.spares,
                              "methods": {m: {f: spread(times[m][f]) for f in FIGURES} for m in METHODS}}
    result["ratio"] = {f: round(statistics.median(times["forkserver"][f]) / statistics.median(times["spawn"][f]), 3)
                       for f in FIGURES}
    return bench.stamp(result)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from hp.checkpointless.demo.workload import add_workload_args

    d = StartBenchConfig()
    p.add_argument("--nproc", type=int, default=d.nproc, help="ranks on the node")
    p.add_argument("--spares", type=int, default=d.spares, help="hot spares on the node")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps per job")
    p.add_argument("--repeats", type=int, default=d.repeats, help="jobs per start method, alternating")
    add_workload_args(p, "model_size", "corpus_mb", model_size=d.model_size, corpus_mb=d.corpus_mb,
                      helps={"model_size": "tiny | small | 25m"})
    p.add_argument("--out", default=None, help="also write the result JSON here")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")


def format_table(r: dict[str, Any]) -> str:
    def s(x: dict) -> str:
        return f"{x['median']:.2f} s [{x['min']:.2f}-{x['max']:.2f}]"

    lines = [f"hp bench start: {r['nproc']} ranks + {r['spares']} spare(s) on {r['cores']} cores, {r['steps']} "
             f"{r['model_size']} steps, {r['repeats']} job(s) per start method"
             + ("" if r["repeats"] >= 3 else " (a smoke run: too few jobs for a median)"),
             f"{'':12}{'to first commit':>26}{'last step to exit':>26}{'job':>26}"]
    for m in METHODS:
        lines.append(f"{m:12}" + "".join(f"{s(r['methods'][m][f]):>26}" for f in FIGURES))
    lines.append("forkserver / spawn: " + ", ".join(f"{f} {r['ratio'][f]:.2f}" for f in FIGURES))
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    cfg = StartBenchConfig(nproc=args.nproc, spares=args.spares, steps=args.steps, repeats=args.repeats,
                           model_size=args.model_size, corpus_mb=args.corpus_mb)
    result = run(cfg)
    return report(result, format_table(result), args)

"""``hp bench goodput``: how much of the wall time a job spends on useful steps while ranks keep dying.

The job is ``hp demo``'s (:mod:`hp.checkpointless.demo.train`) under ``hp run --spares S
--replenish-spares``, with a step count no run reaches: it is stopped after the measured window.

1. **Baseline**, fault-free, in the same run: the job trains for ``baseline_s`` seconds after its
   first commit; its mean step time is what a step costs without faults.
2. **Faulted**: the same job trains for ``duration_s`` seconds after its first commit while a
   random rank (seeded) is SIGKILLed every ``fault_every_s`` seconds. The victim is whichever
   process holds that rank then: promoted spares die too, and each promotion is replaced by a new spare.

**goodput** = (distinct steps committed in the window x the run's own median step time) / window:
downtime and replayed steps count against it. The median step of the faulted run itself is the
pace, because on a shared machine the load can differ between two runs minutes apart (the baseline
run's pace gives ``goodput_vs_baseline``, which also charges the slowdown of starting replacement
spares). Startup (``import torch``, model build) is outside both windows. Also reported: recoveries (faults after which rank 0
committed in a new generation) with their fault → first-commit times, lost steps (steps committed
twice), and bit-equality of every step both runs committed (same job, same schedule). A recovery
still running when the window closes is waited for (it counts in the recovery times, not in goodput).
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from itertools import pairwise

from hp.chaos.multinode import recovery_after
from hp.checkpointless.demo.run import DemoConfig, job_command
from hp.checkpointless.events import read_events

NEVER = 10**7  # steps: the window ends the job, not the step count


@dataclass
class GoodputConfig:
    duration_s: float = 300.0
    fault_every_s: float = 30.0
    baseline_s: float = 30.0
    nproc: int = 4
    spares: int = 1
    model_size: str = "tiny"
    corpus_mb: int = 16
    seed: int = 0
    hang_timeout_s: float = 10.0
    log_dir: str | None = None


def _log(msg: str) -> None:
    print(f"hp bench goodput: {msg}", file=sys.stderr, flush=True)


def _command(cfg: GoodputConfig, log_dir: str) -> list[str]:
    demo = DemoConfig(nproc=cfg.nproc, spares=cfg.spares, steps=NEVER, model_size=cfg.model_size,
                      corpus_mb=cfg.corpus_mb, seed=cfg.seed, hang_timeout_s=cfg.hang_timeout_s)
    cmd = job_command(demo, log_dir)
    at = cmd.index("run") + 1
    return [*cmd[:at], "--replenish-spares", *cmd[at:]]


def _commits(events: list[dict]) -> list[dict]:
    return [e for e in events if e["event"] == "commit" and e.get("rank") == 0]


def _holder_pid(events: list[dict], rank: int) -> int | None:
    """The process that most recently formed a group as ``rank``."""
    ready = [e for e in events if e["event"] == "pg_ready" and e.get("rank") == rank]
    return ready[-1]["pid"] if ready else None


class _Job:
    def __init__(self, cfg: GoodputConfig, log_dir: str, env: dict[str, str]) -> None:
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self.out_path = os.path.join(log_dir, "hp_run.out")
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(_command(cfg, log_dir), env={**os.environ, "HP_FAULTS": "[]", **env},
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def events(self) -> list[dict]:
        return read_events(os.path.join(self.log_dir, "events"))

    def first_commit(self, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            commits = _commits(self.events())
            if commits:
                return commits[0]["t"]
            time.sleep(0.05)
        raise RuntimeError(f"the job never committed a step (exit {self.proc.poll()}):\n{self.output()[-3000:]}")

    def stop(self) -> int | None:
        """SIGTERM to the agent (it stops its workers), then SIGKILL of the whole session."""
        rc = self.proc.poll()
        if rc is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        return rc  # None: it was still running, as it should be at the window's end

    def output(self) -> str:
        with open(self.out_path) as f:
            return f.read()


def _window(events: list[dict], start: float, end: float) -> dict[int, list[str]]:
    steps: dict[int, list[str]] = {}
    for e in _commits(events):
        if start <= e["t"] <= end:
            steps.setdefault(e["step"], []).append(e["loss"])
    return steps


def run_bench(cfg: GoodputConfig) -> dict:
    root = cfg.log_dir or tempfile.mkdtemp(prefix="hp_bench_goodput_")
    env = {"HP_DATA_CACHE_DIR": os.environ.get("HP_DATA_CACHE_DIR", os.path.join(root, "cache"))}
    os.makedirs(env["HP_DATA_CACHE_DIR"], exist_ok=True)
    rng = random.Random(cfg.seed)

    _log(f"baseline: fault-free for {cfg.baseline_s:g} s")
    base = _Job(cfg, os.path.join(root, "baseline"), env)
    try:
        t0 = base.first_commit(600)
        time.sleep(max(0.0, t0 + cfg.baseline_s - time.time()))
        still_running = base.stop() is None
    finally:
        base.stop()
    base_steps = _window(base.events(), t0, t0 + cfg.baseline_s)
    times = [e["t"] for e in _commits(base.events()) if t0 <= e["t"] <= t0 + cfg.baseline_s]
    intervals = [b - a for a, b in pairwise(times)][2:]  # the first steps warm caches up
    if not still_running or len(intervals) < 3:
        raise RuntimeError(f"baseline ran {len(times)} steps in {cfg.baseline_s:g} s (exit {base.proc.poll()}): "
                           f"lengthen --baseline\n{base.output()[-2000:]}")
    step_s = statistics.fmean(intervals)

    _log(f"faulted: {cfg.duration_s:g} s, SIGKILL of a random rank every {cfg.fault_every_s:g} s")
    job = _Job(cfg, os.path.join(root, "faulted"), env)
    faults: list[dict] = []
    try:
        t0 = job.first_commit(600)
        end, next_fault = t0 + cfg.duration_s, t0 + cfg.fault_every_s
        while time.time() < end and job.proc.poll() is None:
            if time.time() >= next_fault:
                next_fault += cfg.fault_every_s
                rank = rng.randrange(cfg.nproc)
                pid = _holder_pid(job.events(), rank)
                if pid is not None:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        faults.append({"t": time.time(), "rank": rank, "pid": pid})
                        _log(f"killed rank {rank} (pid {pid})")
                    except ProcessLookupError:
                        pass
            time.sleep(0.02)
        # goodput counts the window only; a recovery still running at its end is let finish (a
        # bounded wait) so that every fault gets a recovery time
        settle = time.monotonic() + 120
        while job.proc.poll() is None and time.monotonic() < settle and any(
                recovery_after(job.events(), f["t"])["recovery_s"] is None for f in faults):
            time.sleep(0.1)
        completed = job.stop() is None
    finally:
        job.stop()
    events = job.events()
    steps = _window(events, t0, end)
    recoveries = [recovery_after(events, f["t"]) for f in faults]
    recovered = [r["recovery_s"] for r in recoveries if r["recovery_s"] is not None]
    decisions = _decisions(job.log_dir)
    shared = set(steps) & set(base_steps)
    own = [b["t"] - a["t"] for a, b in pairwise(_commits(events)) if t0 <= a["t"] and b["t"] <= end]
    own_step_s = statistics.median(own) if own else float("nan")
    result = {
        "goodput": len(steps) * own_step_s / cfg.duration_s,
        "goodput_vs_baseline": len(steps) * step_s / cfg.duration_s,
        "faulted_median_step_s": own_step_s,
        "duration_s": cfg.duration_s,
        "fault_every_s": cfg.fault_every_s,
        "faults": len(faults),
        "recoveries": len(recovered),
        "recovery_s": {"median": statistics.median(recovered), "max": max(recovered)} if recovered else None,
        "lost_steps": sum(len(v) - 1 for v in steps.values()),
        "steps_committed": len(steps),
        "steps_at_baseline_rate": cfg.duration_s / step_s,
        "baseline": {"step_time_s": step_s, "steps_per_s": 1 / step_s, "window_s": cfg.baseline_s,
                     "steps": len(base_steps)},
        "faulted_steps_per_s": len(steps) / cfg.duration_s,
        "bitwise_equal_steps": len(shared),
        "bitwise_equal": all(set(steps[s]) == set(base_steps[s]) for s in shared),
        "promotions": sum(d == "promote_spare" for d in decisions),
        "spares_added": sum(d == "spare_added" for d in decisions),
        "restarts": sum(d == "restart_worker" for d in decisions),
        "completed": completed and len(recovered) == len(faults),
        "config": asdict(cfg),
        "log_dir": root,
    }
    if not result["completed"]:
        result["error_tail"] = job.output()[-2000:]
    return result


def _decisions(log_dir: str) -> list[str]:
    path = os.path.join(log_dir, "controller_decisions.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["decision"] for line in f if line.strip()]


def format_table(r: dict) -> str:
    rec = r["recovery_s"]
    rows = [
        ("job", f"{r['config']['nproc']} workers + {r['config']['spares']} spare (replenished), "
                f"model {r['config']['model_size']}, gloo"),
        ("faults", f"SIGKILL of a random rank every {r['fault_every_s']:g} s for {r['duration_s']:g} s: {r['faults']}"),
        ("completed", "yes" if r["completed"] else "NO"),
        ("baseline step time", f"{r['baseline']['step_time_s'] * 1000:.1f} ms (fault-free, same run)"),
        ("goodput", f"{r['goodput'] * 100:.1f} % at the run's own median step "
                    f"({r['faulted_median_step_s'] * 1000:.1f} ms); {r['goodput_vs_baseline'] * 100:.1f} % "
                    f"vs the baseline ({r['steps_committed']} steps vs {r['steps_at_baseline_rate']:.0f})"),
        ("recoveries", f"{r['recoveries']}/{r['faults']}" + (
            f", fault -> next commit median {rec['median']:.2f} s, max {rec['max']:.2f} s" if rec else "")),
        ("lost steps", str(r["lost_steps"])),
        ("spares", f"{r['promotions']} promoted, {r['spares_added']} started to replace them, "
                   f"{r['restarts']} process restarts"),
        ("losses bit-identical", f"{'yes' if r['bitwise_equal'] else 'NO'} "
                                 f"({r['bitwise_equal_steps']} steps both runs committed)"),
        ("logs", r["log_dir"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

"""``hp bench goodput``: how much of the wall time a job spends on useful steps while ranks keep dying.

The job is ``hp demo``'s (:mod:`hp.checkpointless.demo.train`) under ``hp run --spares S
--replenish-spares``, with a step count no run reaches: it is stopped after the measured window.

1. **Baseline**, fault-free, in the same run: the job trains for ``baseline_s`` seconds after its
   first commit; its mean step time is what a step costs without faults.
2. **Faulted**: the same job trains for ``duration_s`` seconds after its first commit while a
   random rank (seeded) is SIGKILLed every ``fault_every_s`` seconds. The victim is whichever
   process holds that rank then: promoted spares die too, and each promotion is replaced by a new spare.

**goodput** = (distinct steps committed in the window x the fault-free step time) / window:
downtime, replayed steps and steps slowed by a fault's aftermath all count against it. The fault-free
step time is the median step of the faulted run's *quiet* stretches (after a fault's replacement spare
reported ready, before the next fault): the same job under the same machine load, which on a shared
machine can differ between two runs minutes apart. (A median over the whole run would hide the
slowdown while replacements start; the separate baseline run's pace gives ``goodput_vs_baseline``.)
Startup (``import torch``, model build) is outside both windows.

Per fault: ``recovery_s`` (fault -> rank 0's first commit in a new generation), ``ready_s`` (fault ->
its replacement spare reported ready), that spare's CPU seconds to get ready, and the time the fault
cost: wall time from the fault to the later of those two minus the steps committed meanwhile at the
quiet pace (``down_s`` before the first commit, ``slow_s`` after). Also reported: lost steps (committed
twice) and bit-equality of every step both runs committed (same job, same schedule). A recovery still
running when the window closes is waited for (it counts in the recovery times, not in goodput).
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
from hp.core.protocol import Decision, Event

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
    return [e for e in events if e["event"] == Event.COMMIT and e.get("rank") == 0]


def _holder_pid(events: list[dict], rank: int) -> int | None:
    """The process that most recently formed a group as ``rank``."""
    ready = [e for e in events if e["event"] == Event.PG_READY and e.get("rank") == rank]
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
        # one clock reading per pass: a fault is due only inside the window (two readings let a pass
        # that began just before its end fire one more fault at the end: 3 faults in 30 s every 10 s)
        while (now := time.time()) < end and job.proc.poll() is None:
            if now >= next_fault:
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
    commits = [e["t"] for e in _commits(events) if t0 <= e["t"] <= end]
    own = [b - a for a, b in pairwise(commits)]
    per_fault = _aftermath(events, decisions, faults, recoveries, end)
    quiet = [b - a for a, b in pairwise(commits) if not any(f["t"] <= b and a <= f["until"] for f in per_fault)]
    ref_s = statistics.median(quiet) if len(quiet) >= 3 else float("nan")
    for f in per_fault:
        _charge(f, commits, ref_s)
    result = {
        "goodput": len(steps) * ref_s / cfg.duration_s,
        "goodput_vs_baseline": len(steps) * step_s / cfg.duration_s,
        "quiet_step_s": ref_s,
        "quiet_steps": len(quiet),
        "faulted_median_step_s": statistics.median(own) if own else float("nan"),
        "lost_s": cfg.duration_s - len(steps) * ref_s,
        "lost_to_faults_s": {k: sum(f[k] for f in per_fault) for k in ("down_s", "slow_s")},
        "per_fault": per_fault,
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
        "promotions": sum(d["decision"] == Decision.PROMOTE_SPARE for d in decisions),
        "spares_added": sum(d["decision"] == Decision.SPARE_ADDED for d in decisions),
        "restarts": sum(d["decision"] == Decision.RESTART_WORKER for d in decisions),
        "completed": completed and len(recovered) == len(faults),
        "config": asdict(cfg),
        "log_dir": root,
    }
    if not result["completed"]:
        result["error_tail"] = job.output()[-2000:]
    return result


def _decisions(log_dir: str) -> list[dict]:
    path = os.path.join(log_dir, "controller_decisions.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _aftermath(events: list[dict], decisions: list[dict], faults: list[dict], recoveries: list[dict],
               end: float) -> list[dict]:
    """Each fault's replacement spare (the first one added after the fault's promotion) and when it
    was ready; a fault's aftermath lasts until the job committed again and that spare was ready
    (cut at the next fault or the window's end)."""
    out = []
    for i, (fault, rec) in enumerate(zip(faults, recoveries)):
        later = [d for d in decisions if d["t"] >= fault["t"]]
        promoted = next((d for d in later if d["decision"] == Decision.PROMOTE_SPARE), None)
        added = next((d for d in later if d["decision"] == Decision.SPARE_ADDED and promoted
                      and d["t"] >= promoted["t"]), None)
        ready = next((e for e in events if e["event"] == Event.SPARE_READY and added
                      and e.get("spare") == added["spare"]), None)
        cut = faults[i + 1]["t"] if i + 1 < len(faults) else end
        recovery, ready_s = rec["recovery_s"], ready["t"] - fault["t"] if ready else None
        until = fault["t"] + max(recovery or 0.0, ready_s if ready_s is not None else cut - fault["t"])
        out.append({"rank": fault["rank"], "recovery_s": recovery, "ready_s": ready_s,
                    "promoted_ready": promoted.get("ready") if promoted else None,
                    "spare_cpu_s": ready.get("cpu_s") if ready else None,
                    "t": fault["t"], "until": min(until, cut)})
    return out


def _charge(f: dict, commits: list[float], ref_s: float) -> None:
    """Time one fault cost: its aftermath's wall time minus the steps committed in it at the quiet
    pace, split at the first commit after it (``down_s``: recovery; ``slow_s``: the job ran slower)."""
    t, until = f.pop("t"), f.pop("until")
    first = min(t + (f["recovery_s"] or 0.0), until)
    f["down_s"] = (first - t) - sum(t < c <= first for c in commits) * ref_s
    f["slow_s"] = (until - first) - sum(first < c <= until for c in commits) * ref_s


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def format_table(r: dict) -> str:
    rec, lost = r["recovery_s"], r["lost_to_faults_s"]
    ready = [f["ready_s"] for f in r["per_fault"] if f["ready_s"] is not None]
    cpu = [f["spare_cpu_s"] for f in r["per_fault"] if f["spare_cpu_s"] is not None]
    promoted_starting = sum(f["promoted_ready"] is False for f in r["per_fault"])
    rows = [
        ("job", f"{r['config']['nproc']} workers + {r['config']['spares']} spare (replenished), "
                f"model {r['config']['model_size']}, gloo"),
        ("faults", f"SIGKILL of a random rank every {r['fault_every_s']:g} s for {r['duration_s']:g} s: {r['faults']}"),
        ("completed", "yes" if r["completed"] else "NO"),
        ("baseline step time", f"{r['baseline']['step_time_s'] * 1000:.1f} ms (fault-free, same run)"),
        ("goodput", f"{r['goodput'] * 100:.1f} % at the quiet step ({r['quiet_step_s'] * 1000:.1f} ms, median of "
                    f"{r['quiet_steps']} away from faults); {r['goodput_vs_baseline'] * 100:.1f} % "
                    f"vs the baseline ({r['steps_committed']} steps vs {r['steps_at_baseline_rate']:.0f})"),
        ("time lost", f"{r['lost_s']:.1f} s: {lost['down_s']:.1f} s down (fault -> next commit), "
                      f"{lost['slow_s']:.1f} s slower steps until the replacement spare was ready, "
                      f"{r['lost_s'] - lost['down_s'] - lost['slow_s']:.1f} s elsewhere"),
        ("recoveries", f"{r['recoveries']}/{r['faults']}" + (
            f", fault -> next commit median {rec['median']:.2f} s, max {rec['max']:.2f} s" if rec else "")),
        ("replacement spares", f"ready {_median(ready):.1f} s after the fault (median), "
                               f"{_median(cpu):.1f} CPU s each; {promoted_starting} promoted before ready"),
        ("lost steps", str(r["lost_steps"])),
        ("spares", f"{r['promotions']} promoted, {r['spares_added']} started to replace them, "
                   f"{r['restarts']} process restarts"),
        ("losses bit-identical", f"{'yes' if r['bitwise_equal'] else 'NO'} "
                                 f"({r['bitwise_equal_steps']} steps both runs committed)"),
        ("logs", r["log_dir"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

"""``hp bench goodput``: how much of the wall time a job spends on useful steps while ranks keep dying.

The job is ``hp demo``'s (:mod:`hp.checkpointless.demo.train`) under ``hp run --spares S
--replenish-spares``, one rank per core (``HP_PIN_CORES=1``), with a step count no run reaches: it is
stopped after the measured window. Both runs are in the same invocation and last the same window of
``duration_s`` seconds after their first commit (``import torch`` and the model build are outside it):

1. **faulted**: a random rank (seeded) is SIGKILLed every ``fault_every_s`` seconds. The victim is
   whichever process holds that rank then: promoted spares die too, and each promotion is replaced.
2. **fault-free**: its median step time ``s`` over the window is what a step costs without faults,
   and its committed steps are the reference every faulted step is compared with: it trains past the
   window until it has committed the faulted run's last step (run first, under a quieter or busier
   machine than the faulted one, a time-boxed reference once missed the faulted run's last steps).

**goodput** (definition version :data:`DEFINITION_VERSION`) = the steps the faulted run committed
over the steps a fault-free run commits in the same wall time, where "a fault-free run" is the
faulted run itself with each fault's aftermath replaced by steps at the fault-free pace ``s``:
``1 - sum(cost_f) / duration_s``. A fault's aftermath lasts from the fault until the job committed
again and its replacement spare was ready (cut at the next fault and at the window's end), from the
last commit before it (the step it interrupted is lost work); its cost is the aftermath's wall time
minus the new steps committed in it times ``s``, never below 0 (a fault does not give time back). Aftermaths do not overlap and lie in the window, so goodput is in [0, 1] by
construction; recovery, replayed work and slower steps while a replacement starts all count against
it, step-time jitter away from faults does not (on a shared machine it would swamp the faults).
``steps_committed`` and ``steps_fault_free`` (the fault-free run's count in the same window) are
reported beside it. One statistic throughout: medians (with min and max).

Per fault: ``recovery_s`` (fault -> rank 0's first commit in a new generation), ``ready_s`` (fault ->
its replacement spare reported ready), that spare's CPU seconds to get ready, and the time it cost
(``down_s`` until the first commit, ``slow_s`` after it while the replacement started). Bit-equality
covers every step the faulted run committed, after every fault, against the fault-free run: every
rank's local loss and the global mean. A recovery still running when the window closes is waited for
(it counts in the recovery times, not in goodput).
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

from hp.chaos.bench.meta import BenchRun, spread
from hp.chaos.multinode import recovery_after
from hp.checkpointless.demo.run import DemoConfig, RunResult, differing_steps, job_command
from hp.checkpointless.events import read_events
from hp.core.devices import PIN_ENV
from hp.core.protocol import Decision, Event

DEFINITION_VERSION = 2
NEVER = 10**7  # steps: the window ends the job, not the step count
REFERENCE_TIMEOUT_S = 600.0  # past the window, for the fault-free run to reach the faulted run's last step


@dataclass
class GoodputConfig:
    duration_s: float = 300.0
    fault_every_s: float = 30.0
    nproc: int = 2  # one rank per core on a 2-core box (and the spare takes the dead rank's core)
    spares: int = 1
    model_size: str = "tiny"
    corpus_mb: int = 16
    seed: int = 0
    hang_timeout_s: float = 10.0
    pin: bool = True
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


def _new_commits(events: list[dict], start: float, end: float) -> list[float]:
    """Times of rank 0's commits of *new* steps in [start, end] (a step committed again is not new)."""
    seen, out = set(), []
    for e in sorted(_commits(events), key=lambda e: e["t"]):
        if e["step"] not in seen:
            seen.add(e["step"])
            if start <= e["t"] <= end:
                out.append(e["t"])
    return out


def goodput(costs: list[float], duration_s: float) -> float:
    """``1 - sum(costs) / duration_s``: each cost is a fault's, >= 0, from aftermaths that do not
    overlap and lie in the window (:func:`charge`), so the result is in [0, 1]."""
    return 1.0 - sum(costs) / duration_s


def _fault_free(cfg: GoodputConfig, root: str, env: dict[str, str], last_step: int) -> tuple[_Job, float]:
    """The reference run: the window, then on until every rank has recorded the faulted run's last
    step. That is when one rank committed the step after it (whose vote every rank joined after
    recording its own commit of ``last_step``); stopped at the first rank's record of ``last_step``,
    the others' local losses of it could be missing (seen: a step the faulted run had rank 0's loss
    for and the reference did not, counted as differing)."""
    _log(f"fault-free: {cfg.duration_s:g} s, then on to step {last_step + 1} (the faulted run's last + 1)")
    job = _Job(cfg, os.path.join(root, "fault-free"), env)
    try:
        t0 = job.first_commit(600)
        time.sleep(max(0.0, t0 + cfg.duration_s - time.time()))
        deadline = time.monotonic() + REFERENCE_TIMEOUT_S
        while max(RunResult(0, 0.0, job.events(), "").losses(), default=-1) <= last_step:
            if job.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fault-free job did not reach step {last_step + 1} (exit {job.proc.poll()})"
                                   f":\n{job.output()[-2000:]}")
            time.sleep(0.5)  # past the window: each look reads every rank's events
        if job.stop() is not None:
            raise RuntimeError(f"the fault-free job ended early (exit {job.proc.returncode}):\n{job.output()[-2000:]}")
    finally:
        job.stop()
    return job, t0


def _faulted(cfg: GoodputConfig, root: str, env: dict[str, str]) -> tuple[_Job, float, list[dict], bool]:
    _log(f"faulted: {cfg.duration_s:g} s, SIGKILL of a random rank every {cfg.fault_every_s:g} s")
    rng = random.Random(cfg.seed)
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
    return job, t0, faults, completed


def run_bench(cfg: GoodputConfig) -> dict:
    run = BenchRun("goodput", DEFINITION_VERSION)
    root = cfg.log_dir or tempfile.mkdtemp(prefix="hp_bench_goodput_")
    env = {"HP_DATA_CACHE_DIR": os.environ.get("HP_DATA_CACHE_DIR", os.path.join(root, "cache")),
           **({PIN_ENV: "1"} if cfg.pin else {})}
    os.makedirs(env["HP_DATA_CACHE_DIR"], exist_ok=True)

    job, t0, faults, completed = _faulted(cfg, root, env)
    events, end = job.events(), t0 + cfg.duration_s
    commits = _new_commits(events, t0, end)
    faulted_run = RunResult(0, 0.0, events, "")
    free, f0 = _fault_free(cfg, root, env, max(faulted_run.losses(), default=-1))
    free_events = free.events()
    free_commits = _new_commits(free_events, f0, f0 + cfg.duration_s)
    intervals = [b - a for a, b in pairwise(free_commits)][2:]  # the first steps warm caches up
    if len(intervals) < 3:
        raise RuntimeError(f"the fault-free job committed {len(free_commits)} steps in {cfg.duration_s:g} s: "
                           f"lengthen --duration\n{free.output()[-2000:]}")
    step_s = statistics.median(intervals)

    recoveries = [recovery_after(events, f["t"]) for f in faults]
    recovered = [r["recovery_s"] for r in recoveries if r["recovery_s"] is not None]
    decisions = _decisions(job.log_dir)
    per_fault = _aftermath(events, decisions, faults, recoveries, end)
    charge(per_fault, commits, step_s, t0)
    # bit-equality: every step the faulted run committed (in the window or after it), every rank's
    # local loss and the global mean, against the fault-free run
    free_run = RunResult(0, 0.0, free_events, "")
    steps = faulted_run.losses()
    unmatched = [s for s in steps if s not in free_run.losses()]
    differing = [s for s in differing_steps(free_run, faulted_run) if s in steps]
    last_fault_step = max((e["step"] for e in _commits(events) if faults and e["t"] < faults[-1]["t"]), default=-1)
    result = {
        "goodput": goodput([f["cost_s"] for f in per_fault], cfg.duration_s),
        "definition": "1 - sum over faults of max(0, aftermath wall time - new steps in it x fault-free median "
                      "step) / window",
        "fault_free_step_s": spread(intervals),
        "steps_committed": len(commits),
        "steps_fault_free": len(free_commits),
        "lost_s": sum(f["cost_s"] for f in per_fault),
        "lost_to_faults_s": {k: sum(f[k] for f in per_fault) for k in ("down_s", "slow_s")},
        "per_fault": per_fault,
        "duration_s": cfg.duration_s,
        "fault_every_s": cfg.fault_every_s,
        "faults": len(faults),
        "recoveries": len(recovered),
        "recovery_s": spread(recovered),
        "ready_s": spread(f["ready_s"] for f in per_fault),
        "lost_steps": sum(len(v) - 1 for v in steps.values()),
        "bitwise_equal_steps": len(steps) - len(unmatched),
        "steps_after_last_fault": sum(s > last_fault_step for s in steps) if faults else 0,
        "unmatched_steps": len(unmatched),
        "differing_steps": len(differing),
        "bitwise_equal": not differing and not unmatched,
        "promotions": sum(d["decision"] == Decision.PROMOTE_SPARE for d in decisions),
        "spares_added": sum(d["decision"] == Decision.SPARE_ADDED for d in decisions),
        "restarts": sum(d["decision"] == Decision.RESTART_WORKER for d in decisions),
        "completed": completed and len(recovered) == len(faults),
        "config": asdict(cfg),
        "log_dir": root,
    }
    if not result["completed"]:
        result["error_tail"] = job.output()[-2000:]
    return run.stamp(result)


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


def charge(faults: list[dict], commits: list[float], step_s: float, start: float) -> None:
    """Each fault's cost (``cost_s``, >= 0): the wall time of its aftermath minus the new steps
    committed in it at the fault-free pace ``step_s``. The aftermath starts at the last commit before
    the fault (the step it interrupted is lost work) or where the previous fault's ended, whichever is
    later, and ends at ``until`` (the caller cuts it at the next fault and the window's end): so no
    two overlap and all lie in the window. Split at the first commit after the fault into ``down_s``
    (recovery) and ``slow_s`` (slower steps until the replacement was ready). Pops ``t``, ``until``."""
    prev = start
    for f in faults:
        t, until = f.pop("t"), f.pop("until")
        begin = max(prev, max((c for c in commits if c <= t), default=start))
        first = min(t + (f["recovery_s"] or 0.0), until)
        f["down_s"] = (first - begin) - sum(begin < c <= first for c in commits) * step_s
        f["slow_s"] = (until - first) - sum(first < c <= until for c in commits) * step_s
        f["cost_s"] = max(0.0, f["down_s"] + f["slow_s"])
        prev = until


def _s(x: dict | None, scale: float = 1.0, unit: str = "s") -> str:
    return "-" if not x else f"{x['median'] * scale:.2f} {unit} [{x['min'] * scale:.2f}-{x['max'] * scale:.2f}]"


def format_table(r: dict) -> str:
    lost = r["lost_to_faults_s"]
    cpu = spread(f["spare_cpu_s"] for f in r["per_fault"])
    promoted_starting = sum(f["promoted_ready"] is False for f in r["per_fault"])
    rows = [
        ("job", f"{r['config']['nproc']} workers + {r['config']['spares']} spare (replenished), "
                f"model {r['config']['model_size']}, gloo{', one rank per core' if r['config']['pin'] else ''}"),
        ("faults", f"SIGKILL of a random rank every {r['fault_every_s']:g} s for {r['duration_s']:g} s: {r['faults']}"),
        ("completed", "yes" if r["completed"] else "NO"),
        ("fault-free step", f"{_s(r['fault_free_step_s'], 1000, 'ms')} (same invocation, same window)"),
        ("goodput", f"{r['goodput'] * 100:.1f} % (v{r['definition_version']}: 1 - time the faults cost / window; "
                    f"{r['steps_committed']} steps committed, {r['steps_fault_free']} by the fault-free run)"),
        ("time lost", f"{r['lost_s']:.1f} s: {lost['down_s']:.1f} s down (fault -> next commit), "
                      f"{lost['slow_s']:.1f} s slower steps until the replacement spare was ready"),
        ("recoveries", f"{r['recoveries']}/{r['faults']}, fault -> next commit {_s(r['recovery_s'])}"),
        ("replacement spares", f"ready {_s(r['ready_s'])} after the fault, {_s(cpu, unit='CPU s')} each; "
                               f"{promoted_starting} promoted before ready"),
        ("lost steps", str(r["lost_steps"])),
        ("spares", f"{r['promotions']} promoted, {r['spares_added']} started to replace them, "
                   f"{r['restarts']} process restarts"),
        ("losses bit-identical", f"{'yes' if r['bitwise_equal'] else 'NO'} (every rank, {r['bitwise_equal_steps']} "
                                 f"steps, {r['steps_after_last_fault']} after the last fault; "
                                 f"{r['unmatched_steps']} without a fault-free reference)"),
        ("logs", r["log_dir"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

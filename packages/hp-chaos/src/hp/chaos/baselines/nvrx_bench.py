"""The NVRx variant of ``hp bench recovery``: NVIDIA's in-process restart with a promoted spare.

``nproc + 1`` plain processes run :mod:`hp.chaos.baselines.nvrx_train` under
``nvidia_resiliency_ext.inprocess.Wrapper`` (``nproc`` active, one idle spare). Rank ``fault_rank``
SIGKILLs itself at the start of step F+1 (F = ``fault_step``); NVRx's monitors notice, abort (destroy
the gloo group), meet at their restart barrier, shift the ranks so the spare takes the last active
rank, and call the training function again in every surviving process. The training function forms
a new process group, broadcasts rank 0's state to every active rank (the spare has none) and replays
step F+1.

``monitor``: ``"default"`` keeps NVRx's default intervals (:data:`DEFAULT_SETTINGS`, from
``inprocess.Wrapper``'s signature in 0.4.1), ``"tuned"`` sets every polling interval and
``last_call_wait`` to :data:`TUNED_INTERVAL_S`. Timeouts stay NVRx's defaults in both (its soft
timeout, 60 s, is hp's hang timeout); the gloo timeout is :data:`GLOO_TIMEOUT_S` in both.

Figures of one faulted run (``run_nvrx``), with t0 = the fault's wall time:

- ``step_time_s``: median interval between rank 0's commits before the fault;
- ``to_next_step_s``: t0 -> every active rank committed step F+1 (or later) after t0;
- ``downtime_s``: ``to_next_step_s - step_time_s``;
- ``recovery_s``: t0 -> every active rank back in the loop with restored state (before the replay);
- ``phases``: from cumulative marks: ``detect`` (first rank that noticed: NVRx's monitor thread begins
  the abort, or a gloo call failed), ``abort`` (every live rank's group destroyed and its main thread
  out of the wrapped function), ``restart_barrier`` (every active rank called again: NVRx's
  iteration barrier and rank assignment), ``pg_init``, ``hydrate`` (the broadcast), ``replay``.
"""

import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from itertools import pairwise
from typing import Any

from hp.chaos.baselines import nvrx_train
from hp.chaos.bench.recovery_common import phases
from hp.checkpointless.demo.workload import workload_argv
from hp.checkpointless.events import read_events
from hp.core.protocol import Event
from hp.core.procs import free_port, kill_tagged, tagged_pids

# inprocess.Wrapper's defaults in nvidia-resiliency-ext 0.4.1, seconds
DEFAULT_SETTINGS = {
    "monitor_thread_interval": 1.0, "monitor_process_interval": 1.0, "heartbeat_interval": 1.0,
    "progress_watchdog_interval": 1.0, "last_call_wait": 1.0,
    "soft_timeout": 60.0, "hard_timeout": 90.0, "heartbeat_timeout": 30.0, "barrier_timeout": 120.0,
    "completion_timeout": 120.0, "termination_grace_time": 5.0,
}
TUNED_INTERVAL_S = 0.1
INTERVALS = ("monitor_thread_interval", "monitor_process_interval", "heartbeat_interval",
             "progress_watchdog_interval", "last_call_wait")
GLOO_TIMEOUT_S = 2.0
MONITORS = ("default", "tuned")


def available() -> str | None:
    """None when NVRx can run here, else why not (the bench reports the variant as skipped)."""
    if importlib.util.find_spec("nvidia_resiliency_ext") is None:
        return "nvidia-resiliency-ext not installed (pip install 'hp-chaos[nvrx]')"
    try:
        from nvidia_resiliency_ext import inprocess  # noqa: F401
    except Exception as e:  # noqa: BLE001  a wheel broken against this torch is as good as none
        return f"nvidia-resiliency-ext does not import: {type(e).__name__}: {e}"
    return None


def settings(monitor: str) -> dict[str, Any]:
    """Every NVRx and gloo setting of a run (seconds)."""
    if monitor not in MONITORS:
        raise ValueError(f"monitor must be one of {MONITORS}, not {monitor!r}")
    wrapper = dict(DEFAULT_SETTINGS)
    if monitor == "tuned":
        wrapper.update({k: TUNED_INTERVAL_S for k in INTERVALS})
    return {"monitor": monitor, "wrapper": wrapper, "gloo_timeout_s": GLOO_TIMEOUT_S,
            "abort": "destroy_process_group (gloo)", "health_check": None,
            "rank_assignment": "Compose(MaxActiveWorldSize(nproc), ShiftRanks())",
            "launcher": "plain processes, one per rank (NVRx's examples: not torchrun)"}


def _stop(procs: list[subprocess.Popen], token: str) -> None:
    """SIGTERM each rank's process group, SIGKILL what is left after 10 s, then every process of the
    job still alive (NVRx's monitor daemons among them, see :func:`job_tag`), by pid."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    deadline = time.monotonic() + 10  # SIGKILLed processes linger while the kernel tears them down
    while tagged_pids(job_tag(token)) and time.monotonic() < deadline:
        kill_tagged(job_tag(token))
        time.sleep(0.05)


def job_tag(token: str) -> str:
    """The environment entry every process of one job carries: the ranks, and NVRx's monitor daemons,
    which double-fork and setsid out of the ranks' process groups (found by it, killed by pid)."""
    return f"{nvrx_train.JOB_ENV}={token}"


def run_job(cfg: Any, log_dir: str, monitor: str, fault_step: int,
            token: str | None = None) -> tuple[list[int], float, list[dict], str]:
    """One NVRx job: ``nproc + 1`` rank processes. Returns each rank's exit code (124: still running at
    the timeout), the wall time, the events and the tail of every rank's output."""
    os.makedirs(log_dir, exist_ok=True)
    world = cfg.nproc + 1
    token = token or uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world), nvrx_train.JOB_ENV: token}
    cmd = [sys.executable, "-m", nvrx_train.MODULE, "--steps", str(cfg.steps), "--fault-step", str(fault_step),
           "--fault-rank", str(cfg.fault_rank), "--active", str(cfg.nproc), "--log-dir", log_dir,
           "--nvrx-port", str(free_port()), "--nvrx", json.dumps(settings(monitor)["wrapper"]),
           "--gloo-timeout", str(GLOO_TIMEOUT_S), *workload_argv(cfg, "model_size", "corpus_mb", "seed"),
           *cfg.train_args()]
    procs: list[subprocess.Popen] = []
    logs = [open(os.path.join(log_dir, f"rank{r}.log"), "w+") for r in range(world)]
    start = time.monotonic()
    codes: list[int] = []
    try:
        for r in range(world):
            procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=logs[r],
                                          stderr=subprocess.STDOUT, start_new_session=True))
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(0.1, cfg.timeout_s - (time.monotonic() - start))))
            except subprocess.TimeoutExpired:
                codes.append(124)
        wall = time.monotonic() - start
    finally:
        _stop(procs, token)
    tails = []
    for r, log in enumerate(logs):
        log.seek(0)
        tails.append(f"--- rank {r} (exit {codes[r] if r < len(codes) else '?'})\n{log.read()[-1500:]}")
        log.close()
    return codes, wall, read_events(os.path.join(log_dir, "events")), "\n".join(tails)


def analyse(events: list[dict], cfg: Any) -> dict[str, Any]:
    """The figures of the module docstring from one faulted job's events."""
    fault = next((e for e in events if e["event"] == Event.FAULT_INJECTED), None)
    if fault is None:
        return {"error": "no fault was injected"}
    t0, f, active = fault["t"], cfg.fault_step, range(cfg.nproc)
    commits = [e for e in events if e["event"] == Event.COMMIT]
    before = sorted(e["t"] for e in commits if e["rank"] == 0 and e["t"] < t0)
    step_time = statistics.median(b - a for a, b in pairwise(before)) if len(before) > 1 else None
    firsts = [min((e["t"] for e in commits if e["rank"] == r and e["t"] > t0 and e["step"] >= f + 1), default=None)
              for r in active]
    to_next = None if None in firsts else max(firsts) - t0
    after = [e for e in events if e["t"] > t0 and e.get("iteration", 0) >= 1]  # the restarted iteration

    def last(event: str, ranks: Any = active) -> float | None:
        hits = {e["rank"]: e["t"] - t0 for e in after if e["event"] == event and e.get("rank") in ranks}
        return max(hits.values()) if len(hits) == len(ranks) else None

    detected = [e["t"] - t0 for e in events if e["event"] == Event.FAILURE_DETECTED and e["t"] > t0]
    torn_down = [e["t"] - t0 for e in events if e["event"] in (Event.RELEASED, Event.STEP_FAILED) and e["t"] > t0]
    marks = {"detect": min(detected) if detected else None, "abort": max(torn_down) if torn_down else None,
             "restart_barrier": last(Event.ASSIGNED), "pg_init": last(Event.PG_READY),
             "hydrate": last(Event.HYDRATED), "replay": to_next}
    recovery = last(Event.RESTORED)
    rank0 = {}
    for e in commits:  # oldest first: a step's first commit by rank 0
        if e["rank"] == 0:
            rank0.setdefault(e["step"], e["loss"])
    by_rank = {r: {e["step"]: e["loss"] for e in commits if e["rank"] == r and e["t"] > t0} for r in active}
    ranks_agree = all(by_rank[r].get(s) == rank0.get(s) for r in active for s in by_rank[r])
    finals = {e["rank"]: e["digests"] for e in events if e["event"] == Event.FINAL_STATE}
    promoted = next((e["initial_rank"] for e in after if e["event"] == Event.ASSIGNED
                     and e["initial_rank"] >= cfg.nproc and e.get("mode") == "active"), None)
    hydrated = [e for e in after if e["event"] == Event.HYDRATED]
    return {
        "step_time_s": step_time, "to_next_step_s": to_next,
        "downtime_s": None if to_next is None or step_time is None else to_next - step_time,
        "recovery_s": recovery, "phases": phases(marks),
        "losses": dict(sorted(rank0.items())),  # rank 0's global mean loss per step, exact float hex
        "commits_per_step": {s: sum(1 for e in commits if e["rank"] == 0 and e["step"] == s) for s in sorted(rank0)},
        "ranks_agree_after_fault": ranks_agree,  # every active rank committed the same mean loss per step
        "final_state_equal": len(finals) == cfg.nproc and len({json.dumps(d, sort_keys=True)
                                                               for d in finals.values()}) == 1,
        "promoted_initial_rank": promoted, "restarts": max((e.get("iteration", 0) for e in events), default=0),
        "hydrate_bytes": max((e.get("bytes", 0) for e in hydrated), default=None),
        "restored_step": next((e["step"] for e in after if e["event"] == Event.RESTORED), None),
    }


def run_nvrx(cfg: Any, root: str, log: Any = print, monitor: str = "default") -> dict[str, Any]:
    """One faulted NVRx run (``monitor``: "default" or "tuned"); ``{"skipped": why}`` where NVRx cannot run."""
    why = available()
    if why is not None:
        return {"skipped": why}
    conf = settings(monitor)
    log(f"NVRx ({monitor} monitor intervals): {cfg.nproc} active ranks + 1 spare, rank {cfg.fault_rank} "
        f"killed after step {cfg.fault_step}")
    codes, wall, events, tail = run_job(cfg, root, monitor, cfg.fault_step)
    out: dict[str, Any] = {"settings": conf, "wall_s": wall, "exit_codes": codes}
    out.update(analyse(events, cfg))
    killed_ok = len(codes) == cfg.nproc + 1 and codes[cfg.fault_rank] == -signal.SIGKILL
    others_ok = all(c == 0 for r, c in enumerate(codes) if r != cfg.fault_rank)
    steps_ok = sorted(out.get("losses", {})) == list(range(cfg.steps))
    out["completed"] = killed_ok and others_ok and steps_ok and out.get("to_next_step_s") is not None \
        and "error" not in out
    if not out["completed"]:
        out["error_tail"] = tail[-4000:]
    return out

"""The torchft variant of ``hp bench recovery``: a Lighthouse, one ``torchrun`` per replica group.

Why a module of its own: torchft recovers differently from both other variants (survivors never
stop; the dead group is restarted and healed from a peer while they go on at a smaller world), so
it has its own job (:mod:`hp.chaos.baselines.torchft_ddp`), its own launcher and its own analysis.

Two jobs run: a fault-free reference (its median step time and its losses) and the faulted job.
Measured on replica group 0, a survivor, against the SIGKILL of group ``fault_rank`` right after
it committed step F:

- ``to_next_step_s``: fault -> step F+1 committed by group 0;
- ``downtime_s``: ``to_next_step_s`` minus group 0's median step time before the fault (the time
  lost: one step of new work would have been spent anyway); ``reference_step_time_s`` is the
  reference job's, for comparison;
- ``rejoin_s``: fault -> the restarted group has received the state from a peer (back in the
  quorum, healed; also its ``recovery_s``); ``phases`` splits it; ``all_ranks_back_s``: fault -> the
  restarted group committed step F+1 or later; ``rejoin_stall_s``: the longest step of group 0
  after F+1 beyond the median, the pause the survivors take to let the new group in;
- ``bitwise_equal`` against the reference over the first ``steps`` steps of group 0 (loss and the
  updated weights' sum): false by design (survivors train at world 3 on fewer batches until the
  rejoin); ``first_divergent_step`` says where (F+1: its update averaged 3 groups),
  ``dropped_batches`` how many batches nobody trained on.
"""

from __future__ import annotations

import importlib.util
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from hp.chaos.baselines import torchft_ddp
from hp.checkpointless.demo.workload import workload_argv
from hp.checkpointless.events import read_events
from hp.core.procs import free_port
from hp.core.protocol import Event

if TYPE_CHECKING:
    from hp.chaos.bench.recovery_common import BenchConfig

JOIN_TIMEOUT_MS = 10000  # torchft's examples: how long a quorum waits for a heartbeating straggler
QUORUM_TICK_MS = 100


def available() -> str | None:
    """None when torchft can run here, else why not (the bench reports the variant as skipped)."""
    if importlib.util.find_spec("torchft") is None:
        return "torchft not installed (pip install 'hp-chaos[torchft]')"
    try:
        from torchft.coordination import LighthouseServer  # noqa: F401
    except Exception as e:  # noqa: BLE001  a wheel broken against this torch is as good as none
        return f"torchft does not import: {type(e).__name__}: {e}"
    return None



def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every launcher's process group (torchrun forwards it), then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


class Lighthouse:
    """torchft's Lighthouse in a child process: its Rust log goes to a file, not the bench's stderr,
    and it dies with the bench (it exits when its stdin, our pipe, closes)."""

    def __init__(self, log_path: str, min_replicas: int, heartbeat_timeout_ms: int) -> None:
        code = ("import sys; from torchft.coordination import LighthouseServer; "
                f"s = LighthouseServer(bind='127.0.0.1:0', min_replicas={min_replicas}, "
                f"join_timeout_ms={JOIN_TIMEOUT_MS}, quorum_tick_ms={QUORUM_TICK_MS}, "
                f"heartbeat_timeout_ms={heartbeat_timeout_ms}); "
                "print(s.address(), flush=True); sys.stdin.read(); s.shutdown()")
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, start_new_session=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)  # it imports torch first: seconds
        self.address = self.proc.stdout.readline().strip() if ready else ""  # "" when it died
        if not self.address:
            self.close()
            raise RuntimeError(f"the torchft Lighthouse did not start; see {log_path}")

    def close(self) -> None:
        _stop([self.proc])
        self._log.close()


def run_job(cfg: BenchConfig, log_dir: str, fault_step: int) -> tuple[list[int], float, list[dict], str]:
    """One torchft job: the Lighthouse (in this process) and one torchrun per replica group.

    Returns each launcher's exit code (124: killed at the timeout), the wall time, the events and
    the tail of the failed launchers' output."""
    os.makedirs(log_dir, exist_ok=True)
    lighthouse = Lighthouse(os.path.join(log_dir, "lighthouse.log"), cfg.nproc - 1, cfg.torchft_heartbeat_timeout_ms)
    # OMP_NUM_THREADS=1 as torchrun sets it for the other variants' 4 ranks on one host: here the
    # 4 ranks are 4 torchruns of 1 process each, which would each take every core
    env = {"OMP_NUM_THREADS": "1", **os.environ, "TORCHFT_LIGHTHOUSE": lighthouse.address}
    args = ["-m", torchft_ddp.MODULE, "--replicas", str(cfg.nproc), "--min-replicas", str(cfg.nproc - 1),
            "--steps", str(cfg.steps), "--fault-step", str(fault_step), "--fault-replica", str(cfg.fault_rank),
            "--log-dir", log_dir, *workload_argv(cfg, "model_size", "corpus_mb", "seed"), *cfg.train_args()]
    procs: list[subprocess.Popen] = []
    logs = [open(os.path.join(log_dir, f"replica{r}.log"), "w+") for r in range(cfg.nproc)]
    start = time.monotonic()
    try:
        for r in range(cfg.nproc):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--max-restarts", "1",
                   "--monitor-interval", "0.1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                   *args]
            procs.append(subprocess.Popen(cmd, env={**env, "REPLICA_GROUP_ID": str(r)}, stdout=logs[r],
                                          stderr=subprocess.STDOUT, start_new_session=True))
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(0.1, cfg.timeout_s - (time.monotonic() - start))))
            except subprocess.TimeoutExpired:
                codes.append(124)
        wall = time.monotonic() - start
    finally:
        _stop(procs)
        lighthouse.close()
    tails = []
    for r, (code, log) in enumerate(zip(codes, logs)):
        log.seek(0)
        if code != 0:
            tails.append(f"--- replica group {r} (exit {code})\n{log.read()[-1500:]}")
        log.close()
    return codes, wall, read_events(os.path.join(log_dir, "events")), "\n".join(tails)


def _commits(events: list[dict], replica: int) -> dict[int, dict]:
    return {e["step"]: e for e in events if e["event"] == Event.COMMIT and e["rank"] == replica}


def median_step_time(commits: list[dict]) -> float | None:
    """Median interval between consecutive commits (as :func:`hp.chaos.bench.recovery_common.median_step`)."""
    times = sorted(e["t"] for e in commits)
    return statistics.median(b - a for a, b in pairwise(times)) if len(times) > 1 else None


def analyse(reference: list[dict], faulted: list[dict], cfg: BenchConfig) -> dict[str, Any]:
    """The figures of the module docstring, from the two jobs' event logs."""
    fault = next((e for e in faulted if e["event"] == Event.FAULT_INJECTED), None)
    if fault is None:
        return {"error": "no fault was injected"}
    t0, f = fault["t"], cfg.fault_step
    ref, got = _commits(reference, 0), _commits(faulted, 0)
    ref_step_time = median_step_time(list(ref.values()))
    step_time = median_step_time([e for s, e in got.items() if s <= f]) or ref_step_time
    if step_time is None:
        return {"error": "fewer than 2 steps committed before the fault and in the reference"}
    if f + 1 not in got:
        return {"error": f"group 0 never committed step {f + 1} after the fault"}
    back = got[f + 1]["t"] - t0
    again = [e for e in faulted if e.get("attempt", 0) >= 1 and e["rank"] == cfg.fault_rank]

    def first(event: str) -> float | None:
        return next((e["t"] - t0 for e in again if e["event"] == event), None)

    marks = {"detect_restart": first(Event.STARTED), "process_start_import": first(Event.IMPORTED),
             "data_attach": first(Event.DATA_ATTACHED), "model_build": first(Event.MODEL_READY),
             "manager_up": first(Event.PG_READY), "quorum_heal": first(Event.RESTORED)}
    phases, reached = {}, 0.0
    for name, mark in marks.items():
        if mark is not None:
            phases[name], reached = max(0.0, mark - reached), max(reached, mark)
    after = sorted(s for s in got if s > f + 1)
    stalls = [got[b]["t"] - got[a]["t"] - step_time for a, b in pairwise([f + 1, *after])]
    steps = range(cfg.steps)
    diverged = [s for s in steps if s not in got or s not in ref or got[s]["loss"] != ref[s]["loss"]
                or got[s].get("weights") != ref[s].get("weights")]
    restored = next((e["step"] for e in again if e["event"] == Event.RESTORED), None)
    rejoined = min((e["t"] for e in again if e["event"] == Event.COMMIT and e["step"] >= f + 1), default=None)
    return {
        "downtime_s": back - step_time, "to_next_step_s": back, "step_time_s": step_time,
        "reference_step_time_s": ref_step_time,
        "rejoin_s": marks["quorum_heal"], "recovery_s": marks["quorum_heal"], "phases": phases, "restored_step": restored,
        "all_ranks_back_s": None if rejoined is None else max(back, rejoined - t0),
        "rejoin_stall_s": max(0.0, *stalls) if stalls else None,
        "world_at_step_after_fault": got[f + 1].get("participants"),
        "failed_steps": sum(1 for e in faulted if e["event"] == Event.STEP_FAILED and e["rank"] == 0),
        "dropped_batches": sum(cfg.nproc - got[s]["participants"] for s in steps if s in got),
        "steps_run": max(got) + 1,
        "bitwise_equal": not diverged, "first_divergent_step": diverged[0] if diverged else None,
        "equal_before_fault": all(s > f for s in diverged),
    }


def _how(cfg: BenchConfig) -> dict[str, Any]:
    return {
        "how": (f"{cfg.nproc} replica groups of 1 process, one torchrun --max-restarts 1 each, Lighthouse "
                f"min_replicas {cfg.nproc - 1}: the survivors' next quorum waits until the Lighthouse stops "
                f"counting the dead group (heartbeat timeout {cfg.torchft_heartbeat_timeout_ms} ms), then they go "
                f"on at world {cfg.nproc - 1} while the killed group restarts and heals from a live peer, then "
                f"all go on at world {cfg.nproc}"),
        "lighthouse": {"heartbeat_timeout_ms": cfg.torchft_heartbeat_timeout_ms, "join_timeout_ms": JOIN_TIMEOUT_MS,
                       "quorum_tick_ms": QUORUM_TICK_MS, "min_replicas": cfg.nproc - 1},
    }


def reference(cfg: BenchConfig, root: str, log: Any = print) -> tuple[int, list[dict], str]:
    """The fault-free job every faulted run is compared with: (worst exit code, events, output tail)."""
    log("torchft: fault-free reference")
    codes, _wall, events, tail = run_job(cfg, os.path.join(root, "torchft-reference"), -1)
    return max(codes), events, tail


def faulted(cfg: BenchConfig, root: str, ref: tuple[int, list[dict], str], i: int, log: Any = print) -> dict[str, Any]:
    """One faulted job (the ``i``-th) against the reference: the figures of the module docstring."""
    rc_ref, ref_events, tail_ref = ref
    log(f"torchft: faulted job {i + 1} (Lighthouse + one torchrun per replica group)")
    codes, wall, events, tail = run_job(cfg, os.path.join(root, f"torchft-faulted-{i}"), cfg.fault_step)
    out: dict[str, Any] = {**_how(cfg), "completed": rc_ref == 0 and not any(codes), "wall_s": wall}
    out.update(analyse(ref_events, events, cfg))
    if not out["completed"] or "error" in out:
        out.update(completed=False, error_tail=(tail or tail_ref)[-3000:])
    return out

"""``hp bench recovery``: the same SIGKILL recovered by hp, torchrun + DCP, torchft and NVIDIA's
in-process restart, each fault measured the same way, one rank per core.

Why: "checkpointless" is a claim about downtime, and a claim needs the traditional paths measured on
the same job, on the same box, in the same run. Variants:

- ``hp``: ``hp run`` with one hot spare, through :mod:`hp.checkpointless.demo.run` (a fault-free
  reference and the faulted jobs): survivors stay in process, the spare takes the dead rank and
  hydrates from a peer, the interrupted step is replayed. Every rank's losses and final state are
  compared bit for bit with the reference.
- ``hp_fsdp`` (only when named in ``--variants``): the same with the model sharded by FSDP2 over the
  ranks (``--fsdp``): the spare gets the dead rank's shard from its buddy's shadow, its own reference.
- ``torchrun_dcp``: ``torchrun --max-restarts 1`` over plain DDP + DCP checkpoints
  (:mod:`hp.chaos.baselines.torchrun_dcp`): every rank restarts, re-imports torch, reloads the newest
  checkpoint and recomputes the steps since it.
- ``torchft`` (``hp-chaos[torchft]``): one replica group per rank under a Lighthouse; survivors go on
  at a smaller world while the killed group restarts and heals from a live peer.
- ``nvrx_default`` / ``nvrx_tuned`` (``hp-chaos[nvrx]``, :mod:`hp.chaos.baselines.nvrx_bench`):
  nvidia-resiliency-ext's in-process restart with an idle rank promoted, hydrated by broadcast, at
  NVRx's default and at short monitor intervals.

Definition (version :data:`DEFINITION_VERSION`): rank ``fault_rank`` dies right after committing
step F (hp: at the start of step F+1's forward), early enough that at least
:data:`MIN_STEPS_AFTER` steps follow. **to_next_step_s** = fault -> every rank has committed step F+1
(the step it was working on; recomputed steps count). **downtime_s** = that minus the variant's
median fault-free step time (taken from the faulted job's steps before the fault: on a shared
machine a reference job minutes earlier can run 50 % slower or faster): the time lost, since step
F+1 itself is new work. **recovery_s** = fault -> every rank back in the loop with restored state
(without the replayed work), split into phases. torchft's survivors never stop: its
``to_next_step_s`` is theirs, and ``all_ranks_back_s`` says when the restarted group committed again.

Fairness: every rank has a core of its own (``--nproc 2`` on 2 cores by default, each rank pinned
with :func:`hp.core.devices.pin_to_core`, one intra-op thread): ranks that share cores finish a
step faster while another idles (a rank streaming state to a replacement, say), which no one with an
accelerator per rank would see. Each variant is faulted ``repeats`` times (>= 3), the variants
interleaved so that drift in the machine's load hits all; figures are medians with min and max.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

from hp.chaos.baselines import torchft_bench, torchrun_dcp
from hp.chaos.bench.meta import BenchRun, spread
from hp.chaos.bench.recovery_common import (HP_VARIANTS, BenchConfig,
                                            every_rank_back, lost_time, median_step, phases)
from hp.checkpointless.demo.run import (
    DemoConfig,
    RunResult,
    compare,
    compare_state,
    job_command,
    recovery_timeline,
    sharded_parts,
)
from hp.checkpointless.demo.workload import workload_argv
from hp.checkpointless.events import read_events
from hp.core.devices import PIN_ENV
from hp.core.procs import free_port
from hp.core.protocol import Event

DEFINITION_VERSION = 2
def _log(msg: str) -> None:
    print(f"hp bench recovery: {msg}", file=sys.stderr, flush=True)



def _run(cmd: list[str], env: dict[str, str], timeout_s: float, log_path: str) -> tuple[int, float, str]:
    """Run a launcher in its own session; on timeout SIGTERM (launchers forward it), then SIGKILL."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    start = time.monotonic()
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = 124
        log.seek(0)
        return rc, time.monotonic() - start, log.read()


# ---------------------------------------------------------------- hp: in-process, one hot spare
def _demo(cfg: BenchConfig, variant: str = "hp") -> DemoConfig:
    return DemoConfig(fault="kill", phase="forward", steps=cfg.steps, fault_step=cfg.fault_step + 1,
                      fault_rank=cfg.fault_rank, nproc=cfg.nproc, spares=1, model_size=cfg.model_size,
                      hang_timeout_s=cfg.hang_timeout_s, corpus_mb=cfg.corpus_mb, seed=cfg.seed,
                      train_args=cfg.train_args() + HP_VARIANTS[variant])


def _hp_job(cfg: BenchConfig, log_dir: str, faults: list[dict], variant: str = "hp") -> RunResult:
    """The demo's job under this bench's runner (a timeout that kills the whole process group)."""
    env = {**os.environ, "HP_FAULTS": json.dumps(faults)}
    rc, wall, out = _run(job_command(_demo(cfg, variant), log_dir), env, cfg.timeout_s,
                         os.path.join(log_dir, "output.log"))
    return RunResult(rc, wall, read_events(os.path.join(log_dir, "events")), out)


def hp_reference(cfg: BenchConfig, root: str, variant: str = "hp") -> RunResult:
    _log(f"{variant}: fault-free reference")
    return _hp_job(cfg, os.path.join(root, f"{variant}-reference"), [], variant)


def analyse_hp(reference: RunResult, faulted: RunResult, cfg: BenchConfig, variant: str = "hp") -> dict[str, Any]:
    """One faulted hp run against the reference: the figures of the module docstring, and every rank's
    losses (each step from whichever ranks committed it) and final state bit for bit."""
    t0 = next((e["t"] for e in faulted.events if e["event"] == Event.FAULT_INJECTED), None)
    if t0 is None:
        return {"error": "no fault was injected"}
    before = median_step([e["t"] for e in faulted.events if e["event"] == Event.COMMIT and e.get("rank") == 0
                          and e["t"] < t0])
    to_next = every_rank_back(faulted.events, t0, cfg.fault_step + 1, range(cfg.nproc))
    phases = recovery_timeline(faulted.events)[0]["phases"]
    state = compare_state(reference, faulted, cfg.nproc, sharded_parts(HP_VARIANTS[variant]))
    losses = compare(reference, faulted)
    return {"step_time_s": before, "to_next_step_s": to_next, "downtime_s": lost_time(to_next, before),
            "recovery_s": sum(v for k, v in phases.items() if k != "replay") if "hydrate" in phases else None,
            "phases": phases, **losses, "losses_equal": losses["bitwise_equal"],
            "bitwise_equal": losses["bitwise_equal"] and state["state_equal"],
            "state_differences": state["state_differences"]}


def run_hp(cfg: BenchConfig, root: str, reference: RunResult, i: int, variant: str = "hp") -> dict[str, Any]:
    fault = {"at_step": cfg.fault_step + 1, "phase": "forward", "kind": "kill", "rank": cfg.fault_rank}
    _log(f"{variant}: faulted job {i + 1}/{cfg.repeats} (1 hot spare)")
    faulted = _hp_job(cfg, os.path.join(root, f"{variant}-faulted-{i}"), [fault], variant)
    out: dict[str, Any] = {"completed": reference.returncode == 0 and faulted.returncode == 0,
                           "wall_s": faulted.wall_s}
    if out["completed"]:
        out.update(analyse_hp(reference, faulted, cfg, variant))
    if not out["completed"] or "error" in out or out.get("to_next_step_s") is None:
        out.update(completed=False, error_tail=(faulted.output if faulted.returncode else reference.output)[-2000:])
    return out


# ---------------------------------------------------------------- torchrun + DCP: restart everything
def analyse_torchrun(events: list[dict], fault_step: int, nproc: int) -> dict[str, Any]:
    """Downtime, where it went, and the recomputed steps, from the baseline's per-rank event logs."""
    fault = next((e for e in events if e["event"] == Event.FAULT_INJECTED), None)
    if fault is None:
        return {"error": "no fault was injected"}
    t0 = fault["t"]
    after = [e for e in events if e.get("attempt") == 1]

    def commits(attempt: int) -> dict[int, dict]:
        return {e["step"]: e for e in events
                if e["event"] == Event.COMMIT and e["rank"] == 0 and e.get("attempt") == attempt}

    def last(event: str) -> float | None:
        hits = [e["t"] for e in after if e["event"] == event]
        return max(hits) - t0 if hits else None

    before, again = commits(0), commits(1)
    back = every_rank_back(events, t0, fault_step + 1, range(nproc), attempt=1)
    if back is None:
        return {"error": f"step {fault_step + 1} was never committed by every rank after the restart"}
    recomputed_until = every_rank_back(events, t0, fault_step, range(nproc), attempt=1)
    starts = [e["at"] for e in after if e["event"] == Event.STARTED]
    marks = {
        "detect_teardown": min(starts) - t0 if starts else None,  # the first new process exists
        "process_start_import": last(Event.IMPORTED),
        "data_attach": last(Event.DATA_ATTACHED),
        "pg_init": last(Event.PG_READY),
        "model_build": last(Event.MODEL_READY),
        "dcp_load": last(Event.RESTORED),
        # nothing to recompute (checkpointed at the fault step): a zero-length phase, not a missing one
        "recompute": recomputed_until if fault_step in again else last(Event.RESTORED),
        "interrupted_step": back,
    }
    recomputed = sorted(s for s in again if s in before)
    step_time = median_step([e["t"] for e in before.values()])
    saves = [e["duration_s"] for e in events if e["event"] == Event.CHECKPOINT_SAVED and e["rank"] == 0]
    restored = next((e["step"] for e in after if e["event"] == Event.RESTORED and e["rank"] == 0), None)
    return {
        "downtime_s": lost_time(back, step_time), "to_next_step_s": back,
        "recovery_s": marks["dcp_load"], "phases": phases(marks),
        "recomputed_steps": len(recomputed), "restored_step": restored,
        "recompute_bitwise_equal": all(again[s]["loss"] == before[s]["loss"] for s in recomputed),
        "step_time_s": step_time,  # attempt 0 before the fault: fault-free steps of this variant
        "ckpt_save_s": statistics.median(saves) if saves else None,
    }


def run_torchrun(cfg: BenchConfig, root: str, i: int) -> dict[str, Any]:
    log_dir = os.path.join(root, f"torchrun-dcp-{i}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cfg.nproc),
           "--max-restarts", "1", "--monitor-interval", "0.1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", torchrun_dcp.MODULE, "--steps", str(cfg.steps), "--fault-step", str(cfg.fault_step),
           "--fault-rank", str(cfg.fault_rank), "--ckpt-every", str(cfg.ckpt_every), "--log-dir", log_dir,
           *workload_argv(cfg, "model_size", "corpus_mb", "seed"), *cfg.train_args()]
    _log(f"torchrun + DCP: faulted job {i + 1}/{cfg.repeats}")
    rc, wall, out = _run(cmd, dict(os.environ), cfg.timeout_s, os.path.join(log_dir, "output.log"))
    result = {"completed": rc == 0, "wall_s": wall,
              **analyse_torchrun(read_events(os.path.join(log_dir, "events")), cfg.fault_step, cfg.nproc)}
    if rc != 0 or "error" in result:
        result.update(completed=False, error_tail=out[-2000:])
    return result


# ---------------------------------------------------------------- the bench
def _params(cfg: BenchConfig) -> int:
    from hp.checkpointless.demo.model import build_model

    return sum(p.numel() for p in build_model(cfg.model_size, cfg.vocab_size, cfg.seq).parameters())


def _warm_cache(cfg: BenchConfig) -> None:
    """Build the token cache before any job: no variant should pay preprocessing in its timings."""
    from hp.checkpointless.data import TokenCache, synthetic_corpus, tokenize

    key = torchrun_dcp.corpus_key(cfg.corpus_mb, cfg.vocab_size, cfg.seed)
    TokenCache.open(key, lambda: tokenize(synthetic_corpus(cfg.corpus_mb << 20, cfg.seed), cfg.vocab_size)).close()


def _nvrx_skipped() -> str | None:
    try:
        from hp.chaos.baselines import nvrx_bench
    except ImportError as e:
        return f"the NVRx variant does not import: {e}"
    return nvrx_bench.available()


_FIGURES = ("downtime_s", "to_next_step_s", "recovery_s", "step_time_s", "all_ranks_back_s", "rejoin_s")


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's faulted runs: each figure's spread (median, min, max, n), each phase's, and the
    verdicts that must hold in every run."""
    out: dict[str, Any] = {"completed": bool(runs) and all(r.get("completed") for r in runs), "runs": runs}
    for key in _FIGURES:
        if any(key in r for r in runs):
            out[key] = spread(r.get(key) for r in runs)
    names = list(dict.fromkeys(k for r in runs for k in r.get("phases", {})))
    if names:
        out["phases"] = {k: spread(r["phases"].get(k) for r in runs if "phases" in r) for k in names}
    for key in ("bitwise_equal", "losses_equal", "recompute_bitwise_equal", "equal_before_fault"):
        if any(key in r for r in runs):
            out[key] = all(r.get(key) is True for r in runs)
    for key in ("lost_steps", "recomputed_steps", "dropped_batches"):
        if any(key in r for r in runs):
            out[key] = max(r.get(key) or 0 for r in runs)
    return out


def _ratio(other: dict[str, Any], hp: dict[str, Any], key: str = "downtime_s") -> float | None:
    a, b = (other.get(key) or {}).get("median"), (hp.get(key) or {}).get("median")
    return a / b if a and b and a > 0 and b > 0 else None


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    run = BenchRun("recovery", DEFINITION_VERSION)
    root = cfg.log_dir or tempfile.mkdtemp(prefix="hp_bench_recovery_")
    os.makedirs(root, exist_ok=True)
    if cfg.pin:
        os.environ[PIN_ENV] = "1"  # every variant's ranks inherit it
    _warm_cache(cfg)
    skipped: dict[str, str] = {}
    if "torchft" in cfg.variants and (why := torchft_bench.available()) is not None:
        skipped["torchft"] = why
    if any(v.startswith("nvrx") for v in cfg.variants) and (why := _nvrx_skipped()) is not None:
        skipped.update({v: why for v in cfg.variants if v.startswith("nvrx")})
    active = [v for v in cfg.variants if v not in skipped]
    references = {v: hp_reference(cfg, root, v) for v in HP_VARIANTS if v in active}
    ft_reference = torchft_bench.reference(cfg, root, _log) if "torchft" in active else None
    runs: dict[str, list[dict]] = {v: [] for v in active}
    for i in range(cfg.repeats):  # interleaved: drift in the machine's load hits every variant alike
        for v in active:
            if v in HP_VARIANTS:
                runs[v].append(run_hp(cfg, root, references[v], i, v))
            elif v == "torchrun_dcp":
                runs[v].append(run_torchrun(cfg, root, i))
            elif v == "torchft":
                runs[v].append(torchft_bench.faulted(cfg, root, ft_reference, i, _log))
            else:
                from hp.chaos.baselines import nvrx_bench

                monitor = v.removeprefix("nvrx_")
                _log(f"NVRx in-process restart ({monitor} monitor intervals): faulted job {i + 1}/{cfg.repeats}")
                runs[v].append(nvrx_bench.run_nvrx(cfg, os.path.join(root, f"{v}-{i}"), _log, monitor))
    for v, vruns in runs.items():  # say which run broke and why (the JSON line is long; its end shows neither)
        for i, r in enumerate(vruns):
            if not r.get("completed"):
                tail = (r.get("error") or r.get("error_tail") or "no error recorded").strip().splitlines()[-5:]
                _log(f"{v}: faulted job {i + 1}/{cfg.repeats} did not complete: " + " | ".join(tail))
    variants: dict[str, Any] = {v: aggregate(r) for v, r in runs.items()}
    variants.update({v: {"skipped": why} for v, why in skipped.items()})
    hp = variants.get("hp", {})
    cores = len(os.sched_getaffinity(0))
    return run.stamp({
        "definition": "downtime_s = fault -> every rank committed step F+1 (to_next_step_s), minus the variant's "
                      "median step time before the fault in the same job; recovery_s = fault -> every rank back "
                      "in the loop with restored state; medians with min-max over `repeats` faults per variant",
        "model_size": cfg.model_size, "params": _params(cfg), "vocab": cfg.vocab_size, "seq": cfg.seq,
        "world_size": cfg.nproc, "steps": cfg.steps, "repeats": cfg.repeats,
        "fault": {"kind": "kill", "rank": cfg.fault_rank, "after_step": cfg.fault_step,
                  "steps_after": cfg.steps - cfg.fault_step - 1},
        "pinned": cfg.pin, "one_rank_per_core": cfg.pin and cfg.nproc <= cores,
        "variants": variants,
        "ratios": {f"{v}_over_hp": _ratio(variants[v], hp) for v in variants
                   if v not in HP_VARIANTS and "skipped" not in variants[v]},
        # a skipped optional variant is not a failure (an extra not installed); a variant that broke is
        "completed": all(v.get("completed", "skipped" in v) for v in variants.values()),
        "config": asdict(cfg), "log_dir": root,
    })

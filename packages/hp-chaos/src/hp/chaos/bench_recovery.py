"""``hp bench recovery``: one job, one SIGKILL of rank 1, recovered by hp, torchrun + DCP and torchft.

Why: "checkpointless" is a claim about downtime, and a claim needs the traditional path measured on
the same job, on the same box, in the same run. Variants:

- ``hp``: ``hp run`` with one hot spare, through :mod:`hp.checkpointless.demo.run` (a fault-free
  reference and the faulted job): survivors stay in process, the spare takes the dead rank and
  hydrates from a peer, the interrupted step is replayed. Losses are compared bit for bit.
- ``torchrun_dcp``: ``torchrun --max-restarts 1`` over plain DDP + DCP checkpoints
  (:mod:`hp.chaos.baselines.torchrun_dcp`): every rank restarts, re-imports torch, reloads the newest
  checkpoint and recomputes the steps since it.
- ``torchft``: where it is installed (``hp-chaos[torchft]``), :mod:`hp.chaos.baselines.torchft_bench`:
  4 replica groups of 1 process under a Lighthouse; survivors go on at world 3 while the killed
  group is restarted by its torchrun and heals from a live peer.

The fault is the same instant in all: rank 1 dies right after committing step F (in hp: at the
start of step F+1, phase ``forward``). **to_next_step_s** = fault → step F+1 committed by rank 0
(replica group 0, a survivor, for torchft), recomputed steps included. **downtime_s** =
``to_next_step_s`` minus the variant's median fault-free step time, taken from the faulted job's
steps before the fault (:func:`median_step` says why not from the reference job): the time lost to
the fault, since step F+1 itself is new work that had to be done anyway. **recovery_s** = fault →
every rank back in the step loop with restored state (without the replayed work). torchft's
survivors never stop, so its ``downtime_s`` is what the survivors lose; when the restarted group is
back is ``rejoin_s``, and its run is not bit-identical to a fault-free one (fewer groups, fewer
batches for a while), which the result says.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any

from hp.chaos.baselines import torchft_bench, torchrun_dcp
from hp.checkpointless.demo.run import (
    DemoConfig,
    RunResult,
    compare,
    job_command,
    recovery_timeline,
    step_time,
)
from hp.checkpointless.events import read_events
from hp.core.protocol import Event


@dataclass
class BenchConfig:
    model_size: str = "25m"
    vocab: int | None = None  # None: 8192 for 25m (INFRA's ~25 M-param model), else 256 (bytes)
    seq: int = 64
    nproc: int = 4
    steps: int = 14
    fault_step: int = 12  # rank 1 dies right after committing this step
    ckpt_every: int = 10
    fault_rank: int = 1
    corpus_mb: int = 16
    seed: int = 0
    log_dir: str | None = None
    timeout_s: float = 900.0  # per job: a hang guard, not a measurement
    torchft_heartbeat_timeout_ms: int = torchft_bench.HEARTBEAT_TIMEOUT_MS  # torchft's default

    @property
    def vocab_size(self) -> int:
        return self.vocab if self.vocab is not None else (8192 if self.model_size == "25m" else 256)

    def train_args(self) -> list[str]:
        """Arguments both training scripts take: the same model shape and the same token cache."""
        return ["--vocab", str(self.vocab_size), "--seq", str(self.seq)]


def _log(msg: str) -> None:
    print(f"hp bench recovery: {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def lost_time(to_next_step_s: float, step_time_s: float | None) -> float | None:
    """Downtime as the issue defines it: fault -> back at the step reached, minus the one step of new
    work that had to be done anyway (the variant's own median fault-free step time)."""
    return None if step_time_s is None else to_next_step_s - step_time_s


def median_step(commit_times: list[float]) -> float | None:
    """Median interval between consecutive commits (None with fewer than two).

    Every variant takes it from its *faulted* job's steps before the fault: fault-free steps run
    under the same load as the fault. A reference job ran minutes earlier, and on a shared 2-core
    box its steps can be 50 % slower or faster, which would swamp a sub-second downtime."""
    times = sorted(commit_times)
    return statistics.median(b - a for a, b in pairwise(times)) if len(times) > 1 else None


def _phases(marks: dict[str, float | None]) -> dict[str, float]:
    """Seconds spent in each phase, from cumulative marks (seconds after the fault), as hp's demo does."""
    phases, reached = {}, 0.0
    for name, mark in marks.items():
        if mark is not None:
            phases[name] = max(0.0, mark - reached)
            reached = max(reached, mark)
    return phases


# ---------------------------------------------------------------- hp: in-process, one hot spare
def _hp_job(demo: DemoConfig, cfg: BenchConfig, log_dir: str, faults: list[dict]) -> RunResult:
    """The demo's job under this bench's runner (a timeout that kills the whole process group)."""
    env = {**os.environ, "HP_FAULTS": json.dumps(faults)}
    rc, wall, out = _run(job_command(demo, log_dir), env, cfg.timeout_s,
                         os.path.join(log_dir, "output.log"))
    return RunResult(rc, wall, read_events(os.path.join(log_dir, "events")), out)


def run_hp(cfg: BenchConfig, root: str) -> dict[str, Any]:
    demo = DemoConfig(fault="kill", phase="forward", steps=cfg.steps, fault_step=cfg.fault_step + 1,
                      fault_rank=cfg.fault_rank, nproc=cfg.nproc, spares=1, model_size=cfg.model_size,
                      hang_timeout_s=60.0, corpus_mb=cfg.corpus_mb, seed=cfg.seed, train_args=cfg.train_args())
    fault = {"at_step": cfg.fault_step + 1, "phase": "forward", "kind": "kill", "rank": cfg.fault_rank}
    _log("hp: fault-free reference")
    reference = _hp_job(demo, cfg, os.path.join(root, "hp-reference"), [])
    _log("hp: faulted job (1 hot spare)")
    faulted = _hp_job(demo, cfg, os.path.join(root, "hp-faulted"), [fault])
    out: dict[str, Any] = {"completed": reference.returncode == 0 and faulted.returncode == 0,
                           "reference_step_time_s": step_time(reference),
                           "wall_s": {"reference": reference.wall_s, "faulted": faulted.wall_s}}
    if not out["completed"]:
        return {**out, "error_tail": (faulted.output if faulted.returncode else reference.output)[-2000:]}
    t0 = next(e["t"] for e in faulted.events if e["event"] == Event.FAULT_INJECTED)
    back = next(e["t"] for e in faulted.events if e["event"] == Event.COMMIT and e.get("rank") == 0
                and e["t"] > t0 and e["step"] >= cfg.fault_step + 1)
    before = median_step([e["t"] for e in faulted.events if e["event"] == Event.COMMIT and e.get("rank") == 0
                          and e["t"] < t0])
    out["step_time_s"] = before or out["reference_step_time_s"]
    phases = recovery_timeline(faulted.events)[0]["phases"]
    recovered = [v for k, v in phases.items() if k != "replay"]
    return {**out, "downtime_s": lost_time(back - t0, out["step_time_s"]), "to_next_step_s": back - t0,
            "recovery_s": sum(recovered) if "hydrate" in phases else None,
            "phases": phases, **compare(reference, faulted)}


# ---------------------------------------------------------------- torchrun + DCP: restart everything
def analyse_torchrun(events: list[dict], fault_step: int) -> dict[str, Any]:
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
    if fault_step + 1 not in again:
        return {"error": f"step {fault_step + 1} was never committed after the restart"}
    starts = [e["at"] for e in after if e["event"] == Event.STARTED]
    marks = {
        "detect_teardown": min(starts) - t0 if starts else None,  # the first new process exists
        "process_start_import": last(Event.IMPORTED),
        "data_attach": last(Event.DATA_ATTACHED),
        "pg_init": last(Event.PG_READY),
        "model_build": last(Event.MODEL_READY),
        "dcp_load": last(Event.RESTORED),
        # nothing to recompute (checkpointed at the fault step): a zero-length phase, not a missing one
        "recompute": again[fault_step]["t"] - t0 if fault_step in again else last(Event.RESTORED),
        "interrupted_step": again[fault_step + 1]["t"] - t0,
    }
    recomputed = sorted(s for s in again if s in before)
    step_time = median_step([e["t"] for e in before.values()])
    saves = [e["duration_s"] for e in events if e["event"] == Event.CHECKPOINT_SAVED and e["rank"] == 0]
    restored = next((e["step"] for e in after if e["event"] == Event.RESTORED and e["rank"] == 0), None)
    return {
        "downtime_s": lost_time(marks["interrupted_step"], step_time), "to_next_step_s": marks["interrupted_step"],
        "recovery_s": marks["dcp_load"], "breakdown": _phases(marks),
        "recomputed_steps": len(recomputed), "restored_step": restored,
        "recompute_bitwise_equal": all(again[s]["loss"] == before[s]["loss"] for s in recomputed),
        "step_time_s": step_time,  # attempt 0 before the fault: fault-free steps of this variant
        "ckpt_save_s": statistics.median(saves) if saves else None,
    }


def run_torchrun(cfg: BenchConfig, root: str) -> dict[str, Any]:
    log_dir = os.path.join(root, "torchrun-dcp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cfg.nproc),
           "--max-restarts", "1", "--monitor-interval", "0.1",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", torchrun_dcp.MODULE, "--steps", str(cfg.steps), "--fault-step", str(cfg.fault_step),
           "--fault-rank", str(cfg.fault_rank), "--ckpt-every", str(cfg.ckpt_every), "--log-dir", log_dir,
           "--model-size", cfg.model_size, "--corpus-mb", str(cfg.corpus_mb), "--seed", str(cfg.seed),
           *cfg.train_args()]
    _log("torchrun + DCP: faulted job")
    rc, wall, out = _run(cmd, dict(os.environ), cfg.timeout_s, os.path.join(log_dir, "output.log"))
    result = {"completed": rc == 0, "ckpt_every": cfg.ckpt_every, "wall_s": wall,
              **analyse_torchrun(read_events(os.path.join(log_dir, "events")), cfg.fault_step)}
    if rc != 0 or "error" in result:
        result.update(completed=False, error_tail=out[-2000:])
    return result


# ---------------------------------------------------------------- the bench
def _params(cfg: BenchConfig) -> int:
    from hp.checkpointless.demo.model import build_model

    return sum(p.numel() for p in build_model(cfg.model_size, cfg.vocab_size, cfg.seq).parameters())


def _warm_cache(cfg: BenchConfig) -> None:
    """Build the token cache before any job: neither variant should pay preprocessing in its timings."""
    from hp.checkpointless.data import TokenCache, synthetic_corpus, tokenize

    key = torchrun_dcp.corpus_key(cfg.corpus_mb, cfg.vocab_size, cfg.seed)
    TokenCache.open(key, lambda: tokenize(synthetic_corpus(cfg.corpus_mb << 20, cfg.seed), cfg.vocab_size)).close()


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    root = cfg.log_dir or tempfile.mkdtemp(prefix="hp_bench_recovery_")
    os.makedirs(root, exist_ok=True)
    start = time.monotonic()
    _warm_cache(cfg)
    hp, base = run_hp(cfg, root), run_torchrun(cfg, root)
    ft = torchft_bench.run_torchft(cfg, root, _log)

    def ratio(other: dict[str, Any], key: str) -> float | None:
        a, b = other.get(key), hp.get(key)
        return a / b if a and b and a > 0 and b > 0 else None

    return {
        "model_size": cfg.model_size, "params": _params(cfg), "vocab": cfg.vocab_size, "seq": cfg.seq,
        "world_size": cfg.nproc, "steps": cfg.steps,
        "fault": {"kind": "kill", "rank": cfg.fault_rank, "after_step": cfg.fault_step},
        "step_time_s": {"hp": hp.get("step_time_s"), "torchrun_dcp": base.get("step_time_s"),
                        "torchft": ft.get("step_time_s")},
        "downtime_definition": "fault -> step F+1 committed by rank 0, minus the variant's median step time "
                               "before the fault in the faulted job (to_next_step_s: before the subtraction)",
        "hp": hp, "torchrun_dcp": base, "torchft": ft,
        "ratio_downtime_baseline_over_hp": ratio(base, "downtime_s"),
        "ratio_recovery_baseline_over_hp": ratio(base, "recovery_s"),
        "ratio_downtime_torchft_over_hp": ratio(ft, "downtime_s"),
        # a skipped torchft is not a failure (it is an optional extra); a torchft run that broke is
        "completed": bool(hp["completed"] and base["completed"] and ft.get("completed", "skipped" in ft)),
        "config": asdict(cfg), "log_dir": root, "wall_s": time.monotonic() - start,
    }


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def format_table(r: dict[str, Any]) -> str:
    hp, base, ft, f = r["hp"], r["torchrun_dcp"], r["torchft"], r["fault"]
    head = (f"recovery bench: model {r['model_size']} ({r['params'] / 1e6:.1f} M params, vocab {r['vocab']}), "
            f"{r['world_size']} ranks, {r['steps']} steps, SIGKILL of rank {f['rank']} after step {f['after_step']}")
    skipped = "skipped" in ft

    def done(v: dict[str, Any]) -> str:
        return "skipped" if "skipped" in v else "yes" if v.get("completed") else "NO"

    def same(v: dict[str, Any], key: str, note: str) -> str:
        return "-" if key not in v else f"{v[key]} ({note})"

    rows = [
        ("", "hp (1 hot spare)", f"torchrun + DCP (ckpt every {base['ckpt_every']})", "torchft (heal from a peer)"),
        ("completed", done(hp), done(base), done(ft)),
        ("step time (median before fault)", _s(hp.get("step_time_s")), _s(base.get("step_time_s")),
         _s(ft.get("step_time_s"))),
        (f"fault -> step {f['after_step'] + 1} done", _s(hp.get("to_next_step_s")), _s(base.get("to_next_step_s")),
         _s(ft.get("to_next_step_s"))),
        ("downtime (that - step time)", _s(hp.get("downtime_s")), _s(base.get("downtime_s")), _s(ft.get("downtime_s"))),
        ("recovery overhead / rejoin", _s(hp.get("recovery_s")), _s(base.get("recovery_s")), _s(ft.get("rejoin_s"))),
        ("lost / recomputed / dropped", f"{hp.get('lost_steps', '-')} steps", f"{base.get('recomputed_steps', '-')} steps",
         f"{ft.get('dropped_batches', '-')} batches"),
        ("losses bit-identical", same(hp, "bitwise_equal", "vs reference"),
         same(base, "recompute_bitwise_equal", "recomputed vs first run"), same(ft, "bitwise_equal", "vs reference")),
    ]
    if skipped:
        rows = [row[:3] for row in rows]
    cols = len(rows[0])
    width = [max(len(row[i]) for row in rows) for i in range(cols)]
    lines = [head, *("  ".join(c.ljust(w) for c, w in zip(row, width)).rstrip() for row in rows)]
    for name, phases in (("hp phases", hp.get("phases", {})), ("torchrun phases", base.get("breakdown", {})),
                         ("torchft rejoin phases", ft.get("rejoin_phases", {}))):
        if phases:
            lines.append(f"{name}: " + ", ".join(f"{k} {v:.3f} s" for k, v in phases.items()))
    if skipped:
        lines.append(f"torchft: skipped: {ft['skipped']}")
    elif ft.get("how"):
        lines.append(f"torchft: {ft['how']}; first divergent step {ft.get('first_divergent_step')}, survivors' "
                     f"largest stall after the fault step {_s(ft.get('rejoin_stall_s'))}")
    lines += [f"downtime ratio torchrun+DCP / hp: {_ratio(r['ratio_downtime_baseline_over_hp'])}, "
              f"torchft / hp: {_ratio(r['ratio_downtime_torchft_over_hp'])}",
              f"logs: {r['log_dir']}"]
    for name, v in (("hp", hp), ("torchrun_dcp", base), ("torchft", ft)):
        if v.get("error_tail"):
            lines.append(f"\nlast output of the failed {name} job:\n{v['error_tail']}")
    return "\n".join(lines)

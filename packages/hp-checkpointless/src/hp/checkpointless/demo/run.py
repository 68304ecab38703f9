"""`hp demo`: the fault-free reference and the same job with one fault, compared bit for bit.

Both runs are real `hp run` jobs (agent, controller, by default 4 workers + 1 hot spare on CPU gloo; with
``--transport nccl`` one GPU per rank). What the
report says comes from the jobs' own event logs (:mod:`hp.checkpointless.events`): losses as exact
float bits, and the timeline of the recovery.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from hp.checkpointless.events import read_events

@dataclass
class DemoConfig:
    fault: str = "kill"  # kill | hang | exception
    phase: str = "allreduce"
    steps: int = 40
    fault_step: int | None = None  # default: the middle of the run
    fault_rank: int = 1
    nproc: int = 4
    spares: int = 1
    transport: str = "gloo"  # nccl: the model, batches and gradients on cuda:LOCAL_RANK
    model_size: str = "tiny"
    hang_timeout_s: float = 2.0
    corpus_mb: int = 16
    seed: int = 0
    max_restarts: int = 0
    train_args: list[str] = field(default_factory=list)  # extra flags for demo/train.py (e.g. --vocab)
    log_dir: str | None = None
    extra_faults: list[dict] = field(default_factory=list)

    @property
    def at_step(self) -> int:
        return self.fault_step if self.fault_step is not None else self.steps // 2


@dataclass
class RunResult:
    returncode: int
    wall_s: float
    events: list[dict]
    output: str

    def losses(self) -> dict[int, list[str]]:
        """Step -> the global mean loss (exact float hex) of each generation that committed it, from
        whichever ranks committed it (a rank that hydrated past a step did not skip it); a step in two
        generations was committed twice: lost work."""
        out: dict[int, dict[int, str]] = {}
        for e in self.events:
            if e["event"] == "commit":
                out.setdefault(e["step"], {}).setdefault(e["generation"], e["loss"])
        return {step: [by_generation[g] for g in sorted(by_generation)] for step, by_generation in out.items()}

    def local_losses(self) -> dict[int, dict[str, set[str]]]:
        """Step -> vote slot (a rank, or a micro-batch in a split step) -> the local losses committed for
        it, by every rank and generation (more than one value: not the same bits)."""
        out: dict[int, dict[str, set[str]]] = {}
        for e in self.events:
            if e["event"] == "commit":
                for slot, loss in e.get("local", {}).items():
                    out.setdefault(e["step"], {}).setdefault(slot, set()).add(loss)
        return out


def job_command(cfg: DemoConfig, log_dir: str, agent_flags: Sequence[str] = ()) -> list[str]:
    """The ``hp run`` command of the demo job; ``agent_flags`` are more ``hp run`` options (e.g. the
    multi-node ones of the chaos harness)."""
    return [
        sys.executable, "-m", "hp.core.cli", "run", *agent_flags,
        "--nproc-per-node", str(cfg.nproc), "--spares", str(cfg.spares), "--transport", cfg.transport,
        "--monitor-interval", "0.02", "--hang-timeout", str(cfg.hang_timeout_s),
        "--max-restarts", str(cfg.max_restarts),
        "--log-dir", log_dir, "--tee", "0",
        "-m", "hp.checkpointless.demo.train",
        "--steps", str(cfg.steps), "--model-size", cfg.model_size,
        "--corpus-mb", str(cfg.corpus_mb), "--seed", str(cfg.seed),
        *cfg.train_args,
    ]


def run_job(cfg: DemoConfig, log_dir: str, faults: list[dict], extra_env: dict | None = None) -> RunResult:
    env = {**os.environ, "HP_FAULTS": json.dumps(faults), **(extra_env or {})}
    start = time.monotonic()
    proc = subprocess.run(job_command(cfg, log_dir), env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    return RunResult(proc.returncode, wall, read_events(os.path.join(log_dir, "events")), proc.stdout + proc.stderr)


def recovery_timeline(events: list[dict]) -> list[dict]:
    """One entry per injected fault: seconds from the fault to the end of each recovery phase.

    The failed generation is the one the survivors detected the failure in; the recovered one is
    the generation of the first commit after the fault (a second failure while re-forming moves it on).
    """
    faults = [e for e in events if e["event"] == "fault_injected"]
    out = []
    for i, fault in enumerate(faults):
        t0 = fault["t"]
        until = faults[i + 1]["t"] if i + 1 < len(faults) else float("inf")
        window = [e for e in events if t0 <= e["t"] < until]
        detected = [e for e in window if e["event"] == "failure_detected"]
        failed = detected[0]["generation"] if detected else None
        commits = [e for e in window if e["event"] == "commit" and e.get("rank") == 0 and e["generation"] != failed]
        recovered = commits[0]["generation"] if commits else None

        def last(event: str, generation: int | None) -> float | None:
            hits = [e["t"] - t0 for e in window if e["event"] == event and e.get("generation") == generation]
            return max(hits) if hits else None

        marks = {
            "detect": detected[0]["t"] - t0 if detected else None,
            "abort": last("released", failed),
            "spare_attach": last("assigned", recovered),
            "pg_init": last("pg_ready", recovered),
            "hydrate": last("resumed", recovered),
            "replay": commits[0]["t"] - t0 if commits else None,
        }
        phases, reached = {}, 0.0
        for name, mark in marks.items():
            if mark is not None:
                phases[name] = max(0.0, mark - reached)
                reached = max(reached, mark)
        out.append({"kind": fault["kind"], "phase": fault["phase"], "step": fault["step"], "rank": fault["rank"],
                    "recovery_s": marks["replay"], "phases": phases})
    return out


def differing_steps(reference: RunResult, faulted: RunResult) -> list[int]:
    """Steps whose losses are not the reference's bits, or that only one of the runs committed. Checked
    per step: the global mean, and every vote slot's own loss (a rank's, or a micro-batch's in a split
    step) that a rank committing the step recorded. A rank that hydrated past a step (it failed after
    the vote) recorded none for it: the global mean, which summed its loss, stands in for it."""
    ref, got = reference.losses(), faulted.losses()
    ref_local, got_local = reference.local_losses(), faulted.local_losses()

    def slots_differ(s: int) -> bool:
        mine, theirs = got_local.get(s, {}), ref_local.get(s, {})
        return any(slot not in theirs or values != theirs[slot] for slot, values in mine.items())

    return sorted(s for s in set(ref) | set(got) if s not in ref or s not in got or set(got[s]) != {ref[s][0]}
                  or slots_differ(s))


def compare(reference: RunResult, faulted: RunResult) -> dict:
    """Every step's losses against the reference (:func:`differing_steps`). ``lost_steps``: steps
    committed again in a later generation (the work of their first commit was lost)."""
    lost = sum(len(v) - 1 for v in faulted.losses().values())
    return {"bitwise_equal": not differing_steps(reference, faulted), "lost_steps": lost,
            "steps_compared": len(reference.losses())}


STATE_PARTS = ("params", "buffers", "optimizer", "scheduler", "scaler")


def final_states(result: RunResult) -> dict[str, dict]:
    """Rank (a string, as in JSON) -> the digests of its state at the end of the job: the runtime's
    ``final_state`` event (sha256 of the exact bytes of every tensor, per part of the state). A rank
    held by several processes (a spare took it over) is the last one's."""
    return {str(e["rank"]): e["digests"] for e in result.events if e["event"] == "final_state"}


def compare_state(reference: RunResult, faulted: RunResult, nproc: int | None = None,
                  sharded: frozenset[str] | set[str] = frozenset()) -> dict:
    """Final state of every rank of ``faulted`` against the same rank of ``reference`` and against
    every other rank of ``faulted``. The ``sharded`` parts (the optimizer with ZeRO; the parameters and
    the optimizer with FSDP2/HSDP) are a different shard on each rank: compared with the same rank of
    the reference only.

    Returns ``state_equal`` (False when either run recorded no final state, or not for the same
    ranks, or not for ``nproc`` ranks), the ``state_parts`` compared, and the ``state_differences``
    found (rank, part, against what)."""
    ref, got = final_states(reference), final_states(faulted)
    diffs: list[str] = []
    if not got or not ref:
        diffs.append(f"no final state recorded by the {'faulted' if not got else 'reference'} run")
    elif set(ref) != set(got):
        diffs.append(f"final states of ranks {sorted(got, key=int)}, the reference's of {sorted(ref, key=int)}")
    elif nproc is not None and set(got) != {str(r) for r in range(nproc)}:
        diffs.append(f"final states of ranks {sorted(got, key=int)}, expected {nproc} ranks")
    ranks = sorted(got, key=int)
    parts = [k for k in STATE_PARTS if any(d.get(k) is not None for d in [*got.values(), *ref.values()])]
    parts += sorted({k for d in [*got.values(), *ref.values()] for k in d} - set(STATE_PARTS))
    if not diffs:
        first = ranks[0]
        for r in ranks:
            diffs += [f"rank {r} {k}: not the reference's" for k in parts if got[r].get(k) != ref[r].get(k)]
            diffs += [f"rank {r} {k}: not rank {first}'s" for k in parts if got[r].get(k) != got[first].get(k)
                      and k not in sharded]
    return {"state_equal": not diffs, "state_parts": parts, "state_differences": diffs}


def sharded_parts(train_args: Sequence[str]) -> frozenset[str]:
    """The parts of the state each rank holds a shard of, for the demo job's flags."""
    if "--fsdp" in train_args or "--hsdp" in train_args:
        return frozenset({"params", "optimizer"})
    return frozenset({"optimizer"}) if "--zero" in train_args else frozenset()


def step_time(result: RunResult) -> float:
    times = [e["t"] for e in result.events if e["event"] == "commit" and e.get("rank") == 0]
    deltas = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(deltas) if deltas else float("nan")


def cache_timing(cfg: DemoConfig) -> dict:
    from hp.checkpointless.data import measure_cold_warm

    return measure_cold_warm(f"hp-demo-{cfg.corpus_mb}mb-v256-s{cfg.seed}", cfg.corpus_mb << 20, None, cfg.seed)


def run_demo(cfg: DemoConfig) -> dict:
    root = cfg.log_dir or tempfile.mkdtemp(prefix="hp_demo_")
    data = cache_timing(cfg)  # also leaves the cache warm for both jobs
    fault = {"at_step": cfg.at_step, "phase": cfg.phase, "kind": cfg.fault, "rank": cfg.fault_rank}
    reference = run_job(cfg, os.path.join(root, "reference"), [])
    faulted = run_job(cfg, os.path.join(root, "faulted"), [fault, *cfg.extra_faults])
    timeline = recovery_timeline(faulted.events)
    first = timeline[0] if timeline else {"recovery_s": None, "phases": {}}
    verdict = compare(reference, faulted)
    result = {
        **verdict,
        "losses_equal": verdict["bitwise_equal"],
        "recovery_s": first["recovery_s"],
        "phases": first["phases"],
        "faults": timeline,
        "steps": cfg.steps,
        "world_size": cfg.nproc,
        "spares": cfg.spares,
        "transport": cfg.transport,
        "fault": fault,
        "model_size": cfg.model_size,
        "step_time_s": step_time(reference),
        # how each hydration of replicated state went: premapped | shm (same node) | transport
        "hydrations": [e["how"] for e in faulted.events if e["event"] == "hydration_sent"],
        "reference": {"returncode": reference.returncode, "wall_s": reference.wall_s},
        "faulted": {"returncode": faulted.returncode, "wall_s": faulted.wall_s},
        "data_cache": data,
        "log_dir": root,
    }
    parts = sharded_parts(cfg.train_args)
    state = compare_state(reference, faulted, cfg.nproc, parts)
    result.update(state)
    result["bitwise_equal"] = verdict["bitwise_equal"] and state["state_equal"]  # every rank: losses and state
    result["final_state"] = {"reference": final_states(reference), "faulted": final_states(faulted)}
    result["sharded_optimizer"] = "optimizer" in parts
    result["sharded_params"] = "params" in parts
    result["completed"] = reference.returncode == 0 and faulted.returncode == 0
    if not result["completed"]:
        result["error_tail"] = (faulted.output if faulted.returncode else reference.output)[-2000:]
    return result


def format_table(r: dict) -> str:
    f = r["fault"]
    rows = [
        ("job", (f"{r['world_size']} workers + {r['spares']} spare, {r['steps']} steps, model {r['model_size']}, "
                 f"{r.get('transport', 'gloo')}")),
        ("fault", f"{f['kind']} of rank {f['rank']} at step {f['at_step']} ({f['phase']})"),
        ("completed", "yes" if r["completed"] else "NO"),
        ("step time (reference)", f"{r['step_time_s'] * 1000:.0f} ms"),
        ("recovery (fault -> next commit)", "-" if r["recovery_s"] is None else f"{r['recovery_s']:.3f} s"),
    ]
    how = ", ".join(r.get("hydrations", []))  # of replicated state: premapped | shm | transport
    rows += [(f"  {name}", f"{secs * 1000:.0f} ms" + (f" ({how})" if name == "hydrate" and how else ""))
             for name, secs in r["phases"].items()]
    rows += [
        ("lost steps", str(r["lost_steps"])),
        ("losses bit-identical", f"{'yes' if r['losses_equal'] else 'NO'} ({r['steps_compared']} steps, every "
                                 f"rank's own loss and the global mean)"),
        ("final state bit-identical", _state_row(r)),
        ("data cache", f"cold preprocess {r['data_cache']['cold_preprocess_s']:.2f} s, "
                       f"warm attach {r['data_cache']['warm_attach_s'] * 1000:.2f} ms"),
        ("wall time", f"reference {r['reference']['wall_s']:.1f} s, faulted {r['faulted']['wall_s']:.1f} s"),
        ("logs", r["log_dir"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _state_row(r: dict) -> str:
    if "state_equal" not in r:  # a result of an older version
        return "-"
    ranks = len(r.get("final_state", {}).get("faulted", {}))
    sharded = {k for k, flag in (("optimizer", "sharded_optimizer"), ("params", "sharded_params")) if r.get(flag)}
    parts = [f"{k} (per rank)" if k in sharded else k for k in r["state_parts"]]
    if r["state_equal"]:
        return f"yes ({ranks} ranks: {', '.join(parts)})"
    shown = r["state_differences"][:3]
    more = len(r["state_differences"]) - len(shown)
    return "NO (" + "; ".join(shown) + (f"; {more} more" if more > 0 else "") + ")"

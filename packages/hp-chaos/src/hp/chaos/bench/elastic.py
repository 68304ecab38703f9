"""``hp bench elastic``: what a scale event costs hp, against torchrun ``--nnodes MIN:MAX`` + DCP in the same run.

Both sides run the same job (the demo GPT, a constant global batch of ``global_batch`` samples in
micro-batches of ``micro_batch``) on two agents of ONE rank each, so that no rank shares a core on this
2-core box (DESIGN.md, "Measuring on 2 cores"), through the scale events each system can do:

* hp (:mod:`hp.elastic.demo.run`): a rank killed with no spare → the job shrinks in process (2 → 1); its
  replacement process joins when ready (1 → 2); SIGTERM to node 1's agent → its rank leaves at a step
  boundary (2 → 1); a new agent joins the running job (1 → 2).
* torchrun + DCP (:mod:`hp.chaos.baselines.elastic_torchrun`): a killed worker → every worker restarts
  from the last DCP checkpoint (torchrun cannot shrink in process); SIGTERM to an agent → the survivors
  re-rendezvous at 1 (saving first: nothing lost); a new agent → re-rendezvous at 2, every worker restarts.

``pause_s`` of an event = first commit at the new size − last commit before the event − the median step
time at the new size. The figures are medians over the events (and per kind), each side's baseline in the
same run. Time until new capacity is used (a new node's agent → its first commit) and SIGTERM → exit of the
preempted agent are reported too.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass

from hp.chaos.bench.meta import BenchRun

DEFINITION_VERSION = 1  # pause = first commit at the new size - last before the event - a step at the new size


@dataclass
class ElasticBenchConfig:
    steps: int = 200
    global_batch: int = 24
    micro_batch: int = 4
    kill_step: int = 12
    model_size: str = "tiny"
    corpus_mb: int = 16
    seed: int = 0
    log_dir: str | None = None


def _by_kind(events: list[dict], kind_key: str = "kind") -> dict[str, float]:
    kinds: dict[str, list[float]] = {}
    for e in events:
        kinds.setdefault(e[kind_key], []).append(e["pause_s"])
    return {k: round(statistics.median(v), 4) for k, v in kinds.items()}


def run_bench(cfg: ElasticBenchConfig) -> dict:
    bench = BenchRun("elastic", DEFINITION_VERSION)
    from hp.chaos.baselines.elastic_torchrun import ElasticBaselineConfig, run_baseline
    from hp.elastic.demo.run import ElasticDemoConfig, run_elastic_demo

    root = cfg.log_dir or tempfile.mkdtemp(prefix="hp_bench_elastic_")
    os.makedirs(root, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    hp = run_elastic_demo(ElasticDemoConfig(
        steps=cfg.steps, kill_step=cfg.kill_step, nproc_per_node=1, global_batch=cfg.global_batch,
        micro_batch=cfg.micro_batch, model_size=cfg.model_size, corpus_mb=cfg.corpus_mb, seed=cfg.seed,
        reference=False, log_dir=os.path.join(root, "hp")))
    base = run_baseline(ElasticBaselineConfig(
        # rank 0: the only rank at every world size of the plan (torchrun restarts every worker on any kill)
        nodes=2, nproc_per_node=1, events=f"kill@{cfg.kill_step},preempt@+10,grow@+10", kill_rank=0, steps=cfg.steps,
        global_batch=cfg.global_batch, micro_batch=cfg.micro_batch, model_size=cfg.model_size,
        corpus_mb=cfg.corpus_mb, seed=cfg.seed, log_dir=os.path.join(root, "torchrun")))
    hp_pauses = hp["pause_s"]
    base_pauses = [e["pause_s"] for e in base.get("events", [])]
    hp_median = round(statistics.median(hp_pauses), 4) if hp_pauses else None
    base_median = round(statistics.median(base_pauses), 4) if base_pauses else None
    return bench.stamp({
        "completed": bool(hp["completed"] and base.get("completed")),
        "config": asdict(cfg),
        "pause_s": hp_median, "baseline_pause_s": base_median,
        "ratio": round(base_median / hp_median, 2) if hp_median and base_median else None,
        "pause_s_spread": [min(hp_pauses), max(hp_pauses)] if hp_pauses else None,
        "baseline_pause_s_spread": [min(base_pauses), max(base_pauses)] if base_pauses else None,
        "hp": {"world_sizes": hp["world_sizes"], "pause_s": hp_pauses, "by_kind": _by_kind(hp["events"]),
               "events": hp["events"], "lost_steps": hp["lost_steps"], "capacity_used_s": hp["capacity_used_s"],
               "preempt_exit_s": hp["preempt_exit_s"], "grace_period_s": 30.0, "step_s": hp["step_s"],
               "log_dir": hp["log_dir"]},
        "baseline": {"pause_s": base_pauses, "by_kind": _by_kind(base.get("events", [])),
                     "events": base.get("events", []), "lost_steps": sum(e.get("lost_steps", 0) for e in base.get("events", [])),
                     "step_time_s": base.get("step_time_s"), "error": base.get("error")},
        "log_dir": root,
    })


def format_table(result: dict) -> str:
    hp, base = result["hp"], result["baseline"]
    lines = ["hp bench elastic: pause per scale event (s, beyond one step), one rank per core",
             f"{'':24} {'hp':>8} {'torchrun+DCP':>13}"]
    nan = float("nan")
    for label, hp_kind, base_kind in (("kill (hp: shrink)", "shrink", "kill"), ("preempt", "preempt", "preempt"),
                                      ("grow", "grow", "grow")):
        lines.append(f"{label:24} {hp['by_kind'].get(hp_kind, nan):>8.3f} {base['by_kind'].get(base_kind, nan):>13.3f}")
    lines.append(f"{'median of all events':24} {result['pause_s'] or float('nan'):>8.3f} "
                 f"{result['baseline_pause_s'] or float('nan'):>13.3f}   ratio {result['ratio']}")
    lines.append(f"hp: world sizes {hp['world_sizes']}, lost steps {hp['lost_steps']}, new node used after "
                 f"{hp['capacity_used_s']} s, preempted agent exited {hp['preempt_exit_s']} s after SIGTERM "
                 f"(grace {hp['grace_period_s']:g} s); torchrun+DCP lost steps {base['lost_steps']}")
    return "\n".join(lines)


def write_result(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)

"""``hp bench elastic --scheduler slurm``: how long Slurm's scale events cost an hp job, against torchrun + DCP.

hp (:mod:`hp.chaos.slurm_elastic`): ``hp slurm submit`` on a local Slurm, a base of one node and one scaling
unit, one rank per node (two ranks on this 2-core box: none shares a core). Capacity arrives (another
tenant's job leaves: 1 → 2), then ``cycles`` times a high-priority job preempts the unit (2 → 1) and ends
(1 → 2). Nothing is signalled by the bench: Slurm does it.

* ``shrink_s``: the preemption notice (Slurm's SIGTERM reaching the unit's agent, which asks the
  controller to leave: its logged ``preempt`` decision) → the first step committed at the smaller size.
* ``grow_s``: capacity back (the other job's last instant) → the first step committed at the larger size:
  Slurm starting the waiting unit (its backfill pass, ``srun``), the agent's start (Python, torch),
  joining and hydrating from a peer.

Baseline (:mod:`hp.chaos.baselines.elastic_torchrun`): the same job under torchrun ``--nnodes 1:2`` with
DCP checkpoints, through the same events (a new agent: 1 → 2; SIGTERM to an agent: 2 → 1), each measured
the same way (the event → the first commit at the new size). Its agents are processes on the same host,
started by the harness, not Slurm jobs: Slurm's own scheduling delay (about a second) is in hp's
``grow_s`` only. Medians with their spread; both in the same run.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass

from hp.chaos.bench.meta import BenchRun, spread

DEFINITION_VERSION = 1  # event -> first commit at the new size (shrink: from the notice; grow: from capacity back)


@dataclass
class SlurmBenchConfig:
    cycles: int = 3
    steps: int = 700  # the events end near step 400 here; the job must outlast them
    global_batch: int = 48
    micro_batch: int = 4
    model_size: str = "tiny"
    corpus_mb: int = 16
    seed: int = 0
    log_dir: str | None = None


def run_bench(cfg: SlurmBenchConfig) -> dict:
    from hp.chaos.baselines.elastic_torchrun import ElasticBaselineConfig, run_baseline
    from hp.chaos.slurm_elastic import SlurmElasticConfig, run_slurm_elastic

    bench = BenchRun("elastic_slurm", DEFINITION_VERSION)
    root = cfg.log_dir or tempfile.mkdtemp(prefix="hp_bench_elastic_slurm_")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    hp = run_slurm_elastic(SlurmElasticConfig(
        steps=cfg.steps, min_nodes=1, max_nodes=2, global_batch=cfg.global_batch, micro_batch=cfg.micro_batch,
        model_size=cfg.model_size, corpus_mb=cfg.corpus_mb, seed=cfg.seed, cycles=cfg.cycles, node_down=False,
        reference=False, log_dir=os.path.join(root, "hp")))
    events = "grow@20," + ",".join(["preempt@+10", "grow@+10"] * cfg.cycles)
    base = run_baseline(ElasticBaselineConfig(
        nodes=1, nproc_per_node=1, events=events, kill_rank=0, steps=cfg.steps, global_batch=cfg.global_batch,
        micro_batch=cfg.micro_batch, model_size=cfg.model_size, corpus_mb=cfg.corpus_mb, seed=cfg.seed,
        log_dir=os.path.join(root, "torchrun")))
    per_kind = {kind: [e["first_commit_after_s"] for e in base.get("events", [])
                       if e["kind"] == kind and e.get("first_commit_after_s") is not None] for kind in ("preempt", "grow")}
    figures = {"shrink_s": spread(hp["shrink_s"]), "grow_s": spread(hp["grow_s"]),
               "baseline_shrink_s": spread(per_kind["preempt"]), "baseline_grow_s": spread(per_kind["grow"])}
    median = {k: v["median"] if v else None for k, v in figures.items()}
    return bench.stamp({
        "completed": bool(hp["completed"] and base.get("completed")),
        "config": asdict(cfg),
        "shrink_s": median["shrink_s"], "grow_s": median["grow_s"],
        "baseline_s": {"shrink_s": median["baseline_shrink_s"], "grow_s": median["baseline_grow_s"]},
        "spread": figures,
        "ratio": {k: round(median[f"baseline_{k}_s"] / median[f"{k}_s"], 2)
                  if median[f"{k}_s"] and median[f"baseline_{k}_s"] else None for k in ("shrink", "grow")},
        "definition": "event -> first commit at the new size; hp shrink from the controller's preempt decision "
                      "(the unit's agent got Slurm's SIGTERM), hp grow from the end of the job holding the node; "
                      "torchrun from the harness's SIGTERM to an agent / start of a new agent",
        "baseline_launch": "torchrun agents are local processes started by the harness, not Slurm jobs",
        "hp": {k: hp.get(k) for k in ("world_sizes", "lost_steps", "shrink_s", "grow_s", "marks", "base_state",
                                       "grace_s", "wall_s", "error", "log_dir")},
        "baseline": {"events": [{k: e.get(k) for k in ("kind", "first_commit_after_s", "pause_s", "lost_steps",
                                                        "world_before", "world_after")} for e in base.get("events", [])],
                     "lost_steps": sum(e.get("lost_steps") or 0 for e in base.get("events", [])),
                     "error": base.get("error"), "log_dir": base.get("log_dir")},
        "log_dir": root,
    })


def format_table(result: dict) -> str:
    s = result["spread"]

    def cell(v: dict | None) -> str:
        return f"{v['median']:>8.3f} {'[%.3f-%.3f]' % (v['min'], v['max']):>15}" if v else f"{'-':>8} {'':>15}"

    return "\n".join([
        "hp bench elastic --scheduler slurm: event -> first commit at the new size (s), 1 rank per node, 2 nodes",
        f"{'':8} {'hp':>8} {'[min-max]':>15} {'torchrun+DCP':>13} {'[min-max]':>15}",
        f"{'shrink':8} {cell(s['shrink_s'])} {cell(s['baseline_shrink_s']):>29}",
        f"{'grow':8} {cell(s['grow_s'])} {cell(s['baseline_grow_s']):>29}",
        f"hp world sizes {result['hp']['world_sizes']}, lost steps {result['hp']['lost_steps']}; "
        f"torchrun+DCP lost steps {result['baseline']['lost_steps']}"])

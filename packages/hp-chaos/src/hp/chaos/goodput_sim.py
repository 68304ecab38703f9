"""Goodput at cluster scale: a discrete-event simulation of one training job (``hp goodput simulate``).

Pure logic, standard library only (``random``, ``math``): no torch, no numpy, no I/O. The CLI
(:mod:`hp.chaos.goodput_cli`) reads the results file, prints and plots.

**Goodput** = useful compute time / wall time of the job's N GPUs. Spare nodes are extra hardware,
not in N: their cost is reported beside (``spare_fraction``), not inside, the goodput.

**Failure model.** Every GPU fails independently at a constant rate (exponential inter-arrival
times), so a job of N GPUs has MTTF(N) = MTTF_gpu / N. A GPU failure takes its node (``gpus_per_node``,
default 8) out. MTTF_gpu is fitted to one published figure (``--mttf-source``):

- ``meta-16k`` (default): Meta research clusters, MTTF 1.8 h for 16,384-GPU jobs -> 29,491 GPU-hours;
  the published figure at the scale the goal is stated for, and the most pessimistic there but one;
- ``meta-1k``: the same study, MTTF 7.9 h for 1,024-GPU jobs -> 8,090 GPU-hours (0.49 h at 16k:
  the 1/N law does not join Meta's two figures; both fits are reported);
- ``llama3``: Llama 3 405B pre-training, 419 unexpected interruptions in 54 days on 16,384 GPUs ->
  MTTF 3.09 h -> 50,680 GPU-hours.

Failures hit the running job at any time, its restarts and pauses included (a failure during a
checkpoint-restart restarts the restart). Idle spare nodes do not fail.

**Checkpoint-restart** (``ckpt_restart``): compute for tau, then a blocking save of C; a failure
loses the work since the last completed save and costs R (fault -> every rank restored: relaunch,
NCCL init, load; getting a replacement node from the cluster is inside R). tau is Daly's
higher-order optimum (:func:`young_daly_interval`, ~ Young's sqrt(2 C M) - C for C << M) with M =
MTTF(N). Its expected goodput has a closed form (:func:`ckpt_restart_expected`).

**hp** (``hp``): in-process recovery with hot spares. A failure with a spare left costs a downtime D
(the measured distribution, sampled, plus ``reinit_s``), no lost work: the interrupted step is
inside D by its definition. The job keeps S spare nodes (``spares_per_1k_gpus`` per 1,024 GPUs,
rounded up); a consumed spare is replaced ``replace_s`` later. hp also saves a tiered (in-memory)
checkpoint: a stall s per save at its own Daly interval (M = MTTF(N)). With no spare left, a fixed-size
hp job stops (restarts exhausted, as hp's controller decides) and is relaunched like
checkpoint-restart: R, losing the work since hp's last checkpoint (restored from the tier).

**hp elastic** (``hp_elastic``): as hp, but with no spare left it shrinks in process (the measured
shrink pause + ``reinit_s``) and runs at (nodes - lost) / nodes throughput until a replacement node
arrives, then grows back (the measured grow pause + ``reinit_s``); it falls back to a relaunch only
if no node would be left.

The pure functions take seconds; the simulation runs ``seeds`` independent histories of
``horizon_s`` and reports their mean and spread.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass
from typing import Any

STRATEGIES = ("ckpt_restart", "hp", "hp_elastic")
GOAL_GOODPUT = 0.97
_H = 3600.0

# Published failure figures: (GPUs, job MTTF in hours, citation).
MTTF_SOURCES: dict[str, tuple[int, float, str]] = {
    "meta-16k": (16_384, 1.8, "published: Meta research clusters (Kokolis et al. 2024, 'Revisiting Reliability "
                              "in Large-Scale ML Research Clusters'): MTTF 1.8 h at 16,384 GPUs"),
    "meta-1k": (1_024, 7.9, "published: Meta research clusters (Kokolis et al. 2024): MTTF 7.9 h at 1,024 GPUs"),
    "llama3": (16_384, 54 * 24 / 419, "published: Llama 3 405B pre-training (Meta, 'The Llama 3 Herd of Models', "
                                      "2024): 419 unexpected interruptions in 54 days on 16,384 GPUs"),
}


def gpu_mttf_s(source: str) -> float:
    """One GPU's MTTF in seconds under MTTF(N) = MTTF_gpu / N, fitted to a published figure."""
    gpus, mttf_h, _ = MTTF_SOURCES[source]
    return gpus * mttf_h * _H


def young_daly_interval(save_s: float, mttf_s: float) -> float:
    """Compute time between checkpoints: Daly's higher-order optimum (2006), for a save cost C < 2M

    tau = sqrt(2 C M) [1 + sqrt(C / 2M) / 3 + (C / 2M) / 9] - C, else M. It is Young's sqrt(2 C M)
    to first order. ``inf`` when M is (no failures: never checkpoint); 0 when C is (free saves)."""
    if save_s <= 0:
        return 0.0
    if math.isinf(mttf_s):
        return math.inf
    if save_s >= 2 * mttf_s:
        return mttf_s
    x = save_s / (2 * mttf_s)
    return math.sqrt(2 * save_s * mttf_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_s


def ckpt_restart_expected(tau: float, save_s: float, restart_s: float, mttf_s: float) -> float:
    """Exact expected goodput of checkpoint-restart under exponential failures (Daly 2006): a segment
    of tau + C takes M e^(R/M) (e^((tau+C)/M) - 1) of wall time on average."""
    if math.isinf(mttf_s):
        return tau / (tau + save_s)
    return tau / (mttf_s * math.exp(restart_s / mttf_s) * math.expm1((tau + save_s) / mttf_s))


def ckpt_restart_first_order(tau: float, save_s: float, restart_s: float, mttf_s: float) -> float:
    """The textbook first-order estimate: 1 - C/tau - (tau/2 + R)/M."""
    return 1 - save_s / tau - (tau / 2 + restart_s) / mttf_s


@dataclass(frozen=True)
class Costs:
    """What each strategy pays, in seconds. A tuple is a measured distribution, sampled uniformly."""

    save_s: float  # checkpoint-restart's blocking save (C)
    restart_s: tuple[float, ...]  # checkpoint-restart's restart (R), also hp's relaunch without a spare
    hp_downtime_s: tuple[float, ...]  # hp's in-process recovery through a spare
    hp_stall_s: float  # hp's tiered-checkpoint stall per save
    shrink_s: tuple[float, ...]  # hp elastic: the pause to shrink by one node
    grow_s: tuple[float, ...]  # hp elastic: the pause to grow back
    reinit_s: float = 0.0  # added to every hp pause: process-group re-init at cluster scale
    replace_s: float = 1800.0  # a consumed spare (or a lost node) comes back after this
    spares_per_1k_gpus: float = 1.0  # spare nodes per 1,024 GPUs, rounded up
    gpus_per_node: int = 8


def spare_nodes(gpus: int, costs: Costs) -> int:
    return math.ceil(costs.spares_per_1k_gpus * gpus / 1024 - 1e-9)


def _advance(pos: float, dt: float, tau: float, cycle: float) -> tuple[float, float, bool, float]:
    """``dt`` seconds of running through the periodic schedule (compute tau, save cycle - tau) from
    offset ``pos``: (compute seconds, new offset, whether a save completed, compute since it)."""
    end = pos + dt
    k = math.floor(end / cycle) if math.isfinite(cycle) else 0
    rem = max(end - k * cycle, 0.0) if k else end
    compute = (k * tau if k else 0.0) + min(rem, tau) - min(pos, tau)  # tau may be inf (never save)
    return compute, rem, k > 0, min(rem, tau)


def simulate_run(strategy: str, gpus: int, mttf_gpu_s: float, costs: Costs, horizon_s: float,
                 seed: int, tau: float | None = None) -> dict[str, Any]:
    """One history of ``horizon_s`` wall seconds; ``tau`` overrides the strategy's Daly interval.

    Returns goodput (useful / horizon) and counts of what happened."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r} (one of {', '.join(STRATEGIES)})")
    fail_rng, cost_rng = random.Random(seed * 2 + 1), random.Random(seed * 2 + 2)
    nodes = max(1, math.ceil(gpus / costs.gpus_per_node))
    node_rate = costs.gpus_per_node * (1.0 / mttf_gpu_s if math.isfinite(mttf_gpu_s) else 0.0)
    job_mttf = math.inf if node_rate == 0 else 1 / (node_rate * nodes)
    ckpt = costs.save_s if strategy == "ckpt_restart" else costs.hp_stall_s
    if tau is None:
        tau = young_daly_interval(ckpt, job_mttf)
    free_saves = ckpt <= 0 or tau <= 0
    cycle = math.inf if free_saves else tau + ckpt
    in_process = strategy != "ckpt_restart"
    spares = spare_nodes(gpus, costs) if in_process else 0
    active = nodes
    t = useful = since = pos = 0.0
    down_until: float | None = None
    returns: list[float] = []  # arrival times of replacement nodes
    count = {"failures": 0, "spare_recoveries": 0, "restarts": 0, "shrinks": 0, "grows": 0, "lost_work_s": 0.0}

    def next_failure() -> float:
        rate = node_rate * active
        return math.inf if rate == 0 else t + fail_rng.expovariate(rate)

    def pause(until: float) -> None:
        nonlocal down_until
        down_until = until if down_until is None else max(down_until, until)

    def relaunch() -> None:  # lose the work since the last completed save, then R
        nonlocal useful, since, pos, down_until
        count["restarts"] += 1
        count["lost_work_s"] += since
        useful, since, pos = useful - since, 0.0, 0.0
        down_until = t + cost_rng.choice(costs.restart_s)  # a failure during a restart restarts it

    fail_at = next_failure()
    while t < horizon_s:
        when = min(fail_at, returns[0] if returns else math.inf,
                   math.inf if down_until is None else down_until, horizon_s)
        if down_until is None:  # running: progress through the compute/save schedule
            f = active / nodes
            if free_saves:
                useful += f * (when - t)
            else:
                compute, pos, saved, after = _advance(pos, when - t, tau, cycle)
                useful += f * compute
                since = f * after if saved else since + f * compute
        t = when
        if t >= horizon_s:
            break
        if down_until is not None and t == down_until:
            down_until = None
        elif returns and t == returns[0]:
            heapq.heappop(returns)
            if active < nodes:
                active += 1
                count["grows"] += 1
                pause(t + cost_rng.choice(costs.grow_s) + costs.reinit_s)
                fail_at = next_failure()
            else:
                spares += 1
        elif t == fail_at:
            count["failures"] += 1
            if not in_process:
                relaunch()
            elif spares > 0:
                spares -= 1
                count["spare_recoveries"] += 1
                heapq.heappush(returns, t + costs.replace_s)
                pause(t + cost_rng.choice(costs.hp_downtime_s) + costs.reinit_s)
            elif strategy == "hp_elastic" and active > 1:
                active -= 1
                count["shrinks"] += 1
                heapq.heappush(returns, t + costs.replace_s)
                pause(t + cost_rng.choice(costs.shrink_s) + costs.reinit_s)
            else:
                relaunch()
            fail_at = next_failure()
    return {"goodput": useful / horizon_s, "tau_s": tau, "job_mttf_s": job_mttf, **count}


def _stats(xs: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
            "std": statistics.stdev(xs) if len(xs) > 1 else 0.0}


def simulate(costs: Costs, mttf_source: str = "meta-16k", sizes: list[int] | None = None, days: float = 30.0,
             seeds: int = 10, seed: int = 0) -> list[dict[str, Any]]:
    """Every strategy at every cluster size (default 16 ... 16,384 GPUs), ``seeds`` histories each."""
    sizes = sizes or [2 ** k for k in range(4, 15)]
    mttf_gpu = gpu_mttf_s(mttf_source)
    rows = []
    for gpus in sizes:
        runs = {s: [simulate_run(s, gpus, mttf_gpu, costs, days * 86400, seed * 1_000_003 + i * 7919 + gpus)
                    for i in range(seeds)] for s in STRATEGIES}
        stats = {s: _stats([r["goodput"] for r in rs]) for s, rs in runs.items()}
        m = runs["ckpt_restart"][0]["job_mttf_s"]
        tau = runs["ckpt_restart"][0]["tau_s"]
        rows.append({
            "gpus": gpus, "nodes": math.ceil(gpus / costs.gpus_per_node), "spare_nodes": spare_nodes(gpus, costs),
            "spare_fraction": spare_nodes(gpus, costs) * costs.gpus_per_node / gpus,
            "mttf_h": m / _H, "ckpt_interval_s": tau, "hp_ckpt_interval_s": runs["hp"][0]["tau_s"],
            "goodput": {s: stats[s]["mean"] for s in STRATEGIES},
            "spread": {s: {k: v for k, v in stats[s].items() if k != "mean"} for s in STRATEGIES},
            "analytic": {"ckpt_restart": ckpt_restart_expected(tau, costs.save_s, statistics.fmean(costs.restart_s), m)},
            "events_per_run": {s: {k: statistics.fmean(r[k] for r in rs)
                                   for k in ("failures", "spare_recoveries", "restarts", "shrinks")}
                               for s, rs in runs.items()},
        })
    return rows


def hp_breakeven_downtime_s(gpus: int, costs: Costs, mttf_source: str, goal: float = GOAL_GOODPUT) -> float:
    """The per-failure downtime at which hp (spares never exhausted) would fall to ``goal``:
    goodput ~ tau/(tau+s) * (1 - D/M) at hp's own checkpoint interval tau and stall s."""
    m = gpu_mttf_s(mttf_source) / gpus
    tau = young_daly_interval(costs.hp_stall_s, m)
    ckpt = 1.0 if tau <= 0 else tau / (tau + costs.hp_stall_s)
    return max(0.0, m * (1 - goal / ckpt))


def worked_example(instances: int = 256, usd_per_instance_h: float = 55.0, ckpt_every_min: float = 20.0,
                   recovery_min: float = 10.0, disruptions_per_month: int = 30) -> dict[str, float]:
    """The published worked example: a disruption loses half a checkpoint interval of work on average
    plus the recovery, on every instance; one disruption a day for a month."""
    lost_min = ckpt_every_min / 2 + recovery_min
    instance_h = instances * lost_min / 60
    per = instance_h * usd_per_instance_h
    return {"instances": instances, "usd_per_instance_h": usd_per_instance_h, "ckpt_every_min": ckpt_every_min,
            "lost_work_min": ckpt_every_min / 2, "recovery_min": recovery_min, "instance_h_per_disruption": instance_h,
            "cost_per_disruption_usd": per, "disruptions_per_month": disruptions_per_month,
            "monthly_cost_usd": per * disruptions_per_month, "delay_h": disruptions_per_month * lost_min / 60}


def disruption_costs(costs: Costs, mttf_source: str, instances: int = 256, usd_per_instance_h: float = 55.0,
                     disruptions_per_month: int = 30) -> dict[str, dict[str, float]]:
    """Expected cost of one disruption on the worked example's cluster, per strategy, from ``costs``.

    ckpt_restart: (tau + C)/2 of lost work at its Daly interval plus R; hp: its mean downtime (a spare
    takes the node); hp_elastic without a spare: shrink + grow pauses, plus one node's compute for
    ``replace_s`` (the job runs a node short)."""
    gpus = instances * costs.gpus_per_node
    m = gpu_mttf_s(mttf_source) / gpus
    tau = young_daly_interval(costs.save_s, m)
    restart = statistics.fmean(costs.restart_s)
    job_s = {"ckpt_restart": (tau + costs.save_s) / 2 + restart,
             "hp": statistics.fmean(costs.hp_downtime_s) + costs.reinit_s,
             "hp_elastic_no_spare": statistics.fmean(costs.shrink_s) + statistics.fmean(costs.grow_s)
             + 2 * costs.reinit_s}
    out = {}
    for name, secs in job_s.items():
        inst_h = instances * secs / _H + (costs.replace_s / _H if name == "hp_elastic_no_spare" else 0.0)
        out[name] = {"job_seconds": secs, "instance_h_per_disruption": inst_h,
                     "cost_per_disruption_usd": inst_h * usd_per_instance_h,
                     "monthly_cost_usd": inst_h * usd_per_instance_h * disruptions_per_month,
                     "delay_h": disruptions_per_month * secs / _H}
    out["ckpt_restart"]["ckpt_interval_s"] = tau
    return out

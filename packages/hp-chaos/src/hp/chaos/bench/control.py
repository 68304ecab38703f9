"""``hp bench control``: what learning about generations costs the job's store, and how long a new one
takes to reach every rank, for the two designs of issue #14, in one run:

- ``per_rank_poll`` (hp before the relay): every rank's watch thread reads the generation key every
  10 ms (``check`` + ``get``, as ``JobView.value`` does) and, on a new one, reads its plan.
- ``per_node_fanout`` (:mod:`hp.core.fanout`): one :class:`~hp.core.fanout.Relay` per node blocks on the
  store; each rank keeps a :class:`~hp.core.fanout.Mirror` of its node's channel.

Ranks are threads (mostly blocked) of simulated nodes of ``ranks_per_node``, spread over ``processes``
processes (:mod:`hp.chaos.bench.control_nodes`: in a job every rank has its own process, so no one
interpreter lock serialises them all), against one real store: a ``TCPStore`` this process hosts, or with
``--store etcd`` a real etcd (:class:`hp.core.etcd_store.EtcdServer`). The harness plays the controller:
it publishes sealed plans (one holder per rank, as big as a real plan), then the generation, as
:mod:`hp.core.controller` does; its own requests are not counted, every other client's are.

- ``requests_per_rank_s``: requests the store received during an idle window, per second and per rank.
  The fan-out window spans one re-wait period of the relays (``relay_wait_s`` + 1 s), so each relay's
  periodic re-read falls in it once.
- fan-out: from just before the plan's ``set`` to the moment a rank holds that plan's bytes; per change
  the p50, p99 and max over the ranks, ``changes`` changes per repeat. Verifying the plan is each rank's
  own work, on its own core in a job: ``plan_verify_s`` times it (one rank, that size's plan).
  Figures are medians over every change of every repeat with min, max and values
  (:func:`hp.chaos.bench.meta.spread`).
- projection to ``project_to`` ranks: requests/s at the store = per-rank rate x ranks (neither design's
  per-rank rate depends on the number of ranks); fan-out p99: least-squares line over the sizes measured,
  extrapolated; and, for the relay, by stage: on a cluster the nodes receive in parallel, so only the
  store's stage (publish -> the last node's first rank) grows with the job, a node's own stage (its
  first rank -> its others) does not, and each rank then verifies the plan. Both are upper bounds: here
  every node shares the same two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hp.chaos.bench.control_nodes import POLL_S, TOKEN, GroupSpec
from hp.chaos.bench.meta import int_list
from hp.core.errors import UsageError
from hp.core.fanout import RELAY_WAIT_S
from hp.core.protocol import GENERATION_KEY, Plan, plan_key

DEFINITION_VERSION = 1
MODES = ("per_rank_poll", "per_node_fanout")
GOAL = {"requests_per_rank_s": 1.0, "fanout_p99_s": 0.1}  # issue #14, at 1,000 ranks


@dataclass
class ControlBenchConfig:
    sizes: tuple[int, ...] = (250, 500, 1000)
    ranks_per_node: int = 8
    processes: int = 4
    repeats: int = 3
    changes: int = 5
    poll_idle_s: float = 3.0
    relay_wait_s: float = RELAY_WAIT_S
    store: str = "tcp"
    project_to: int = 16384
    timeout_s: float = 60.0


def _percentile(xs: list[float], pct: int) -> float:
    """The smallest value with ``pct`` % of the values at or below it."""
    ordered = sorted(xs)
    return ordered[max(0, -(-pct * len(ordered) // 100) - 1)]


def _plan(generation: int, ranks: int) -> str:
    return Plan(generation, ranks, "running", "", {r: f"r{r}.0" for r in range(ranks)}, "bench").to_json()


class _Trial:
    """One design at one size: start the processes of simulated nodes, count an idle window, time changes."""

    def __init__(self, mode: str, ranks: int, cfg: ControlBenchConfig, store: tuple[str, int, str | None],
                 publish: Callable[[str, str], Any]) -> None:
        self.mode, self.ranks, self.cfg, self._store, self._set = mode, ranks, cfg, store, publish
        self.generation = 0
        self._pipes: list[Any] = []
        self._procs: list[Any] = []

    def _publish(self) -> float:
        """The controller's bump: the plan, then the number, sealed; returns when it started."""
        from hp.core.signed_values import seal

        self.generation += 1
        g = self.generation
        sealed = seal(TOKEN, plan_key(g), _plan(g, self.ranks))
        started = time.monotonic()
        self._set(plan_key(g), sealed)
        self._set(GENERATION_KEY, seal(TOKEN, GENERATION_KEY, str(g)))
        return started

    def _ask(self, command: str, arg: Any = None) -> list[Any]:
        for pipe in self._pipes:
            pipe.send((command, arg))
        return [pipe.recv() for pipe in self._pipes]

    def start(self, ctx: Any) -> None:
        from hp.chaos.bench import control_nodes

        self._publish()
        per, host_port_job = self.cfg.ranks_per_node, self._store
        nodes = -(-self.ranks // per)
        share = -(-nodes // self.cfg.processes)
        for first in range(0, nodes, share):
            count = min(share, nodes - first)
            spec = GroupSpec(self.mode, first, count, per, min(count * per, self.ranks - first * per),
                             self.cfg.relay_wait_s, self.cfg.store, *host_port_job, self.cfg.timeout_s)
            here, there = ctx.Pipe()
            self._procs.append(ctx.Process(target=control_nodes.serve, args=(there, spec), daemon=True))
            self._procs[-1].start()
            self._pipes.append(here)
        for pipe in self._pipes:
            if not pipe.poll(self.cfg.timeout_s + 60):
                raise RuntimeError(f"{self.mode}: a process of simulated nodes did not start")
            status, error = pipe.recv()
            if status != "ready":
                raise RuntimeError(f"{self.mode}: a process of simulated nodes failed: {error}")

    def idle_rate(self) -> float:
        """Requests per second and rank the store received while nothing changed."""
        window = self.cfg.poll_idle_s if self.mode == "per_rank_poll" else self.cfg.relay_wait_s + 1.0
        time.sleep(0.3)
        before = sum(self._ask("requests"))
        time.sleep(window)
        return (sum(self._ask("requests")) - before) / window / self.ranks

    def change(self) -> dict[str, float]:
        """Publish one new generation; its fan-out over the ranks (seconds), and its two stages: from the
        store to each node (its first rank), and within each node (a rank after its node's first)."""
        time.sleep(0.2)
        started = self._publish()
        arrivals = [a for got in self._ask("arrivals", self.generation) for a in got]
        if len(arrivals) < self.ranks:
            raise RuntimeError(f"{self.mode}: {self.ranks - len(arrivals)} of {self.ranks} ranks missed generation "
                               f"{self.generation} within {self.cfg.timeout_s:g} s")
        first: dict[int, float] = {}
        for node, t in arrivals:
            first[node] = min(t, first.get(node, t))
        latencies = [t - started for _, t in arrivals]
        return {"p50": _percentile(latencies, 50), "p99": _percentile(latencies, 99), "max": max(latencies),
                "store_stage": max(first.values()) - started,
                "node_stage": _percentile([t - first[node] for node, t in arrivals], 99)}

    def stop(self) -> None:
        for pipe in self._pipes:
            try:
                pipe.send(("stop", None))
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._set = None  # the store server's own client goes before the server does


def _verify_s(ranks: int) -> float:
    """One rank's time to verify and parse a plan of ``ranks`` holders (median of 20)."""
    from hp.core.signed_values import seal, unseal

    sealed = seal(TOKEN, plan_key(2), _plan(2, ranks))
    times = []
    for _ in range(20):
        started = time.perf_counter()
        Plan.from_json(unseal(TOKEN, plan_key(2), sealed))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# ---- the benchmark ------------------------------------------------------------------------

def _fit(points: list[tuple[int, float]], at: int, unit: str = "ranks") -> dict[str, Any] | None:
    """Least-squares line through ``points`` (count of ``unit``, seconds), evaluated at ``at``."""
    if len(points) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    intercept = my - slope * mx
    return {"model": f"seconds = a + b * {unit} (least squares over the sizes measured)", "a_s": intercept,
            "b_s": slope, f"at_{unit}": at, "p99_s": intercept + slope * at}


def run_bench(cfg: ControlBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    import multiprocessing

    from hp.chaos.bench.meta import BenchRun, spread
    from hp.core.plugins import get_backend

    run = BenchRun("control", DEFINITION_VERSION)
    backend = get_backend("store", cfg.store)
    ctx = multiprocessing.get_context("forkserver")  # the processes of simulated nodes: torch imported once
    ctx.set_forkserver_preload(["torch.distributed", "hp.chaos.bench.control_nodes", "hp.core.fanout"])
    etcd = None
    if cfg.store == "etcd":
        from hp.core.etcd_store import EtcdServer

        etcd = EtcdServer("127.0.0.1", die_with_parent=True).start()
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    try:
        for ranks in cfg.sizes:
            samples: dict[str, dict[str, list[float]]] = {m: {"rate": [], "p50": [], "p99": [], "max": [],
                                                              "store_stage": [], "node_stage": []} for m in MODES}
            for repeat in range(cfg.repeats):
                for mode in MODES:  # alternate, so drift on a shared machine hits both alike
                    server = None
                    if etcd is not None:
                        job = f"bench-control-{uuid.uuid4().hex[:12]}"
                        store, publisher = (etcd.host, etcd.port, job), backend.connect(etcd.host, etcd.port, job=job)
                    else:
                        server = backend.serve("127.0.0.1")
                        store, publisher = (server.host, server.port, None), server.store
                    trial = _Trial(mode, ranks, cfg, store, publisher.set)
                    del publisher
                    try:
                        trial.start(ctx)
                        rate = trial.idle_rate()
                        changes = [trial.change() for _ in range(cfg.changes)]
                    finally:
                        trial.stop()
                        if server is not None:
                            server.close()
                    s = samples[mode]
                    s["rate"].append(rate)
                    for c in changes:
                        for q, value in c.items():
                            s[q].append(value)
                    log(f"hp bench control: {ranks} ranks, {mode}, repeat {repeat + 1}/{cfg.repeats}: "
                        f"{rate:.3f} requests/s per rank at idle, fan-out p99 "
                        f"{statistics.median([c['p99'] for c in changes]) * 1e3:.1f} ms")
            verify = _verify_s(ranks)
            for mode in MODES:
                s = samples[mode]
                rows[mode].append({"ranks": ranks, "nodes": -(-ranks // cfg.ranks_per_node),
                                   "requests_per_rank_s": spread(s["rate"]), "fanout_p50_s": spread(s["p50"]),
                                   "fanout_p99_s": spread(s["p99"]), "fanout_max_s": spread(s["max"]),
                                   "store_stage_s": spread(s["store_stage"]),
                                   "node_stage_p99_s": spread(s["node_stage"]), "plan_verify_s": verify})
    finally:
        if etcd is not None:
            etcd.stop()
    return run.stamp(_result(cfg, rows))


def _result(cfg: ControlBenchConfig, rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    projection = {}
    for mode in MODES:
        rate = rows[mode][-1]["requests_per_rank_s"]["median"]
        projection[mode] = {
            "ranks": cfg.project_to, "requests_per_rank_s": rate, "store_requests_s": rate * cfg.project_to,
            "fanout_p99": _fit([(r["ranks"], r["fanout_p99_s"]["median"]) for r in rows[mode]], cfg.project_to)}
    projection["per_rank_poll"]["design_store_requests_s"] = 2 / POLL_S * cfg.project_to
    projection["plan_verify_s"] = verify = _verify_s(cfg.project_to)  # each rank, in parallel, after its fan-out
    fanout, nodes = rows["per_node_fanout"], -(-cfg.project_to // cfg.ranks_per_node)
    store_stage = _fit([(r["nodes"], r["store_stage_s"]["median"]) for r in fanout], nodes, "nodes")
    if store_stage is not None:  # on a cluster the nodes receive in parallel: only the store's stage grows
        node_stage = fanout[-1]["node_stage_p99_s"]["median"]
        projection["per_node_fanout"]["by_stage"] = {
            "model": "store stage (last node's first rank; least-squares line over the nodes measured) at "
                     f"{nodes} nodes + a node's own stage (p99 at the largest size, independent of the job's "
                     "size) + one rank verifying a plan of that size",
            "store_stage_s": store_stage["p99_s"], "store_stage_s_per_node": store_stage["b_s"],
            "node_stage_p99_s": node_stage, "plan_verify_s": verify,
            "p99_s": store_stage["p99_s"] + node_stage + verify}
    top = rows["per_node_fanout"][-1]
    result = {
        "requests_per_rank_s": top["requests_per_rank_s"]["median"],
        "fanout_p99_s": top["fanout_p99_s"]["median"],
        "ranks": top["ranks"],
        "mode": "per_node_fanout",
        "goal": {**GOAL, "met": top["requests_per_rank_s"]["median"] <= GOAL["requests_per_rank_s"]
                 and top["fanout_p99_s"]["median"] <= GOAL["fanout_p99_s"]},
        "modes": rows,
        "projection": projection,
        "definition": {
            "requests_per_rank_s": "requests the store received during an idle window / window / ranks "
                                   "(fan-out window: relay_wait_s + 1 s, one re-wait of every relay)",
            "fanout_s": "from just before the plan's set to the moment a rank holds that plan's bytes; per "
                        "change p50/p99/max over the ranks; medians over every change of every repeat",
            "plan_verify_s": "one rank's time to verify and parse a plan of that many holders (its own core)",
            "store_stage_s": "per change: from the plan's set until the last node's first rank had it (max)",
            "node_stage_p99_s": "per change: p99 over the ranks of the time after their node's first rank",
            "per_rank_poll": "each rank: check + get of the generation key every 10 ms, then its plan",
            "per_node_fanout": "one hp.core.fanout.Relay per node (a blocking store read), each rank a Mirror "
                               "of its node's channel",
            "projection": "store requests/s = per-rank rate x ranks; fan-out p99: least-squares line over the "
                          "sizes; by_stage (fan-out): the store stage's line over the nodes + a node's own stage "
                          "+ plan_verify_s. Upper bounds: on this box every node's relay and ranks share 2 cores",
        },
        "notes": [f"{len(os.sched_getaffinity(0))} usable cores for up to {max(cfg.sizes)} rank threads in "
                  f"{cfg.processes} processes: the poll design saturates them, so its measured per-rank rate is "
                  f"what the store could serve, below the design's {2 / POLL_S:.0f} requests/s per rank"],
        "config": {"sizes": list(cfg.sizes), "ranks_per_node": cfg.ranks_per_node, "processes": cfg.processes,
                   "repeats": cfg.repeats, "changes": cfg.changes, "poll_idle_s": cfg.poll_idle_s,
                   "relay_wait_s": cfg.relay_wait_s, "store": cfg.store, "project_to": cfg.project_to},
    }
    return result


def format_table(r: dict[str, Any]) -> str:
    def fig(sp: dict[str, Any] | None, scale: float = 1.0) -> str:
        return f"{sp['median'] * scale:.3f} [{sp['min'] * scale:.3f}-{sp['max'] * scale:.3f}]" if sp else "-"

    lines = [f"hp bench control ({r['config']['store']} store): median [min-max], {r['machine']['cores']} cores",
             f"{'mode':>16} {'ranks':>6} {'requests/s/rank':>24} {'fan-out p99 ms':>26} {'fan-out max ms':>26}"]
    for mode, rows in r["modes"].items():
        for row in rows:
            lines.append(f"{mode:>16} {row['ranks']:>6} {fig(row['requests_per_rank_s']):>24} "
                         f"{fig(row['fanout_p99_s'], 1e3):>26} {fig(row['fanout_max_s'], 1e3):>26}")
    lines.append("plan verify, one rank: " + ", ".join(f"{row['ranks']} ranks {row['plan_verify_s'] * 1e3:.2f} ms"
                                                       for row in r["modes"]["per_node_fanout"])
                 + f", {r['config']['project_to']} ranks {r['projection']['plan_verify_s'] * 1e3:.2f} ms")
    for mode in MODES:
        p = r["projection"][mode]
        fit = p["fanout_p99"]
        lines.append(f"at {p['ranks']} ranks, {mode}: {p['store_requests_s']:.0f} requests/s at the store"
                     + (f", fan-out p99 <= {fit['p99_s'] * 1e3:.0f} ms (line over all ranks)" if fit else "")
                     + (f", {p['by_stage']['p99_s'] * 1e3:.0f} ms by stage" if "by_stage" in p else ""))
    return "\n".join(lines)


# ---- the CLI: hp bench control -------------------------------------------------------------------

def run_cli(args: argparse.Namespace) -> int:
    if min(args.repeats, args.changes, args.ranks_per_node, args.processes) < 1:
        raise UsageError("--repeats, --changes, --ranks-per-node and --processes must be >= 1")
    cfg = ControlBenchConfig(sizes=int_list(args.sizes, "--sizes", 1, "numbers of ranks >= 1"),
                             ranks_per_node=args.ranks_per_node, processes=args.processes,
                             repeats=args.repeats, changes=args.changes, poll_idle_s=args.idle,
                             relay_wait_s=args.relay_wait, store=args.store, timeout_s=args.timeout)
    # before torch loads here and in the processes of simulated nodes: c10d logs two warnings per timed-out
    # store read, and the relays of one process, timing out together, stall ~5 s in that logging
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if cfg.store == "etcd":
        from hp.core.etcd_store import etcd, etcd_binary

        etcd_binary()  # one line when the server is missing
        if etcd is None:
            raise UsageError("hp bench control --store etcd needs python-etcd: pip install 'hp-core[etcd]'")
    result = run_bench(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_table(result), flush=True)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="250,500,1000", help="comma-separated numbers of ranks (default 250,500,1000)")
    p.add_argument("--ranks-per-node", type=int, default=8, help="ranks per simulated node (default 8)")
    p.add_argument("--processes", type=int, default=4, help="processes the simulated nodes are spread over "
                                                            "(default 4)")
    p.add_argument("--repeats", type=int, default=3, help="trials per size and design (default 3)")
    p.add_argument("--changes", type=int, default=5, help="timed generation changes per trial (default 5)")
    p.add_argument("--idle", type=float, default=3.0, help="idle window of the poll design, s (default 3)")
    p.add_argument("--relay-wait", type=float, default=RELAY_WAIT_S,
                   help=f"the relays' store wait, s (default {RELAY_WAIT_S:g}, as in hp run)")
    p.add_argument("--store", choices=("tcp", "etcd"), default="tcp", help="the job's store (default tcp)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a change may take to reach every rank")
    p.add_argument("--json", action="store_true", help="after the table, the result as the last stdout line")


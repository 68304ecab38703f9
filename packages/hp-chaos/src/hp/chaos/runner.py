"""Run a scenario: the fault-free reference and the faulted job, then check every expectation.

The verdict comes from the jobs' own event logs: bit-equality is every step's losses as exact float
bits, the global mean and every rank's own (each vote slot's: a rank, or a micro-batch), from whichever
ranks committed the step (:func:`hp.checkpointless.demo.run.differing_steps`), and every rank's final
state (:func:`hp.checkpointless.demo.run.compare_state`), against the reference; each fault's recovery (fault -> next commit, split into phases by
:func:`hp.checkpointless.demo.run.recovery_timeline`), the failed generations, and goodput.

**goodput** is ``hp bench goodput``'s (:func:`hp.chaos.bench.goodput.goodput`): 1 - the time the
faults cost / the faulted run's training window (rank 0's first to last commit), each fault's cost
being its aftermath (the last commit before it -> rank 0's first commit after it of the step it hit or
a later one, or after its ``duration_s`` for an outage, cut at the next fault) minus the new steps committed in it at the run's median step, never below 0: in [0, 1] by
construction. The run's own pace (its median step), not the reference's, because a shared machine's
load differs between two runs. Start-up (imports, model build) is the same with or without faults and
dominates a tiny job: it is outside the window.

**Elastic jobs** (``job.elastic``): the reference is the same job (same nodes and ranks per node,
same policy and flags) with no fault, so it runs at its initial world size throughout. The faulted
run's world size per step comes from its commit events (``world``), its scale events and their
pauses from :func:`hp.elastic.demo.run.scale_events` (pause = first commit at the new size − last
commit at the old one − the median step time at the new size; the whole gap where no two
consecutive steps ran at the new size). In exact mode bit-equality is every step's losses (the
slots are micro-batches, the same at any world size) and every rank's final state (weights, buffers,
optimizer: :func:`hp.checkpointless.demo.run.compare_state`) against the reference's: against the
same rank, or rank 0's where the reference had no such rank (a grown job; every rank of a
replicated job holds the same state, which ``compare_state`` checks too).

**failover** (``job.store: etcd``, faults on ``controller``): seconds from the fault's injection to
the next ``controller_elected`` decision of any node (:func:`hp.chaos.launch.read_decisions` merges
the nodes' decision logs), per fault in ``faults[i].failover_s`` and as ``failover_s`` (one entry
per fault, ``None`` for the others); ``controller_elections`` lists every election of the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import tempfile
from dataclasses import asdict, replace
from typing import Any

from hp.chaos import stacks
from hp.chaos.bench import goodput as bench_goodput
from hp.chaos.faults import fault_kinds
from hp.chaos.finish import FinishAfter
from hp.chaos.references import ReferenceCache, checkpoint_storage, fault_free_run, storage_env
from hp.chaos.launch import JobRun, run_job
from hp.chaos.reproducible import reference_recheck
from hp.chaos.scenario import Scenario
from hp.checkpointless.events import finished_at
from hp.checkpointless.demo.run import (RunResult, compare, compare_state, differing_steps, final_states,
                                        recovery_timeline, step_time)
from hp.core.protocol import Decision, Event


def run_scenario(scenario: Scenario, log_dir: str | None = None, cache: ReferenceCache | None = None,
                 env: dict[str, str] | None = None, storage: Any = None) -> dict:
    """Run ``scenario``; returns the result (see :func:`evaluate`). ``storage``: the job's storage
    server (:class:`hp.chaos.faults.storage.StorageServer`), needed by ``storage`` faults."""
    if scenario.job.nodes > 1:
        try:
            import hp.chaos.topology  # noqa: F401
        except ImportError:
            raise NotImplementedError("nodes > 1 needs hp.chaos.topology (network namespaces: issue 4 part B), "
                                      "which is not installed") from None
    if storage is None and scenario.job.checkpoint is None and any(f.target.kind == "storage"
                                                                    for f in scenario.faults):
        raise ValueError("a storage fault needs job.checkpoint (the runner then starts the S3 endpoint it "
                         "freezes) or a storage server passed in")
    if scenario.job.store != "etcd" and any(f.target.kind == "store" for f in scenario.faults):
        raise ValueError(f"a store fault pauses the job's etcd: it needs job.store: etcd, got {scenario.job.store!r}")
    root = log_dir or tempfile.mkdtemp(prefix=f"hp_chaos_{scenario.name}_")
    kinds = fault_kinds()
    hp_faults, actions = [], []
    for spec in scenario.faults:
        injection = kinds[spec.kind].inject(spec, scenario.job.shape)
        hp_faults += injection.hp_faults
        actions += injection.actions
    cache = cache or ReferenceCache()
    reference = None
    if scenario.job.finish_after:  # the job ends at run time (hp.chaos.finish): the reference runs to that step after
        actions.append(FinishAfter(scenario.faults, scenario.expect.world_sizes, scenario.job.finish_after))
    else:
        reference = cache.get(scenario.job, env, root)
    faulted_dir, persisted = os.path.join(root, "faulted"), None
    with checkpoint_storage(scenario.job, faulted_dir) as ck:
        faulted = run_job(scenario.job, faulted_dir, hp_faults, actions, env=storage_env(env, ck),
                          storage=storage or (ck.server if ck else None), train_args=ck.train_args if ck else ())
        if ck and scenario.expect.persisted_step is not None:
            persisted = ck.wait_persisted(scenario.expect.persisted_step)
    ref_job = replace(scenario.job, steps=ran_to(faulted.result.events, scenario.job.steps))
    if reference is None:
        reference = cache.get(ref_job, env, root)
    result = evaluate(scenario, reference, faulted, persisted)
    if scenario.expect.bitwise_equal and result["bitwise_equal"] is False and reference.returncode == 0:
        why = reference_recheck(reference, lambda: fault_free_run(ref_job, os.path.join(root, "reference-again"), env))
        result["failures"] = [f"{f}; {why}" if f.startswith("bitwise_equal:") else f for f in result["failures"]]
    result["log_dir"] = root
    return result


def ran_to(events: list[dict], steps: int) -> int:
    """How many steps the job ran: to the step it finished after, or its ``steps``."""
    end = finished_at(events)
    return steps if end is None else end + 1


def _next_commit(events: list[dict], t0: float, step: int) -> float | None:
    """Seconds from ``t0`` to rank 0's first commit of ``step`` or a later one."""
    return next((e["t"] - t0 for e in events if e["event"] == Event.COMMIT and e.get("rank") == 0
                 and e["t"] >= t0 and e["step"] >= step), None)


def goodput(faulted: RunResult, faults: list[tuple[float, float, int]]) -> float | None:
    """The faulted run's goodput (see the module docstring) under ``faults`` (fault time, how long it
    lasts: 0, or a storage outage's or partition's ``duration_s``, which the aftermath covers too, and the
    step it hit); None with fewer than two commits. A fault's aftermath ends at rank 0's first commit
    after it (and its duration) of the step it hit or a later one: rank 0 may still be committing the
    previous step when a faster rank enters the fault's step (as for ``recovery_s``)."""
    got = sorted((e for e in faulted.events if e["event"] == Event.COMMIT and e.get("rank") == 0),
                 key=lambda e: e["t"])
    seen: set[int] = set()
    new = [(e["t"], e["step"]) for e in got if not (e["step"] in seen or seen.add(e["step"]))]  # new steps only
    commits = [t for t, _ in new]
    if len(commits) < 2 or commits[-1] <= commits[0]:
        return None
    start, end = commits[0], commits[-1]
    pace = statistics.median(b - a for a, b in zip(commits, commits[1:]))
    during = sorted(f for f in faults if start <= f[0] < end)
    aftermaths = [{"t": t, "recovery_s": None,
                   "until": min(next((c for c, s in new if c > t + d and s >= step), end),
                                *[u for u, _, _ in during[i + 1:i + 2]], end)}
                  for i, (t, d, step) in enumerate(during)]
    bench_goodput.charge(aftermaths, commits, pace, start)
    return bench_goodput.goodput([f["cost_s"] for f in aftermaths], end - start)


def failover(elections: list[dict], t0: float | None) -> float | None:
    """Seconds from ``t0`` (a fault's injection) to the first ``controller_elected`` decision at or
    after it (``elections``: those decisions, oldest first); None when none followed."""
    if t0 is None:
        return None
    return next((d["t"] - t0 for d in elections if d["t"] >= t0), None)


def _election(d: dict) -> dict:
    out = {k: d[k] for k in ("t", "epoch", "node_rank") if k in d}
    if isinstance(out.get("node_rank"), str) and out["node_rank"].isdigit():
        out["node_rank"] = int(out["node_rank"])  # early HA builds wrote it as text
    return out


def _floats(losses: dict[int, list[str]]) -> dict[str, list[float]]:
    return {str(s): [float.fromhex(x) for x in v] for s, v in sorted(losses.items())}


def evaluate(scenario: Scenario, reference: RunResult, run: JobRun, persisted: dict | None = None) -> dict:
    """The result: ``passed``, ``bitwise_equal``, ``lost_steps``, ``recovery_s`` (one per fault),
    ``goodput``, ``failures`` (unmet expectations, empty when passed) and the details behind them.
    ``persisted``: :meth:`hp.chaos.ckpt_storage.CheckpointStorage.wait_persisted`'s answer."""
    faulted, expect = run.result, scenario.expect
    events = faulted.events
    completed = faulted.returncode == 0 and not run.timed_out
    verdict = compare(reference, faulted)
    timeline = recovery_timeline(events)
    injected = [e for e in events if e["event"] == Event.FAULT_INJECTED]
    faults = []
    for spec in scenario.faults:
        j = next((j for j, e in enumerate(injected) if spec.injected_by(e)), None)
        entry = timeline[j] if j is not None else {"recovery_s": None, "phases": {}}
        phases, recovery = dict(entry["phases"]), None
        if j is not None:
            recovery = _next_commit(events, injected[j]["t"], spec.at_step)
            if list(phases) in ([], ["replay"]):
                # nothing failed: rank 0 may still have been committing the previous step when a
                # faster rank entered the fault's step, or another fault fired before any commit (a
                # spare's, late when the spare started late); the fault's cost ends at its step's commit
                phases = {"replay": recovery}
        faults.append({"fault": spec.label(), "fired": j is not None, "step": spec.at_step,
                       "t": injected[j]["t"] if j is not None else None,
                       "recovery_s": recovery if list(phases) == ["replay"] else entry["recovery_s"],
                       "phases": phases})
    elections = [d for d in run.decisions if d.get("decision") == Decision.CONTROLLER_ELECTED]
    for f, spec in zip(faults, scenario.faults):
        f["failover_s"] = failover(elections, f["t"]) if run.store == "etcd" and spec.target.kind == "controller" \
            else None
    recoveries = len({e["generation"] for e in events if e["event"] == Event.FAILURE_DETECTED})
    gp = goodput(faulted, [(f["t"], spec.params.get("duration_s") or 0.0, f["step"])
                           for f, spec in zip(faults, scenario.faults) if f["t"] is not None])
    elastic = _elastic(scenario, reference, faulted) if scenario.job.elastic is not None else None
    if elastic is not None and "bitwise_equal" in elastic:
        verdict = {**verdict, "bitwise_equal": elastic["bitwise_equal"]}
    state = None
    if elastic is None:  # every rank's final state too (an elastic job's ranks are compared in _elastic)
        state = compare_state(reference, faulted)
        verdict = {**verdict, "bitwise_equal": verdict["bitwise_equal"] and state["state_equal"]}
    failures: list[str] = []
    if reference.returncode != 0:
        failures.append(f"reference: the fault-free job failed (exit {reference.returncode}): "
                        f"{_last_line(reference.output)}")
    if run.timed_out:
        failures.append(f"completes: the faulted job neither completed nor ended within {scenario.job.timeout_s} s; "
                        f"{_where_stuck(run)}")
    elif expect.completes and not completed:
        failures.append(f"completes: the faulted job failed (exit {faulted.returncode}): {_last_line(faulted.output)}")
    elif not expect.completes and completed:
        failures.append("completes: expected the faulted job to fail, it completed")
    exits = dict(zip(run.agent_pids, run.agent_returncodes))
    for i, f in enumerate(faults):
        if not f["fired"]:
            failures.append(f"faults[{i}] ({f['fault']}) never fired")
        elif scenario.faults[i].kind == "preempt":  # a graceful leave: the preempted agent exits 0
            event = next(e for e in injected if scenario.faults[i].injected_by(e))
            f["agent_exit"] = exits.get(event.get("pid"))
            if f["agent_exit"] != 0:
                failures.append(f"faults[{i}] ({f['fault']}): the preempted agent exited {f['agent_exit']}, "
                                "not 0 (its ranks did not leave the job gracefully)")
    failures += [f"fault action: {e}" for e in run.action_errors]
    if expect.bitwise_equal is not None and verdict["bitwise_equal"] != expect.bitwise_equal:
        if elastic is not None and "losses_differ" in elastic:
            why = (f"steps whose losses (any rank) differ or are missing: {elastic['losses_differ'][:10]}; "
                   f"final state: {'; '.join(elastic['state_differences'][:4]) or 'equal'}")
        else:
            why = (f"steps whose losses (any rank) differ or are missing: {differing_steps(reference, faulted)[:10]}; "
                   f"final state: {('; '.join(state['state_differences'][:4]) or 'equal') if state else 'not compared'}")
        failures.append(f"bitwise_equal: expected {expect.bitwise_equal}, got {verdict['bitwise_equal']} ({why})")
    if expect.lost_steps is not None and verdict["lost_steps"] > expect.lost_steps:
        failures.append(f"lost_steps: expected <= {expect.lost_steps}, got {verdict['lost_steps']}")
    if expect.max_recovery_s is not None:
        for i, f in enumerate(faults):
            if f["fired"] and (f["recovery_s"] is None or f["recovery_s"] > expect.max_recovery_s):
                got = "no commit after it" if f["recovery_s"] is None else f"{f['recovery_s']:.3f} s"
                failures.append(f"max_recovery_s: faults[{i}] ({f['fault']}) expected <= {expect.max_recovery_s} s, "
                                f"got {got}")
    if expect.max_failover_s is not None:
        for i, (f, spec) in enumerate(zip(faults, scenario.faults)):
            if spec.target.kind != "controller" or not f["fired"]:
                continue
            if f["failover_s"] is None or f["failover_s"] > expect.max_failover_s:
                got = "no controller_elected decision after it" if f["failover_s"] is None \
                    else f"{f['failover_s']:.3f} s"
                failures.append(f"max_failover_s: faults[{i}] ({f['fault']}) expected <= {expect.max_failover_s} s, "
                                f"got {got}")
    if expect.min_goodput is not None and (gp is None or gp < expect.min_goodput):
        failures.append(f"min_goodput: expected >= {expect.min_goodput}, got {gp if gp is None else round(gp, 3)}")
    if expect.recoveries is not None and recoveries > expect.recoveries:
        failures.append(f"recoveries: expected <= {expect.recoveries}, got {recoveries}")
    if expect.error_contains is not None and expect.error_contains not in faulted.output:
        failures.append(f"error_contains: {expect.error_contains!r} not in the faulted job's output")
    if expect.world_sizes is not None and elastic["world_sizes"] != expect.world_sizes:
        failures.append(f"world_sizes: expected {expect.world_sizes}, got {elastic['world_sizes']}")
    if scenario.job.finish_after and completed and finished_at(events) is None:
        failures.append(f"finish_after: the job ran to its last step ({scenario.job.steps}) instead of ending "
                        f"{scenario.job.finish_after} steps after its events (hp finish)")
    if expect.max_pause_s is not None:
        for c in elastic["scale_events"]:
            pause = c["pause_s"] if c["pause_s"] is not None else c["gap_s"]
            if pause > expect.max_pause_s:
                failures.append(f"max_pause_s: the {c['kind']} {c['from']} -> {c['to']} before step "
                                f"{c['first_step_after']} expected <= {expect.max_pause_s} s, got {pause:.3f} s")
    if expect.persisted_step is not None and not (persisted and persisted["ok"]):
        got = persisted["detail"].splitlines()[-1] if persisted and persisted["detail"] else "not checked"
        failures.append(f"persisted_step: no complete checkpoint of step {expect.persisted_step} in S3 "
                        f"{persisted['waited_s'] if persisted else 0} s after the job ended: {got[:300]}")
    return {
        "name": scenario.name,
        "passed": not failures,
        "bitwise_equal": verdict["bitwise_equal"],
        **({"state_differences": state["state_differences"]} if state is not None else {}),
        "lost_steps": verdict["lost_steps"],
        "recovery_s": [f["recovery_s"] for f in faults],
        "failover_s": [f["failover_s"] for f in faults],
        "goodput": gp,
        "failures": failures,
        "completed": completed,
        "returncode": faulted.returncode,
        "recoveries": recoveries,
        "faults": faults,
        "steps": ran_to(events, scenario.job.steps),
        "finished_at": finished_at(events),
        "step_time_s": step_time(reference),
        "wall_s": {"reference": reference.wall_s, "faulted": faulted.wall_s},
        "orphans_killed": run.orphans_killed,
        **({"persisted": persisted} if persisted is not None else {}),
        **({"elastic": {k: v for k, v in elastic.items() if k != "bitwise_equal"}} if elastic is not None else {}),
        "agent_returncodes": run.agent_returncodes,
        **({"controller_elections": [_election(d) for d in elections]} if run.store == "etcd" else {}),
        "losses": {"reference": _floats(reference.losses()), "faulted": _floats(faulted.losses())},
        "t0": {"reference": _first_commit(reference), "faulted": _first_commit(faulted)},
        "expect": {k: v for k, v in asdict(expect).items() if v is not None},
        "job": asdict(scenario.job),
        "source": scenario.source,
        **({} if completed else {"error_tail": faulted.output[-1500:]}),
    }


def _elastic(scenario: Scenario, reference: RunResult, faulted: RunResult) -> dict:
    """World sizes, scale events and (exact mode) every rank's losses and final state against the
    reference; see the module docstring."""
    from hp.elastic.demo.run import scale_events, world_by_step

    worlds = world_by_step(faulted.events)
    sizes = [worlds[s] for s in sorted(worlds)]
    changes = [{k: _finite(v) for k, v in c.items()} for c in scale_events(faulted.events)]
    out: dict[str, Any] = {
        "world_sizes": [w for i, w in enumerate(sizes) if i == 0 or w != sizes[i - 1]],
        "pause_s": [c["pause_s"] for c in changes],
        "scale_events": changes,
        "exact": scenario.job.elastic.exact,
    }
    if scenario.job.elastic.exact:  # vote slots are micro-batches: the same at every world size
        differ = differing_steps(reference, faulted)
        state = compare_state(_reference_states(reference, faulted), faulted)
        out.update({"losses_equal": not differ, "losses_differ": differ, **state,
                    "bitwise_equal": not differ and state["state_equal"]})
    return out


def _reference_states(reference: RunResult, faulted: RunResult) -> RunResult:
    """The reference's final state for each rank the faulted run ended with: the same rank's, or rank
    0's where the reference (at its fixed size) had no such rank."""
    ref, got = final_states(reference), final_states(faulted)
    if not ref or "0" not in ref or not got:
        return reference
    events = [{"event": Event.FINAL_STATE, "rank": int(r), "digests": ref.get(r, ref["0"])} for r in got]
    return RunResult(reference.returncode, reference.wall_s, events, "")


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and v != v else v  # NaN (no step time at the new size) -> null


def _first_commit(result: RunResult) -> float | None:
    return next((e["t"] for e in result.events if e["event"] == Event.COMMIT and e.get("rank") == 0), None)


_TORCH_LOG = re.compile(r"^\[[WIEF]\d{4} [\d:.]+ \S+\.cpp:\d+\] ")  # torch's C++ (glog) lines


def _where_stuck(run: JobRun) -> str:
    """What a job that ran out of time was doing: each process's last event, where each live process
    was stuck (its main thread's innermost frames, hp.chaos.stacks) and the job's last output lines but
    torch's C++ warnings (an idle store read warns every 2 s); CI keeps the failure message, not the log
    directory."""
    result = run.result
    last: dict[int, dict] = {}
    for e in result.events:
        last[e.get("pid", 0)] = e
    end = result.events[-1]["t"] if result.events else 0.0
    shown = [f"pid {pid}: {e['event']} " + json.dumps({k: v for k, v in e.items() if k not in ("t", "pid", "event")})[:160]
             + f" ({end - e['t']:.1f} s before the last event)" for pid, e in sorted(last.items())]
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    tail = [line for line in lines if not _TORCH_LOG.match(line)][-8:]
    left_out = sum(1 for line in lines if _TORCH_LOG.match(line))
    return "last event of each process:\n    " + "\n    ".join(shown or ["(none)"]) + \
        "\n  where each live process was (main thread, innermost first):\n    " + \
        "\n    ".join(stacks.summary(run.stacks) or ["(none alive)"]) + \
        f"\n  last lines of the job's output ({left_out} lines of torch's C++ warnings left out):\n    " + \
        "\n    ".join(tail or ["(none)"])


def _last_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def write_result(result: dict, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)

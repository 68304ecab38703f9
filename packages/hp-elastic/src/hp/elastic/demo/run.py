"""``hp demo --elastic``: a fixed-size reference, then the same job going 4 → 3 → 4 → 2 → 4, compared bit for bit.

Both are real ``hp run`` jobs on this host (CPU gloo). The elastic one is two agents of two ranks each
(``--nnodes 2:2 --scaling-policy``): node 0 hosts the controller. Its events:

1. **shrink**: rank 3 is killed at step ``kill_step`` (no spare): the job goes on at 3 ranks, replaying
   the step with the same global batch;
2. **grow**: node 1's agent starts a new process in the freed slot; once it is ready the job grows back
   to 4 at a step boundary and the new rank hydrates from a peer;
3. **preemption**: node 1's agent gets SIGTERM once the job has run ``preempt_after`` steps at 4 again:
   its two ranks leave at the next step boundary (4 → 2);
4. **grow**: a new agent for node 1 joins the running job: 2 → 4;
5. **end**: ``finish_after`` steps at 4 later the demo asks the job to end (``hp finish``): every rank ends
   after the same step, agreed in a commit vote, and the job succeeds. ``steps`` only bounds the job: on a
   loaded machine the new agent takes longer and the job runs more steps, never fewer events.

The fixed-size reference runs after it, to the step the job ended after.

What the report says comes from the jobs' event logs: per step the world size, the loss bits and the
commit time. ``pause_s`` of an event = (first commit at the new world size) − (last commit at the old
one) − (the median step time at the new size): the time the event cost beyond a normal step.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from hp.checkpointless.demo.run import RunResult, compare_state, sharded_parts
from hp.checkpointless.events import finished_at, read_events

POLICY = "min_replicas: {min}\nmax_replicas: {max}\nglobal_batch: {global_batch}\nmicro_batch: {micro_batch}\n"


@dataclass
class ElasticDemoConfig:
    steps: int = 150  # the most the job may run: it ends `finish_after` steps at full size after the last grow
    finish_after: int = 5
    kill_step: int = 10
    preempt_after: int = 5  # steps at 4 ranks again before node 1 is preempted
    nproc_per_node: int = 2
    global_batch: int = 32
    micro_batch: int = 4
    model_size: str = "tiny"
    exact: bool = True
    reference: bool = True  # run the fixed-size reference too (the bench compares timings only)
    corpus_mb: int = 16
    seed: int = 0
    log_dir: str | None = None
    timeout_s: float = 600.0
    train_args: list[str] = field(default_factory=list)


class _Job:
    """One ``hp run`` agent of the demo, its output in a file (never a pipe that could fill up)."""

    def __init__(self, argv: list[str], out: str, env: dict) -> None:
        self.out = out
        with open(out, "w") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self, n: int = 15) -> str:
        with open(self.out) as f:
            return "".join(f.readlines()[-n:])


def _env(extra: dict | None = None) -> dict:
    # exact mode needs every micro-batch computed with the same thread count whatever the node's rank count
    return {**os.environ, "OMP_NUM_THREADS": "1", "HP_JOB_TOKEN": os.environ.get("HP_JOB_TOKEN") or os.urandom(16).hex(),
            **(extra or {})}


def train_argv(cfg: ElasticDemoConfig, policy: str) -> list[str]:
    return ["-m", "hp.elastic.demo.train", "--steps", str(cfg.steps), "--policy", policy, "--model-size", cfg.model_size,
            "--seed", str(cfg.seed), "--corpus-mb", str(cfg.corpus_mb), *(["--exact"] if cfg.exact else []),
            *cfg.train_args]


def _agent(log_dir: str, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "hp.core.cli", "run", "--tee", "0", "--monitor-interval", "0.05",
            "--log-dir", log_dir, *flags]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commits(events: list[dict]) -> dict[int, list[dict]]:
    """Step -> its commit events (every rank's)."""
    out: dict[int, list[dict]] = {}
    for e in events:
        if e["event"] == "commit":
            out.setdefault(e["step"], []).append(e)
    return out


def world_by_step(events: list[dict]) -> dict[int, int]:
    return {s: max(e["world"] for e in es) for s, es in commits(events).items()}


class _Elastic:
    """The elastic run's agents and the events it drives, from what the jobs' event logs say."""

    def __init__(self, cfg: ElasticDemoConfig, root: str, policy: str) -> None:
        self.cfg, self.root = cfg, root
        port = _free_port()
        self.endpoint = f"127.0.0.1:{port}"
        self.flags = ["--nnodes", "2:2", "--nproc-per-node", str(cfg.nproc_per_node), "--rdzv-endpoint",
                      f"127.0.0.1:{port}", "--scaling-policy", policy]
        self.env = _env()
        self.train = train_argv(cfg, policy)
        self.dirs = [os.path.join(root, d) for d in ("node0", "node1", "node1-again")]
        kill = [{"kind": "kill", "at_step": cfg.kill_step, "rank": 2 * cfg.nproc_per_node - 1, "phase": "forward"}]
        env = {**self.env, "HP_FAULTS": json.dumps(kill)}
        self.jobs = [_Job(_agent(self.dirs[i], [*self.flags, "--node-rank", str(i)] + self.train),
                          os.path.join(root, f"node{i}.out"), env) for i in range(2)]
        self.marks: dict[str, float] = {}

    def events(self) -> list[dict]:
        return [e for d in self.dirs for e in read_events(os.path.join(d, "events"))]

    def drive(self) -> None:
        cfg, deadline = self.cfg, time.monotonic() + self.cfg.timeout_s
        stage = "grow-back"
        while time.monotonic() < deadline:
            if self.jobs[0].proc.poll() is not None and all(j.proc.poll() is not None for j in self.jobs):
                return
            worlds = world_by_step(self.events())
            steps = sorted(worlds)
            sizes = [worlds[s] for s in steps]
            full = 2 * cfg.nproc_per_node
            if stage == "grow-back" and went_through(sizes, [full, full - 1, full], cfg.preempt_after):
                self.marks["preempt"] = time.time()
                self.jobs[1].proc.send_signal(signal.SIGTERM)  # the agent: what Slurm and Kubernetes signal
                stage = "preempted"
            elif stage == "preempted" and self.jobs[1].proc.poll() is not None and sizes and sizes[-1] < full:
                self.marks["preempted_agent_exited"] = time.time()  # within 0.2 s (this loop's period)
                self.marks["rejoin"] = time.time()
                self.jobs.append(_Job(_agent(self.dirs[2], [*self.flags, "--node-rank", "1"] + self.train),
                                      os.path.join(self.root, "node1-again.out"), self.env))
                stage = "rejoined"
            elif stage == "rejoined" and went_through(sizes, [full, full - 1, full, full - cfg.nproc_per_node, full],
                                                cfg.finish_after):
                self.marks["finish"] = time.time()
                self.finish("the elastic demo saw its four scale events")
                stage = "finishing"
            time.sleep(0.2)
        raise TimeoutError(f"the elastic demo did not finish within {cfg.timeout_s:.0f} s")

    def finish(self, reason: str) -> None:
        """``hp finish``: the job ends after the next step its ranks agree on."""
        from hp.core.control_plane import request_finish

        request_finish(self.endpoint, self.env["HP_JOB_TOKEN"], reason)

    def stop(self) -> None:
        for job in self.jobs:
            job.kill()


def went_through(sizes: list[int], pattern: list[int], extra: int) -> bool:
    """Whether the world sizes by step went through ``pattern`` and ran ``extra`` steps at its last size."""
    runs = [(w, sum(1 for _ in g)) for w, g in itertools.groupby(sizes)]
    return len(runs) >= len(pattern) and [w for w, _ in runs[:len(pattern)]] == pattern and runs[len(pattern) - 1][1] >= extra


def events_went_through(events: list[dict], pattern: list[int], extra: int) -> bool:
    """:func:`went_through` for the world sizes of the steps committed in ``events``."""
    worlds = world_by_step(events)
    return went_through([worlds[s] for s in sorted(worlds)], pattern, extra)


def scale_events(events: list[dict]) -> list[dict]:
    """One entry per change of world size: the steps around it, the pause, and its phases."""
    by_step = commits(events)
    steps = sorted(by_step)
    worlds = world_by_step(events)
    t = {s: max(e["t"] for e in by_step[s]) for s in steps}  # a step is committed when its last rank commits
    out = []
    for before, after in zip(steps, steps[1:]):
        if worlds[before] == worlds[after]:
            continue
        step_s = statistics.median([t[b] - t[a] for a, b in zip(steps, steps[1:])
                                    if worlds[a] == worlds[b] == worlds[after] and b == a + 1] or [float("nan")])
        window = [e for e in events if t[before] <= e["t"] <= t[after]]
        first = lambda name: min((e["t"] - t[before] for e in window if e["event"] == name), default=None)  # noqa: E731
        last = lambda name: max((e["t"] - t[before] for e in window if e["event"] == name), default=None)  # noqa: E731
        marks = {"detect_or_boundary": first("failure_detected") if first("failure_detected") is not None
                 else first("rescaling"), "release": last("released"), "pg_init": last("pg_ready"),
                 "hydrate": last("resumed"), "first_step": t[after] - t[before]}
        phases, reached = {}, 0.0
        for name, mark in marks.items():
            if mark is not None:
                phases[name] = round(max(0.0, mark - reached), 4)
                reached = max(reached, mark)
        out.append({"from": worlds[before], "to": worlds[after], "last_step_before": before, "first_step_after": after,
                    "kind": "shrink" if any(e["event"] == "failure_detected" for e in window)
                    else ("grow" if worlds[after] > worlds[before] else "preempt"),
                    "gap_s": round(t[after] - t[before], 4), "step_s": round(step_s, 4),
                    "pause_s": round(t[after] - t[before] - step_s, 4), "phases": phases})
    return out


def lost_steps(events: list[dict], steps: int) -> int:
    """Steps committed twice by one process (work redone) plus steps nobody committed."""
    seen: dict[tuple[int, int], int] = {}
    for e in events:
        if e["event"] == "commit":
            seen[(e["pid"], e["step"])] = seen.get((e["pid"], e["step"]), 0) + 1
    missing = steps - len({e["step"] for e in events if e["event"] == "commit"})
    return sum(n - 1 for n in seen.values()) + missing


def reference_run(cfg: ElasticDemoConfig, root: str, policy: str, ranks: int | None = None) -> RunResult:
    """The same job at a fixed size of ``ranks`` (default: the demo's full size), all on one node, no fault."""
    return one_node_run(cfg, root, policy, ranks or 2 * cfg.nproc_per_node)


def one_node_run(cfg: ElasticDemoConfig, root: str, policy: str, ranks: int, name: str = "reference",
                 faults: list[dict] | None = None, elastic: bool = False,
                 agent_flags: Sequence[str] = (), finish: tuple[list[int], int] | None = None) -> RunResult:
    """The job started with ``ranks`` ranks on one node, with the injected ``faults``, its logs in
    ``root/name``; ``elastic``: ``hp run --scaling-policy`` (the policy decides where its size goes);
    ``agent_flags``: more ``hp run`` options; ``finish`` (world sizes, steps): the job is asked to end
    (``hp finish``) once its world sizes by step went through them and ran that many steps at the last
    (``cfg.steps`` is then the most it may run)."""
    ref_dir = os.path.join(root, name)
    os.makedirs(root, exist_ok=True)
    start = time.monotonic()
    endpoint = f"127.0.0.1:{_free_port()}" if finish else None
    flags = ["--nproc-per-node", str(ranks), *(["--scaling-policy", policy] if elastic else []),
             *(["--rdzv-endpoint", endpoint] if endpoint else []), *agent_flags]
    env = _env({"HP_FAULTS": json.dumps(faults)} if faults else None)
    job = _Job(_agent(ref_dir, flags) + train_argv(cfg, policy), os.path.join(root, f"{name}.out"), env)
    try:
        deadline = time.monotonic() + cfg.timeout_s
        while finish and job.proc.poll() is None and time.monotonic() < deadline:
            if events_went_through(read_events(os.path.join(ref_dir, "events")), *finish):
                from hp.core.control_plane import request_finish

                request_finish(endpoint, env["HP_JOB_TOKEN"], f"{finish[1]} steps at the last of {finish[0]}")
                break
            time.sleep(0.2)
        job.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        job.kill()
    return RunResult(job.proc.returncode, time.monotonic() - start, read_events(os.path.join(ref_dir, "events")), job.tail())


def run_elastic_demo(cfg: ElasticDemoConfig) -> dict:
    root = cfg.log_dir or tempfile.mkdtemp(prefix="hp_elastic_demo_")
    os.makedirs(root, exist_ok=True)
    policy = os.path.join(root, "policy.yaml")
    with open(policy, "w") as f:
        f.write(POLICY.format(min=cfg.nproc_per_node, max=2 * cfg.nproc_per_node, global_batch=cfg.global_batch,
                              micro_batch=cfg.micro_batch))
    run = _Elastic(cfg, root, policy)
    start = time.monotonic()
    try:
        run.drive()
    finally:
        run.stop()
    events = sorted(run.events(), key=lambda e: e["t"])
    elastic = RunResult(max(abs(j.proc.returncode or 0) for j in run.jobs), time.monotonic() - start, events,
                        "".join(j.tail() for j in run.jobs))
    # the step every rank ended after (hp finish, agreed in a commit vote), or the last one
    ended = finished_at(events)
    last = ended if ended is not None else max((e["step"] for e in events if e["event"] == "commit"), default=-1)
    steps = last + 1
    reference = (reference_run(replace(cfg, steps=steps), root, policy) if cfg.reference
                 else RunResult(0, 0.0, [], ""))
    ref_losses = {s: {e["loss"] for e in es} for s, es in commits(reference.events).items()}
    got_losses = {s: {e["loss"] for e in es} for s, es in commits(events).items()}
    worlds = world_by_step(events)
    sequence = [w for i, w in enumerate(worlds[s] for s in sorted(worlds)) if i == 0 or w != worlds[sorted(worlds)[i - 1]]]
    state = compare_state(reference, elastic, nproc=2 * cfg.nproc_per_node, sharded=sharded_parts(cfg.train_args))
    loss_equal = ref_losses == got_losses and all(len(v) == 1 for v in got_losses.values())
    changes = scale_events(events)
    regrown = [c for c in changes if c["kind"] == "grow" and "rejoin" in run.marks
               and min(e["t"] for e in commits(events)[c["first_step_after"]]) > run.marks["rejoin"]]
    completed = reference.returncode == 0 and elastic.returncode == 0 and len(got_losses) == steps
    if not cfg.reference:  # nothing to compare with
        loss_equal, state = False, {"state_equal": False, "state_parts": [], "state_differences": ["no reference run"]}
    result = {
        "completed": completed, "exact": cfg.exact, "steps": steps, "max_steps": cfg.steps,
        # every rank ended after the same step, agreed in a commit vote (hp finish); False: it ran to max_steps
        "finished_at": ended if "finish" in run.marks else None,
        "bitwise_equal": loss_equal and state["state_equal"], "losses_equal": loss_equal,
        **state, "lost_steps": lost_steps(events, steps), "world_sizes": sequence,
        "pause_s": [c["pause_s"] for c in changes], "events": changes,
        "step_s": {str(w): c["step_s"] for c in changes for w in [c["to"]]},
        # SIGTERM to the preempted node's agent -> that agent exited (its ranks left at a step boundary)
        "preempt_exit_s": _span(run.marks, "preempt", "preempted_agent_exited"),
        # a new node's agent started -> the job's first commit with its ranks (imports, start, hydration)
        "capacity_used_s": round(max(e["t"] for e in commits(events)[regrown[0]["first_step_after"]]) - run.marks["rejoin"], 3)
        if regrown else None,
        "reference_wall_s": round(reference.wall_s, 2), "elastic_wall_s": round(elastic.wall_s, 2),
        "log_dir": root,
    }
    if not completed:
        result["error_tail"] = (reference.output if reference.returncode else elastic.output)[-3000:]
    result["png"] = _plot(events, changes, os.path.join(root, "elastic_demo.png"), cfg.global_batch)
    return result


def _span(marks: dict[str, float], start: str, end: str) -> float | None:
    return round(marks[end] - marks[start], 3) if start in marks and end in marks else None


def _plot(events: list[dict], changes: list[dict], path: str, global_batch: int) -> str | None:
    """World size, samples/s and loss per step, with the scale events marked (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    by_step = commits(events)
    steps = sorted(by_step)
    t = {s: max(e["t"] for e in by_step[s]) for s in steps}
    worlds = world_by_step(events)
    rate = [global_batch / (t[b] - t[a]) if t[b] > t[a] else float("nan") for a, b in zip(steps, steps[1:])]
    loss = [float.fromhex(by_step[s][0]["loss"]) for s in steps]
    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(8, 7))
    axes[0].step(steps, [worlds[s] for s in steps], where="post")
    axes[0].set_ylabel("world size")
    axes[1].plot(steps[1:], rate)
    axes[1].set_ylabel("samples/s")
    axes[2].plot(steps, loss)
    axes[2].set_ylabel("loss")
    axes[2].set_xlabel("step")
    for c in changes:
        for ax in axes:
            ax.axvline(c["first_step_after"], color="red" if c["kind"] == "shrink" else "gray", ls="--", lw=0.8)
        axes[0].annotate(f"{c['kind']} {c['pause_s']:.2f} s", (c["first_step_after"], c["to"]), fontsize=7)
    fig.suptitle("hp elastic: world size follows capacity, global batch constant")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def format_table(result: dict) -> str:
    lines = [f"hp demo --elastic: world sizes {' -> '.join(map(str, result['world_sizes']))}, "
             f"{result['steps']} steps, exact mode {'on' if result['exact'] else 'off'}",
             f"{'event':8} {'from':>4} {'to':>3} {'step':>5} {'pause s':>8}  phases (s)"]
    for c in result["events"]:
        phases = ", ".join(f"{k} {v:.3f}" for k, v in c["phases"].items())
        lines.append(f"{c['kind']:8} {c['from']:>4} {c['to']:>3} {c['first_step_after']:>5} {c['pause_s']:>8.3f}  {phases}")
    lines.append(f"lost steps: {result['lost_steps']}; losses bit-identical to the fixed-size reference: "
                 f"{result['losses_equal']}; final weights and optimizer state of every rank: {result['state_equal']}")
    if result.get("png"):
        lines.append(f"plot: {result['png']}")
    return "\n".join(lines)

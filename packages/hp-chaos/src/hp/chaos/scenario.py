"""Scenario files: a job, the faults to inject into it, and what must hold afterwards.

```yaml
name: kill-rank-in-allreduce
job: {nodes: 1, nproc_per_node: 4, spares: 1, steps: 20, model: tiny, seed: 0}
faults:
  - {at_step: 12, phase: allreduce, kind: kill, target: "rank:1"}
  - {at_step: 16, kind: hang, target: "rank:2", duration_s: 1.0}
expect: {completes: true, bitwise_equal: true, lost_steps: 0, max_recovery_s: 2.0}
```

Every key is checked; a malformed file raises :class:`ScenarioError` whose ``key`` names the
offending key (``job.steps``, ``faults[1].duration_s``, ...). Fault parameters are validated by
the fault kind itself (plugin family ``fault``).

An elastic job (a scaling policy; :class:`ElasticSpec`) runs :mod:`hp.elastic.demo.train` under
``hp run --nnodes NODES:MAX_NODES --scaling-policy``; its world size follows kills, preemptions and
joining nodes, and ``expect`` can say how (``world_sizes``, ``max_pause_s``)::

```yaml
name: elastic-shrink-on-kill
job: {nodes: 2, nproc_per_node: 1, spares: 0, steps: 40,
      elastic: {min_replicas: 1, max_replicas: 2, global_batch: 8, micro_batch: 2, exact: true}}
faults:
  - {at_step: 4, kind: kill, target: "rank:1"}
expect: {completes: true, bitwise_equal: true, world_sizes: [2, 1, 2], max_pause_s: 30}
```

With ``job.store: etcd`` (default ``tcp``) the runner starts a private etcd (:class:`JobSpec`) and
every agent is a controller candidate: a ``controller`` target is the agent of the node leading the
job when the fault fires, a ``store`` fault pauses the etcd, and ``expect.max_failover_s`` bounds
each controller fault's failover (the fault -> the next ``controller_elected`` decision)::

```yaml
name: controller-killed-etcd
job: {nodes: 2, nproc_per_node: 1, spares: 1, steps: 12, store: etcd, heartbeat_timeout_s: 6.0}
faults:
  - {at_step: 6, kind: kill, target: controller}
expect: {completes: true, bitwise_equal: true, lost_steps: 0, max_failover_s: 30}
```
"""

from __future__ import annotations

import math
import os
from dataclasses import astuple, dataclass, fields, replace
from typing import Any

import yaml

from hp.core.config import NAME_RE

from hp.chaos.faults.base import FaultSpec, JobShape, ScenarioError


@dataclass(frozen=True)
class CheckpointSpec:
    """``job.checkpoint``: the job checkpoints through hp-tiered-ckpt (``--checkpoint``): into a node
    daemon's memory every ``every`` steps and to S3 every ``persist_every`` steps. The runner starts
    a SeaweedFS S3 endpoint and an ``hp ckpt daemon`` for each run (reference and faulted alike)."""

    every: int = 2
    persist_every: int = 2


@dataclass(frozen=True)
class ElasticSpec:
    """``job.elastic``: the job runs :mod:`hp.elastic.demo.train` (a constant global batch of
    ``global_batch // micro_batch`` micro-batches per step at any world size) under ``hp run
    --nnodes NODES:MAX_NODES --scaling-policy`` with a policy of these values; ``exact``: exact
    mode (``--exact``), bit-identical at every world size. Node ranks up to ``max_nodes`` (default:
    ``job.nodes``) may join while it runs (``join`` faults)."""

    min_replicas: int = 1
    max_replicas: int = 2
    global_batch: int = 8
    micro_batch: int = 2
    exact: bool = True
    max_nodes: int | None = None


@dataclass(frozen=True)
class JobSpec:
    """The job under test: ``hp run`` of the demo GPT (:mod:`hp.checkpointless.demo.train`), or with
    ``elastic`` its elastic variant (:mod:`hp.elastic.demo.train`)."""

    nodes: int = 1
    nproc_per_node: int = 4
    spares: int = 1  # hot spares per node
    steps: int = 20
    model: str = "tiny"  # demo model size: tiny | small | 25m
    seed: int = 0
    hang_timeout_s: float = 10.0  # agent's heartbeat silence before a rank counts as hung
    max_restarts: int = 0  # process restarts per rank when no spare is left
    heartbeat_timeout_s: float = 30.0  # controller: a node silent this long is lost (hp run's default)
    controller: str = "agent"  # agent: hosted by node 0's agent | standalone: its own `hp controller` process
    # tcp: the store is hosted with the controller | etcd: the runner starts a private etcd, every agent
    # gets `--store etcd --rdzv-endpoint ETCD --run-id ID` and the agents elect the controller among them
    store: str = "tcp"
    replenish_spares: bool = False  # agents start a new spare when one is promoted (hp run --replenish-spares)
    corpus_mb: int = 2
    timeout_s: float = 240.0  # a hang guard per job, not a measurement
    checkpoint: CheckpointSpec | None = None  # a mapping in the file; see CheckpointSpec
    elastic: ElasticSpec | None = None  # a mapping in the file; see ElasticSpec
    # the runner ends the job (hp finish) this many steps at its last size after every fault fired and the run
    # went through expect.world_sizes; `steps` is then the most it may run, and the reference runs to its end
    finish_after: int | None = None

    @property
    def max_nodes(self) -> int:
        """Node ranks the job may ever have (elastic: up to ``elastic.max_nodes``)."""
        return max(self.nodes, (self.elastic.max_nodes or 0) if self.elastic else 0)

    @property
    def shape(self) -> JobShape:
        return JobShape(self.nodes, self.nproc_per_node, self.spares, self.steps, self.elastic is not None,
                        self.max_nodes, self.controller, self.store)

    def reference_key(self) -> tuple:
        """What the fault-free losses depend on (not spares, timeouts, restarts or the store)."""
        ckpt = astuple(self.checkpoint) if self.checkpoint else None  # a restore could change the losses
        elastic = astuple(self.elastic) if self.elastic else None
        key = (self.nodes, self.nproc_per_node, self.steps, self.model, self.seed, self.corpus_mb, ckpt)
        return key + (elastic,) if elastic else key  # (unchanged for a fixed-size job: cached references stay valid)


@dataclass(frozen=True)
class Expect:
    """Expectations; ``None`` = not checked. ``lost_steps`` and ``recoveries`` are maxima."""

    completes: bool = True
    bitwise_equal: bool | None = None
    lost_steps: int | None = None
    max_recovery_s: float | None = None  # every fault's fault -> next commit
    min_goodput: float | None = None
    recoveries: int | None = None  # new generations after a failure (0: the fault was absorbed)
    error_contains: str | None = None  # in the faulted job's output (for completes: false)
    persisted_step: int | None = None  # after the job: S3 holds a complete, verified checkpoint of it
    world_sizes: list[int] | None = None  # elastic: the distinct consecutive world sizes by step, e.g. [2, 1, 2]
    max_pause_s: float | None = None  # elastic: every scale event's pause (hp.elastic.demo.run.scale_events)
    max_failover_s: float | None = None  # job.store etcd: every controller fault -> the next controller_elected


@dataclass(frozen=True)
class Scenario:
    name: str
    job: JobSpec
    faults: list[FaultSpec]
    expect: Expect
    description: str = ""
    source: str | None = None


_MINIMUM = {"nodes": 1, "nproc_per_node": 1, "spares": 0, "steps": 2, "finish_after": 1, "seed": 0, "max_restarts": 0, "corpus_mb": 1,
            "hang_timeout_s": 0.1, "timeout_s": 1.0, "heartbeat_timeout_s": 2.5,
            "every": 1, "persist_every": 1, "persisted_step": 0,
            "min_replicas": 1, "max_replicas": 1, "global_batch": 1, "micro_batch": 1, "max_nodes": 1}
# a scenario drives real processes on one machine: sizes past these are typos, not tests
_MAXIMUM = {"nodes": 16, "nproc_per_node": 64, "spares": 16, "max_nodes": 16, "steps": 1_000_000, "corpus_mb": 4096,
            "max_replicas": 1024, "max_restarts": 100}
STORES = ("tcp", "etcd")  # job.store: what the runner can start (hp.chaos.launch)
_SCALARS = {"bool": bool, "int": int, "float": float, "str": str}


def _typed(cls: type, raw: Any, key: str) -> Any:
    """Build dataclass ``cls`` from mapping ``raw``: unknown keys, wrong types and values out of
    range are errors naming the key."""
    if not isinstance(raw, dict):
        raise ScenarioError(key, f"must be a mapping, got {type(raw).__name__}")
    types = {f.name: f.type for f in fields(cls)}
    out = {}
    for k, v in raw.items():
        if k not in types:
            raise ScenarioError(f"{key}.{k}", f"unknown key; keys: {sorted(types)}")
        if v is None and str(types[k]).endswith("| None"):
            out[k] = v
            continue
        if str(types[k]).startswith("list[int]"):
            if not isinstance(v, list) or not v or any(type(x) is not int or x < 1 for x in v):
                raise ScenarioError(f"{key}.{k}", f"must be a non-empty list of positive integers, got {v!r}")
            out[k] = v
            continue
        want = _SCALARS[str(types[k]).split(" | ")[0]]
        if want is float and type(v) is int:
            v = float(v)
        if type(v) is not want:
            raise ScenarioError(f"{key}.{k}", f"must be {want.__name__}, got {v!r}")
        if want is float and not math.isfinite(v):
            raise ScenarioError(f"{key}.{k}", f"must be a finite number, got {v!r}")
        if want in (int, float) and v < _MINIMUM.get(k, 0):
            raise ScenarioError(f"{key}.{k}", f"must be >= {_MINIMUM.get(k, 0)}, got {v!r}")
        if k in _MAXIMUM and v > _MAXIMUM[k]:
            raise ScenarioError(f"{key}.{k}", f"must be <= {_MAXIMUM[k]}, got {v!r}")
        out[k] = v
    return cls(**out)


def parse_scenario(raw: Any, source: str | None = None) -> Scenario:
    from hp.chaos.faults import fault_kinds

    if not isinstance(raw, dict):
        raise ScenarioError("(top level)", f"a scenario is a mapping with name, job, faults, expect; "
                                           f"got {type(raw).__name__}")
    for k in raw:
        if k not in ("name", "description", "job", "faults", "expect"):
            raise ScenarioError(k, "unknown key; keys: description, expect, faults, job, name")
    name = raw.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name in (".", ".."):  # it names log directories
        raise ScenarioError("name", f"must be 1-128 of [A-Za-z0-9_.-] and not '.' or '..', got {name!r}")
    raw_job = raw.get("job", {})
    raw_ckpt = raw_elastic = None
    if isinstance(raw_job, dict):  # mappings of their own, validated as such; the caller's dict is left alone
        raw_job = dict(raw_job)
        raw_ckpt = raw_job.pop("checkpoint", None)
        raw_elastic = raw_job.pop("elastic", None)
    job = _typed(JobSpec, raw_job, "job")
    if raw_ckpt is not None:
        job = replace(job, checkpoint=_typed(CheckpointSpec, raw_ckpt, "job.checkpoint"))
    if raw_elastic is not None:
        job = replace(job, elastic=_elastic(_typed(ElasticSpec, raw_elastic, "job.elastic"), job))
    from hp.checkpointless.demo.sizes import MODEL_SIZES

    if job.controller not in ("agent", "standalone"):
        raise ScenarioError("job.controller", f"must be 'agent' or 'standalone', got {job.controller!r}")
    if job.store not in STORES:
        raise ScenarioError("job.store", f"must be one of {list(STORES)}, got {job.store!r}")
    if job.store == "etcd" and job.controller == "standalone":
        raise ScenarioError("job.store", "etcd elects the controller among the agents (every agent is a "
                                         "candidate): it cannot be combined with job.controller: standalone")
    if job.model not in MODEL_SIZES:
        raise ScenarioError("job.model", f"must be one of {sorted(MODEL_SIZES)}, got {job.model!r}")
    raw_faults = raw.get("faults")
    if not isinstance(raw_faults, list) or not raw_faults:
        raise ScenarioError("faults", "must be a non-empty list of faults")
    kinds = fault_kinds()
    specs = []
    for i, f in enumerate(raw_faults):
        key = f"faults[{i}]"
        if not isinstance(f, dict):
            raise ScenarioError(key, f"must be a mapping, got {f!r}")
        if f.get("kind") not in kinds:
            raise ScenarioError(f"{key}.kind", f"unknown fault kind {f.get('kind')!r}; kinds: {sorted(kinds)}")
        specs.append(kinds[f["kind"]].validate(f, key, i, job.shape))
    expect = _typed(Expect, raw.get("expect", {}), "expect")
    if expect.max_recovery_s is not None and expect.max_recovery_s <= 0:
        raise ScenarioError("expect.max_recovery_s", f"must be > 0, got {expect.max_recovery_s}")
    if expect.lost_steps is not None and expect.lost_steps < 0:
        raise ScenarioError("expect.lost_steps", f"must be >= 0, got {expect.lost_steps}")
    if expect.min_goodput is not None and not 0 < expect.min_goodput <= 1:
        raise ScenarioError("expect.min_goodput", f"must be in (0, 1], got {expect.min_goodput}")
    if expect.persisted_step is not None:
        ckpt = job.checkpoint
        if ckpt is None:
            raise ScenarioError("expect.persisted_step", "needs job.checkpoint (a job that persists to S3)")
        if expect.persisted_step >= job.steps or expect.persisted_step % ckpt.persist_every:
            raise ScenarioError("expect.persisted_step", f"must be a step the job persists (a multiple of "
                                f"job.checkpoint.persist_every={ckpt.persist_every} below job.steps={job.steps}), "
                                f"got {expect.persisted_step}")
    _check_elastic_expect(expect, job)
    if job.finish_after is not None and (expect.world_sizes is None or job.store != "tcp"):
        raise ScenarioError("job.finish_after", "needs expect.world_sizes (the run's events, after which it "
                                                    "ends) and the tcp store (hp finish goes to the controller)")
    _check_failover_expect(expect, job, specs)
    _check_joins(specs, job)
    if job.checkpoint is None:
        for spec in specs:
            if spec.target.kind == "storage":
                raise ScenarioError(f"faults[{spec.index}]", "a storage fault needs job.checkpoint "
                                    "(a job that persists checkpoints to the S3 endpoint the fault freezes)")
    description = raw.get("description", "")
    if not isinstance(description, str):
        raise ScenarioError("description", "must be a string")
    return Scenario(name.strip(), job, specs, expect, description.strip(), source)


def _elastic(e: ElasticSpec, job: JobSpec) -> ElasticSpec:
    """Cross-checks of ``job.elastic`` (the policy hp-elastic would refuse, and the job's shape)."""
    if e.max_replicas < e.min_replicas:
        raise ScenarioError("job.elastic.max_replicas", f"must be >= min_replicas={e.min_replicas}, "
                                                        f"got {e.max_replicas}")
    if e.global_batch % e.micro_batch:
        raise ScenarioError("job.elastic.global_batch", f"must be a multiple of micro_batch={e.micro_batch}, "
                                                        f"got {e.global_batch}")
    world = job.nodes * job.nproc_per_node
    if not e.min_replicas <= world <= e.max_replicas:
        raise ScenarioError(f"job.elastic.{'min_replicas' if world < e.min_replicas else 'max_replicas'}",
                            f"the job starts with {world} ranks (nodes x nproc_per_node): must be within "
                            f"[min_replicas, max_replicas] = [{e.min_replicas}, {e.max_replicas}]")
    if e.max_nodes is not None and e.max_nodes < job.nodes:
        raise ScenarioError("job.elastic.max_nodes", f"must be >= job.nodes={job.nodes}, got {e.max_nodes}")
    if job.checkpoint is not None:
        raise ScenarioError("job.elastic", "cannot be combined with job.checkpoint (the elastic demo job "
                                           "does not checkpoint)")
    return e


def _check_elastic_expect(expect: Expect, job: JobSpec) -> None:
    for name in ("world_sizes", "max_pause_s"):
        if getattr(expect, name) is not None and job.elastic is None:
            raise ScenarioError(f"expect.{name}", "needs an elastic job (job.elastic)")
    if expect.max_pause_s is not None and expect.max_pause_s <= 0:
        raise ScenarioError("expect.max_pause_s", f"must be > 0, got {expect.max_pause_s}")
    if expect.world_sizes is not None:
        e, sizes = job.elastic, expect.world_sizes
        world = job.nodes * job.nproc_per_node
        if sizes[0] != world:
            raise ScenarioError("expect.world_sizes", f"must start with the job's world size {world} "
                                                      f"(nodes x nproc_per_node), got {sizes}")
        if any(a == b for a, b in zip(sizes, sizes[1:])):
            raise ScenarioError("expect.world_sizes", f"lists each change of size: no size twice in a row, got {sizes}")
        bad = [w for w in sizes if not e.min_replicas <= w <= e.max_replicas]
        if bad:
            raise ScenarioError("expect.world_sizes", f"{bad} outside the policy's [min_replicas, max_replicas] = "
                                                      f"[{e.min_replicas}, {e.max_replicas}]")


def _check_failover_expect(expect: Expect, job: JobSpec, specs: list[FaultSpec]) -> None:
    if expect.max_failover_s is None:
        return
    if expect.max_failover_s <= 0:
        raise ScenarioError("expect.max_failover_s", f"must be > 0, got {expect.max_failover_s}")
    if job.store != "etcd":
        raise ScenarioError("expect.max_failover_s", "needs job.store: etcd (a controller the agents elect; "
                                                     f"with {job.store!r} nothing takes over)")
    if not any(s.target.kind == "controller" for s in specs):
        raise ScenarioError("expect.max_failover_s", "needs a fault on target controller (a failover is timed "
                                                     "from such a fault to the next controller_elected decision)")


def _check_joins(specs: list[FaultSpec], job: JobSpec) -> None:
    """A node can only join when it is not in the job: it never was, or an earlier fault took it out."""
    gone = set(range(job.nodes, job.max_nodes))
    for spec in sorted(specs, key=lambda s: (s.at_step, s.index)):
        node = spec.target.index
        if spec.kind in ("preempt", "node"):
            gone.add(node)
        elif spec.kind == "join":
            if node not in gone:
                raise ScenarioError(f"faults[{spec.index}].target", f"node {node} is in the job when it joins: "
                                    "a join needs a node that has not joined yet (below job.elastic.max_nodes) "
                                    "or one a preempt or node fault took out at an earlier step")
            gone.discard(node)


def load_scenario(path: str | os.PathLike) -> Scenario:
    """Read and validate a scenario file (YAML, or JSON which is YAML too)."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ScenarioError("(file)", f"{e.strerror}: {path}") from None
    except yaml.YAMLError as e:
        raise ScenarioError("(file)", f"not valid YAML: {str(e).splitlines()[0]}") from None
    except UnicodeDecodeError as e:
        raise ScenarioError("(file)", f"not UTF-8 text (byte {e.start}): {path}") from None
    return parse_scenario(raw, source=path)

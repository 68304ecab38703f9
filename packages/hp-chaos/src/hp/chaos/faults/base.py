"""What every fault kind is made of: targets, parameters, and how it gets into a running job.

A fault in a scenario file is ``{kind, at_step, target, phase?, at_event?, ...parameters}``. Its
kind (a plugin of family ``fault``) validates it into a :class:`FaultSpec` and turns that into an
:class:`Injection`: entries for the in-process plan (``HP_FAULTS``, read by
:mod:`hp.checkpointless.faults`, exact to the step and phase) and :class:`Action` objects the
runner performs from outside (a signal to a spare or an agent, an iptables rule, a new agent), for
what a training process cannot do to itself.

``at_event`` (kinds with ``event_trigger``): the runner fires the fault from outside the first time
a process of the job records that event (a name of :class:`hp.core.protocol.Event`: ``rescaling``,
``assigned``, ``pg_ready``, ``hydrated``, ...) after rank 0 committed step ``at_step - 1``. It is
how a fault lands inside something whose step nobody knows in advance: a grow happens when the
joiners are ready, so "SIGKILL rank 1 while the job re-forms to grow" is
``{kind: kill, target: "rank:1", at_step: 3, at_event: rescaling}``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hp.core.protocol import Event

PHASES = ("forward", "backward", "allreduce", "commit", "optimizer", "hydration")
TARGET_KINDS = ("rank", "node", "spare", "controller", "storage", "store")
_INDEXED = ("rank", "node", "spare")


class ScenarioError(ValueError):
    """A malformed scenario. ``key`` names where, e.g. ``faults[1].duration_s``."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass(frozen=True)
class Target:
    """``rank:N``, ``node:N``, ``spare:N`` (N-th hot spare of the job, node-major), ``controller``
    (the process hosting the job controller: node 0's agent, a standalone ``hp controller``, or with
    ``job.store: etcd`` the agent of the node leading the job now), ``storage`` (the job's S3
    endpoint), ``store`` (the job's etcd, with ``job.store: etcd``)."""

    kind: str
    index: int | None = None

    @classmethod
    def parse(cls, text: Any, key: str) -> Target:
        if not isinstance(text, str):
            raise ScenarioError(key, f"must be a string like 'rank:1', got {text!r}")
        kind, _, index = text.partition(":")
        if kind not in TARGET_KINDS:
            raise ScenarioError(key, f"unknown target {text!r}; forms: rank:N, node:N, spare:N, controller, storage, "
                                     "store")
        if kind in _INDEXED:
            if not index.isdigit():
                raise ScenarioError(key, f"{kind} targets need a number: '{kind}:N', got {text!r}")
            return cls(kind, int(index))
        if index:
            raise ScenarioError(key, f"'{kind}' takes no index, got {text!r}")
        return cls(kind)

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


@dataclass(frozen=True)
class JobShape:
    """The part of a scenario's job a fault checks its target against."""

    nodes: int
    nproc_per_node: int
    spares: int  # per node
    steps: int
    elastic: bool = False  # the job has a scaling policy (job.elastic)
    max_nodes: int = 0  # elastic: node ranks below this may join later (0: nodes)
    controller: str = "agent"  # agent: node 0's agent hosts it | standalone
    store: str = "tcp"  # tcp: hosted by the controller | etcd: a private etcd; the agents elect the controller

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def all_nodes(self) -> int:
        """Node ranks a fault may name: the job's, and those that may join it later."""
        return max(self.nodes, self.max_nodes)


@dataclass(frozen=True)
class Param:
    """One kind-specific parameter: its type, a default (``None``: required unless ``optional``)
    and a check that returns an error message or ``None``."""

    type: type
    default: Any = None
    optional: bool = False
    check: Callable[[Any], str | None] | None = None


def positive(v: float) -> str | None:
    return None if v > 0 and math.isfinite(v) else f"must be > 0, got {v!r}"


@dataclass(frozen=True)
class FaultSpec:
    index: int  # position in the scenario's fault list
    kind: str
    at_step: int
    target: Target
    phase: str | None
    params: dict[str, Any] = field(default_factory=dict)
    at_event: str | None = None  # fired by the runner on this event (after step at_step - 1 committed)

    def label(self) -> str:
        if self.at_event:
            return f"{self.kind} of {self.target} on {self.at_event} from step {self.at_step}"
        phase = f" ({self.phase})" if self.phase else ""
        return f"{self.kind} of {self.target} at step {self.at_step}{phase}"

    def injected_by(self, event: dict) -> bool:
        """Whether ``event`` (a ``fault_injected``) is this fault's: the runner's record of an action it
        performed names the fault; a rank's own records its kind, rank, step and phase."""
        if "fault" in event:
            return event["fault"] == self.index
        return (self.target.kind == "rank" and event.get("kind") == self.kind and event.get("rank") == self.target.index
                and event.get("step") == self.at_step and event.get("phase") == self.phase)


class LiveJob(Protocol):
    """What the runner shows an action while the faulted job runs."""

    def committed(self) -> int: ...  # newest step rank 0 committed (-1 before the first)

    def events(self) -> list[dict]: ...  # every event recorded so far, oldest first

    def spare_pid(self, spare: int) -> int | None: ...

    def controller_pid(self) -> int | None: ...

    def rank_pid(self, rank: int) -> int | None: ...  # the process holding the rank now (from its events)

    def agent_pid(self, node: int) -> int | None: ...  # node's newest agent, while it runs

    def start_agent(self, node: int, name: str) -> int: ...  # a new agent for node (joins the running job)

    def record(self, event: str, **fields: Any) -> None: ...  # into the job's event log

    def finish(self, reason: str) -> None: ...  # hp finish: every rank ends after the next step they agree on

    @property
    def storage(self) -> Any: ...  # the job's storage server (pid, port) or None

    @property
    def etcd(self) -> Any: ...  # the job's hp.core.etcd_store.EtcdServer (job.store: etcd) or None

    @property
    def topology(self) -> Any: ...  # hp.chaos.topology.Topology for nodes > 1, else None


class Action:
    """Something the runner does from outside the job. ``ready`` is polled (every ~20 ms) until
    true, then ``fire`` runs once; the callable it returns (if any) undoes the fault, and runs
    ``duration_s`` later or when the run ends, whichever is first."""

    duration_s: float | None = None

    def ready(self, job: LiveJob) -> bool:
        raise NotImplementedError

    def fire(self, job: LiveJob) -> Callable[[], None] | None:
        raise NotImplementedError


class AtStep(Action):
    """Fires once rank 0 has committed ``at_step - 1``, i.e. while step ``at_step`` runs; with the
    spec's ``at_event``, at the first such event recorded after that commit."""

    def __init__(self, spec: FaultSpec) -> None:
        self.spec = spec
        self.duration_s = spec.params.get("duration_s")
        self._armed_t: float | None = None  # when rank 0 committed at_step - 1

    def ready(self, job: LiveJob) -> bool:
        if job.committed() < self.spec.at_step - 1:
            return False
        if self.spec.at_event is None:
            return True
        events = job.events()
        if self._armed_t is None:
            self._armed_t = next((e["t"] for e in events if e["event"] == Event.COMMIT and e.get("rank") == 0
                                  and e["step"] == self.spec.at_step - 1), float("-inf"))
        # every event, each look: they come from one file per process, merged by time, so one a process
        # flushed late sorts before events already seen (a count of those seen skipped it: the
        # controller-killed-etcd-during-reform scenario once never fired its kill)
        return any(e["event"] == self.spec.at_event and e["t"] >= self._armed_t and "fault" not in e for e in events)

    def record(self, job: LiveJob, **fields: Any) -> None:
        # the same event an in-process fault records, so hp's recovery timeline covers both
        job.record(Event.FAULT_INJECTED, kind=self.spec.kind, phase=None, step=self.spec.at_step, rank=None,
                   target=str(self.spec.target), fault=self.spec.index, **fields)


@dataclass
class Injection:
    hp_faults: list[dict] = field(default_factory=list)  # in-process plan entries (HP_FAULTS)
    actions: list[Action] = field(default_factory=list)  # done by the runner from outside


class FaultKind:
    """Base of every fault plugin. Subclasses set ``name``, ``targets`` (target kinds accepted),
    ``phased`` (whether ``phase`` applies: in-process faults on ``rank`` targets), ``params`` and
    implement :meth:`inject`. The class docstring is the kind's documentation (``hp chaos faults``)."""

    name: str = ""
    targets: tuple[str, ...] = ()
    phased: bool = False
    min_nodes: int = 1
    event_trigger: bool = False  # the runner can fire it on an event (``at_event``)
    elastic_only: bool = False  # only for a job with a scaling policy (``job.elastic``)
    params: dict[str, Param] = {}

    @property
    def summary(self) -> str:
        return (self.__doc__ or "").strip().splitlines()[0]

    def validate(self, raw: dict, key: str, index: int, job: JobShape) -> FaultSpec:
        """Check one raw fault mapping; :class:`ScenarioError` names the offending key."""
        known = {"kind", "at_step", "target", "phase", "at_event", *self.params}
        for k in raw:
            if k not in known:
                raise ScenarioError(f"{key}.{k}", f"unknown key for a {self.name} fault; keys: {sorted(known)}")
        at_step = raw.get("at_step")
        if type(at_step) is not int or not 0 <= at_step < job.steps:
            raise ScenarioError(f"{key}.at_step", f"must be an integer in [0, job.steps={job.steps}), got {at_step!r}")
        if "target" not in raw:
            raise ScenarioError(f"{key}.target", "missing")
        target = Target.parse(raw["target"], f"{key}.target")
        if target.kind not in self.targets:
            raise ScenarioError(f"{key}.target", f"a {self.name} fault targets {' or '.join(self.targets)}, "
                                                 f"got {str(target)!r}")
        if job.all_nodes < self.min_nodes:
            raise ScenarioError(f"{key}.kind", f"a {self.name} fault needs job.nodes (or, elastic, "
                                               f"job.elastic.max_nodes) >= {self.min_nodes}, got {job.all_nodes}")
        if self.elastic_only and not job.elastic:
            raise ScenarioError(f"{key}.kind", f"a {self.name} fault needs an elastic job (job.elastic)")
        self._check_target(target, f"{key}.target", job)
        at_event = raw.get("at_event")
        if at_event is not None:
            if not self.event_trigger:
                raise ScenarioError(f"{key}.at_event", f"a {self.name} fault cannot be fired on an event")
            events = sorted(e.value for e in Event)
            if not isinstance(at_event, str) or at_event not in events:
                raise ScenarioError(f"{key}.at_event", f"must be an event name, one of {events}, got {at_event!r}")
            if "phase" in raw:
                raise ScenarioError(f"{key}.phase", "a fault fired on an event (at_event) takes no phase")
        phase = raw.get("phase")
        if phase is not None:
            if not (self.phased and target.kind == "rank"):
                raise ScenarioError(f"{key}.phase", f"a {self.name} fault on {target.kind} fires at a step, "
                                                    "not at a phase: leave phase out")
            if phase not in PHASES:
                raise ScenarioError(f"{key}.phase", f"must be one of {list(PHASES)}, got {phase!r}")
        elif self.phased and target.kind == "rank" and at_event is None:
            phase = "forward"
        return FaultSpec(index, self.name, at_step, target, phase, self._params(raw, key), at_event)

    def _check_target(self, target: Target, key: str, job: JobShape) -> None:
        # elastic: ranks up to the largest world the nodes can make (a grow adds them)
        ranks = job.all_nodes * job.nproc_per_node if job.elastic else job.world_size
        bound = {"rank": ranks, "node": job.all_nodes, "spare": job.nodes * job.spares}.get(target.kind)
        if bound is not None and not target.index < bound:
            have = f"{target.kind}s 0..{bound - 1}" if bound else f"no {target.kind}s"
            raise ScenarioError(key, f"{target} does not exist: the job has {have}")

    def _params(self, raw: dict, key: str) -> dict[str, Any]:
        out = {}
        for name, p in self.params.items():
            if name not in raw:
                if p.default is None and not p.optional:
                    raise ScenarioError(f"{key}.{name}", f"required for a {self.name} fault")
                out[name] = p.default
                continue
            value = raw[name]
            if p.type is float and type(value) is int:
                value = float(value)
            if type(value) is not p.type:
                raise ScenarioError(f"{key}.{name}", f"must be a {p.type.__name__}, got {value!r}")
            if p.check and (msg := p.check(value)):
                raise ScenarioError(f"{key}.{name}", msg)
            out[name] = value
        return out

    def inject(self, spec: FaultSpec, job: JobShape) -> Injection:
        raise NotImplementedError

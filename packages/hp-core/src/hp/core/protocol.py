"""Every contract between hp's processes, in one place: what one process writes and another reads.

- **Store keys** the controller (and rank 0) publish in the job's coordination store; workers only read.
  The store authenticates nobody, so every value at these keys is *sealed* with the job token
  (:mod:`hp.core.signed_values`; :func:`is_sealed_key`): the generation (controller), each plan
  (controller), each spare assignment (controller), the hydration size (rank 0), the finished marker
  (the ranks that finish), the node-service endpoints (each node's agent). Readers refuse, and never act
  on, a value not sealed for its key, and never take the generation back below one they have seen.
  Not sealed: the arrival-barrier counters and fault claims (``add`` counters), and torch's own
  rendezvous keys of each generation's process group (``hp/g<N>/``).
- **Process ids** the controller uses to fence out an old holder of a rank.
- **Plan** of a generation and **SpareAssignment** of a promoted spare: JSON values at those keys.
- **Verb**: the requests of the control plane (``POST /v1/<verb>``, :mod:`hp.core.control_plane`).
- **FailureAction**: what the controller answers to a failure report; **JobState**: the job's state.
- **Event**: the names in the per-process event logs (``hp.checkpointless.events``) that hp-chaos reads.
- **Decision**: the names in the controller's decision log (``controller_decisions.jsonl``).

Names are :class:`StrEnum` members: they compare equal to their string values and ``json.dumps``
writes them as plain strings, so what goes over the wire or into a file is the bare name.
Stdlib only: workers and spares read this before (or without) importing torch.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hp.core.errors import HpError
from hp.core.worker_env import AGENT_PID_ENV, NODE_INCARNATION_ENV, SCALING_POLICY_ENV, WorkerEnv  # noqa: F401

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover

    class StrEnum(str, Enum):
        """``enum.StrEnum`` of Python 3.11: ``str(member)`` is its value."""

        __str__ = str.__str__


class ProtocolError(HpError, ValueError):
    """A value read from another process does not follow its schema (one-line message)."""


# ---- store keys ---------------------------------------------------------------------------
GENERATION_KEY = "hp/generation"  # the newest generation; published after that generation's plan
STATE_NBYTES_KEY = "hp/state_nbytes"  # size of a full hydration, published by rank 0 after its first commit
# the last step, set by the ranks that finished the training loop: a process still waiting to join a
# generation (a grow decided during the last steps) will find nobody to form it with, and leaves
FINISHED_KEY = "hp/finished"
CONTROLLER_KEY = "hp/controller"  # HA (etcd store): the elected controller's endpoint, sealed, JSON {endpoint, epoch, node}
FAULT_CLAIM_KEY = "hp/fault/{index}/{step}"  # an injected fault (HP_FAULTS entry, step) is claimed by one process


def plan_key(generation: int) -> str:
    """Where the controller publishes the :class:`Plan` of ``generation``."""
    return f"hp/plan/{generation}"


def spare_key(spare: str) -> str:
    """Where the controller gives a promoted spare its rank (a :class:`SpareAssignment`)."""
    return f"hp/spare/{spare}"


def node_service_key(service: str, node_rank: int) -> str:
    """Where each node publishes the endpoint of its node service ``service`` (:mod:`hp.core.services`)."""
    return f"hp/node_service/{service}/{node_rank}"


def is_sealed_key(key: str) -> bool:
    """Whether the value at ``key`` is sealed with the job token (:mod:`hp.core.signed_values`): every
    value a process acts on. The arrival-barrier counters, fault claims and torch's keys are not."""
    return key in (GENERATION_KEY, STATE_NBYTES_KEY, FINISHED_KEY, CONTROLLER_KEY) or key.startswith(
        ("hp/plan/", "hp/spare/", "hp/node_service/"))


def arrive_prefix(generation: int) -> str:
    """Store prefix of the barrier the ranks of ``generation`` pass before forming their process group."""
    return f"hp/arrive/{generation}/"


ARRIVE_OUTCOME = "outcome"  # under arrive_prefix(g): how the barrier of generation g ended (ArriveOutcome)


class ArriveOutcome(StrEnum):
    """How the arrival barrier of a generation ended, decided once (``compare_set`` on the absent key
    :data:`ARRIVE_OUTCOME`): FORMED by the rank that arrives last; ABANDONED by a node's relay
    (:mod:`hp.core.fanout`) once the next generation's plan is published, so that ranks blocked in the
    barrier wake at once. Not sealed, like the arrival counter it completes: a rank acts on ABANDONED
    only once it sees a genuine newer generation."""

    FORMED = "formed"
    ABANDONED = "abandoned"


# why a generation was made (``Plan.why``) when it changes the world size: a process whose holder is not
# in such a plan was scaled out and leaves the job (exit 0), instead of being fenced out as a stale one
RESIZES = frozenset({"shrink", "grow", "preempt", "scale"})


# the worker environment's names (NODE_INCARNATION_ENV, SCALING_POLICY_ENV, AGENT_PID_ENV) and its typed
# contract live in hp.core.worker_env, re-exported here
# the socket of a warm-start server (hp.core.warm_start): ``hp run`` has its agent forked from there
WARM_START_ENV = "HP_WARM_START"


# ---- process ids --------------------------------------------------------------------------
def worker_holder(rank: int, attempt: int) -> str:
    """Id of the process holding ``rank`` after ``attempt`` restarts."""
    return f"r{rank}.{attempt}"


def restarted_holder(holder: str) -> str:
    """Id of the process restarted in place of ``holder`` (``r1.0`` -> ``r1.1``, ``spare.n0s0`` ->
    ``spare.n0s0.1``): derived from the process it replaces, never from its rank, which scale events
    renumber, so no two processes of a job ever share an id."""
    head, _, tail = holder.rpartition(".")
    if head and tail.isdigit():
        return f"{head}.{int(tail) + 1}"
    return f"{holder}.1"


def spare_id(node_rank: int, index: int) -> str:
    """Id of the ``index``-th hot spare a node started (never reused within a job)."""
    return f"n{node_rank}s{index}"


def spare_holder(spare: str) -> str:
    """Id of a spare's process once it holds a rank (see :func:`worker_holder`)."""
    return f"spare.{spare}"


# ---- names --------------------------------------------------------------------------------
class JobState(StrEnum):
    """The job's state, in every plan and in the controller's answers."""

    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    # the job is preempted and cannot go on at any size: every rank abandons its step, saves its last
    # committed step through the job's checkpoint (the tiered-checkpoint rung) and exits; a restart
    # resumes from that step
    PREEMPTED = "preempted"


class Verb(StrEnum):
    """Requests the controller serves; each is a handler of :class:`hp.core.controller.Controller`."""

    JOIN = "join"
    RENDEZVOUS = "rendezvous"
    HEARTBEAT = "heartbeat"
    WORKER_FAILED = "worker_failed"  # an agent saw a worker process die
    RANK_FAILED = "rank_failed"  # a worker recovered in process from a failure of its own step
    SPARE_FAILED = "spare_failed"
    SPARE_ADDED = "spare_added"
    SPARE_READY = "spare_ready"  # sent by the spare itself
    NODE_DONE = "node_done"
    NODE_STOPPING = "node_stopping"
    NODE_LEAVING = "node_leaving"  # graceful preemption: the node's ranks leave at a step boundary
    SCALE = "scale"  # an operator (``hp scale``) or a capacity source sets the job's capacity
    NODE_FAILED = "node_failed"  # the scheduler says a node failed (Slurm took it out of the job)
    FINISH = "finish"  # an operator (``hp finish``) ends the job at the next step boundary its ranks agree on
    STATE = "state"


class FailureAction(StrEnum):
    """The ``action`` of the controller's answer to ``worker_failed`` and ``rank_failed``."""

    PROMOTE_SPARE = "promote_spare"  # a spare of the reporting node holds the rank now
    MOVED = "moved"  # a spare of another node holds the rank now
    RESTART = "restart"  # restart the worker process
    REFORM = "reform"  # same membership, new generation: recover in process
    EXIT = "exit"  # the rank failed too often: its process exits, to be replaced
    SHRINK = "shrink"  # no spare: the job goes on without the rank (elastic), at a smaller world size
    LEAVE = "leave"  # graceful preemption granted: the node's ranks leave at the next step boundary
    SAVE = "save"  # the whole job is preempted (JobState.PREEMPTED): its ranks save, then exit
    STOP = "stop"  # the job failed


EXIT_PREEMPTED = 128 + 15  # hp run's exit status for a job stopped by preemption (what SIGTERM's would be)


class Event(StrEnum):
    """Names in the per-process event logs: what recovery did and when."""

    ASSIGNED = "assigned"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINT_SAVED = "checkpoint_saved"
    COMMIT = "commit"
    DATA_ATTACHED = "data_attached"
    ESCALATED = "escalated"
    FAILURE_DETECTED = "failure_detected"
    FAULT_INJECTED = "fault_injected"
    FAULT_RESUMED = "fault_resumed"
    FENCED_OUT = "fenced_out"
    FINAL_STATE = "final_state"  # per-rank digests of the final training state
    FINISH_AGREED = "finish_agreed"  # the commit vote of this step said: the job ends after it (``hp finish``)
    HEALTH_CHECK_FAILED = "health_check_failed"  # after a failure this rank's device failed a check: it leaves
    HYDRATED = "hydrated"
    HYDRATION_SENT = "hydration_sent"  # a source sent a rank behind the replicated state: how (premapped|shm|transport)
    LEFT = "left"  # this rank left the job gracefully (preempted, or scaled in): not a failure
    PREEMPT_SAVED = "preempt_saved"  # the job was preempted: this rank saved its last committed step
    IMPORTED = "imported"
    MODEL_READY = "model_ready"
    ORPHANED = "orphaned"
    PG_READY = "pg_ready"
    QUORUM = "quorum"
    RECEIVE_BUFFER_READY = "receive_buffer_ready"
    REFORM_FAILED = "reform_failed"
    RELEASED = "released"
    RESTORED = "restored"
    RESCALING = "rescaling"  # a planned re-form at a step boundary (grow, preemption) starts
    RESUMED = "resumed"
    SHARD_REBUILT = "shard_rebuilt"
    SHADOWS_COPIED = "shadows_copied"  # pure FSDP: these ranks' shadows were made again from their wards' shards
    SPARE_READY = "spare_ready"
    SPARE_READY_UNREPORTED = "spare_ready_unreported"
    STARTED = "started"
    STEP_FAILED = "step_failed"
    STEP_SKIPPED = "step_skipped"  # an AMP step whose gradients had inf/NaN, skipped by every rank
    STORE_VALUE_REFUSED = "store_value_refused"  # a store value not sealed for its key: ignored (rate limited)


class Decision(StrEnum):
    """Names in the controller's decision log."""

    JOIN = "join"
    NEW_GENERATION = "new_generation"
    PROMOTE_SPARE = "promote_spare"
    RESTART_WORKER = "restart_worker"
    ESCALATE = "escalate"
    NODE_LOST = "node_lost"
    SHRINK = "shrink"
    GROW = "grow"
    PREEMPT = "preempt"
    PREEMPT_JOB = "preempt_job"  # the job cannot go on without the leaving node: save and stop
    CAPACITY = "capacity"
    SPARE_ADDED = "spare_added"
    SPARE_READY = "spare_ready"
    SPARE_LOST = "spare_lost"
    NODE_DONE = "node_done"
    JOB_SUCCEEDED = "job_succeeded"
    FINISH = "finish"  # the job ends at the next step boundary its ranks agree on (``hp finish``)
    FAIL_JOB = "fail_job"
    REFUSED = "refused"
    CONTROLLER_ELECTED = "controller_elected"  # an HA replica took the lease and restored the job's state


# ---- values at the store keys -------------------------------------------------------------
def _object(raw: str | bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ProtocolError(f"malformed {what}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"malformed {what}: expected a JSON object, got {type(value).__name__}")
    return value


def _get(value: dict[str, Any], name: str, kind: type, what: str, default: Any = None) -> Any:
    got = value.get(name, default)
    if not isinstance(got, kind) or isinstance(got, bool) and kind is not bool:
        shown = type(got).__name__ if name in value else "missing"
        raise ProtocolError(f"malformed {what}: field {name!r} must be {kind.__name__}, got {shown}")
    return got


def _count(value: dict[str, Any], name: str, what: str) -> int:
    got = _get(value, name, int, what)
    if got < 0:
        raise ProtocolError(f"malformed {what}: field {name!r} must be >= 0, got {got}")
    return got


@dataclass(frozen=True)
class Plan:
    """The membership of one generation, as the controller publishes it at :func:`plan_key`.

    ``state`` is a :class:`JobState` value (a worker stops on any but ``running``), ``reason`` why the
    job failed, ``holders`` the id of the process holding each rank (any other is fenced out), ``why``
    what made this generation. A process finds its rank by its holder id (:meth:`rank_of`): a scale
    event renumbers the ranks. ``at_boundary``: a planned change (grow, graceful preemption): the
    ranks of the previous generation finish the step they are in and re-form after its commit, instead
    of abandoning it; a process whose holder is no longer in the plan then leaves the job.
    ``finishing``: an operator asked the job to end (``hp finish``, kept in every later plan): the ranks end
    their training loop after the next step whose commit vote says that one of them has seen it, all after
    the same step, and exit as at their last step.
    ``forming_store``: ``HOST:PORT`` of the ``TCPStore`` the ranks form this generation's process group on,
    hosted by a live node's agent that the controller picked for this generation (no rank hosts it, and a
    lost host only costs the generation being formed: the next one forms on another's); "" for the job's store."""

    generation: int
    world_size: int
    state: str
    reason: str
    holders: dict[int, str]
    why: str = ""
    at_boundary: bool = False
    forming_store: str = ""
    finishing: bool = False

    def rank_of(self, holder: str) -> int | None:
        """The rank ``holder`` holds in this generation (None: it holds none)."""
        return next((r for r, h in self.holders.items() if h == holder), None)

    def to_json(self) -> str:
        return json.dumps({"generation": self.generation, "world_size": self.world_size, "why": self.why,
                           "state": self.state, "reason": self.reason, "at_boundary": self.at_boundary,
                           "holders": {str(r): h for r, h in self.holders.items()},
                           **({"forming_store": self.forming_store} if self.forming_store else {}),
                           **({"finishing": True} if self.finishing else {})})

    @classmethod
    def from_json(cls, raw: str | bytes) -> Plan:
        what = "plan"
        value = _object(raw, what)
        generation = _count(value, "generation", what)
        what = f"plan of generation {generation}"
        state = _get(value, "state", str, what)
        if state not in {s.value for s in JobState}:
            raise ProtocolError(f"malformed {what}: unknown state {state!r}")
        holders = _get(value, "holders", dict, what)
        if not all(isinstance(r, str) and r.isascii() and r.isdigit() and isinstance(h, str) for r, h in holders.items()):
            raise ProtocolError(f"malformed {what}: 'holders' must map decimal ranks to process ids")
        return cls(generation, _count(value, "world_size", what), JobState(state), _get(value, "reason", str, what),
                   {int(r): h for r, h in holders.items()}, _get(value, "why", str, what, default=""),
                   _get(value, "at_boundary", bool, what, default=False),
                   _get(value, "forming_store", str, what, default=""),
                   _get(value, "finishing", bool, what, default=False))


@dataclass(frozen=True)
class SpareAssignment:
    """The rank the controller gives a promoted spare, from ``generation`` on (at :func:`spare_key`)."""

    rank: int
    generation: int

    def to_json(self) -> str:
        return json.dumps({"rank": self.rank, "generation": self.generation})

    @classmethod
    def from_json(cls, raw: str | bytes) -> SpareAssignment:
        value = _object(raw, "spare assignment")
        return cls(_count(value, "rank", "spare assignment"), _count(value, "generation", "spare assignment"))

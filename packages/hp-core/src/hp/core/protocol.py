"""Every contract between hp's processes, in one place: what one process writes and another reads.

- **Store keys** the controller (and rank 0) publish in the job's coordination store; workers only read.
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


def plan_key(generation: int) -> str:
    """Where the controller publishes the :class:`Plan` of ``generation``."""
    return f"hp/plan/{generation}"


def spare_key(spare: str) -> str:
    """Where the controller gives a promoted spare its rank (a :class:`SpareAssignment`)."""
    return f"hp/spare/{spare}"


def node_service_key(service: str, node_rank: int) -> str:
    """Where each node publishes the endpoint of its node service ``service`` (:mod:`hp.core.services`)."""
    return f"hp/node_service/{service}/{node_rank}"


def arrive_prefix(generation: int) -> str:
    """Store prefix of the barrier the ranks of ``generation`` pass before forming their process group."""
    return f"hp/arrive/{generation}/"


# ---- process ids --------------------------------------------------------------------------
def worker_holder(rank: int, attempt: int) -> str:
    """Id of the process holding ``rank`` after ``attempt`` restarts."""
    return f"r{rank}.{attempt}"


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
    STATE = "state"


class FailureAction(StrEnum):
    """The ``action`` of the controller's answer to ``worker_failed`` and ``rank_failed``."""

    PROMOTE_SPARE = "promote_spare"  # a spare of the reporting node holds the rank now
    MOVED = "moved"  # a spare of another node holds the rank now
    RESTART = "restart"  # restart the worker process
    REFORM = "reform"  # same membership, new generation: recover in process
    EXIT = "exit"  # the rank failed too often: its process exits, to be replaced
    STOP = "stop"  # the job failed


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
    HYDRATED = "hydrated"
    IMPORTED = "imported"
    MODEL_READY = "model_ready"
    ORPHANED = "orphaned"
    PG_READY = "pg_ready"
    QUORUM = "quorum"
    RECEIVE_BUFFER_READY = "receive_buffer_ready"
    REFORM_FAILED = "reform_failed"
    RELEASED = "released"
    RESTORED = "restored"
    RESUMED = "resumed"
    SHARD_REBUILT = "shard_rebuilt"
    SPARE_READY = "spare_ready"
    SPARE_READY_UNREPORTED = "spare_ready_unreported"
    STARTED = "started"
    STEP_FAILED = "step_failed"
    STEP_SKIPPED = "step_skipped"  # an AMP step whose gradients had inf/NaN, skipped by every rank


class Decision(StrEnum):
    """Names in the controller's decision log."""

    JOIN = "join"
    NEW_GENERATION = "new_generation"
    PROMOTE_SPARE = "promote_spare"
    RESTART_WORKER = "restart_worker"
    ESCALATE = "escalate"
    NODE_LOST = "node_lost"
    SPARE_ADDED = "spare_added"
    SPARE_READY = "spare_ready"
    SPARE_LOST = "spare_lost"
    NODE_DONE = "node_done"
    JOB_SUCCEEDED = "job_succeeded"
    FAIL_JOB = "fail_job"
    REFUSED = "refused"


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
    what made this generation."""

    generation: int
    world_size: int
    state: str
    reason: str
    holders: dict[int, str]
    why: str = ""

    def to_json(self) -> str:
        return json.dumps({"generation": self.generation, "world_size": self.world_size, "why": self.why,
                           "state": self.state, "reason": self.reason,
                           "holders": {str(r): h for r, h in self.holders.items()}})

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
                   {int(r): h for r, h in holders.items()}, _get(value, "why", str, what, default=""))


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

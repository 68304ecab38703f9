"""The job controller's durable state, as JSON: what an HA replica needs to take over.

:func:`dump` is called by the controller's journal (:mod:`hp.core.controller.journal`) after every
request that changed the job (through its ``persist`` function, see :mod:`hp.core.leader`); :func:`load`
puts it into a fresh controller of the replica that takes over. Liveness is *not* in it: a node's
``last_seen`` is a reading of one process's monotonic clock, so the new leader starts every node's
timeout afresh (a node that died with the old leader is declared lost one heartbeat timeout after the
takeover). The decision log is not in it either (it is appended to its own keys as decisions are made);
only its length is, so that numbering goes on.

The document is versioned; a replica refuses one it does not know rather than guess. Its shape is a
contract between the replicas of one job (and of one hp version): it does not follow the code's.
"""

from __future__ import annotations

from typing import Any, Protocol

from hp.core.controller.book import JobBook, NodeRecord
from hp.core.controller.journal import Journal
from hp.core.controller.policy import RecoveryPolicy
from hp.core.errors import HpError
from hp.core.protocol import JobState

VERSION = 1
_NODE_FIELDS = ("node_rank", "nproc", "host", "spares", "rank_offset", "done", "lost", "address", "spare_ids",
                "promotions", "forming_store", "incarnation")


class StateError(HpError):
    """A persisted controller state this replica cannot take over from."""


class Durable(Protocol):
    """What is persisted of a controller (:class:`hp.core.controller.Controller`): its parts that hold state."""

    book: JobBook
    journal: Journal
    policy: RecoveryPolicy


def dump(c: Durable, outbox: list[tuple[str, str]]) -> dict[str, Any]:
    """The controller's state as a JSON-able dict, with the values its last decision publishes
    (called with its lock held)."""
    b, journal = c.book, c.journal
    state: dict[str, Any] = {
        "version": VERSION,
        "kind": c.policy.kind,
        "generation": b.generation,
        "state": b.state.value,
        "reason": b.reason,
        "restarts": b.restarts,
        "finishing": b.finishing,
        "nodes": [{f: getattr(n, f) for f in _NODE_FIELDS} for n in b.nodes.values()],
        "members": _pairs(b.members),
        "holders": _pairs(b.holders),
        "rank_restarts": _pairs(b.rank_restarts),
        "rank_exceptions": _pairs(b.rank_exceptions),
        "spares": {"free": dict(b.spares.free), "seen": sorted(b.spares.seen), "ready": sorted(b.spares.ready)},
        "answers": _pairs(journal.answers),
        "decisions": journal.decision_count,
        "outbox": [list(kv) for kv in outbox],
    }
    if (policy_state := c.policy.dump()) is not None:  # hp.core.controller.elastic.ElasticPolicy's
        state["elastic"] = policy_state
    return state


def load(c: Durable, state: dict[str, Any], now: float) -> list[tuple[str, str]]:
    """Put ``state`` into the fresh controller ``c`` (``now``: its clock, where every node's heartbeat
    timeout starts); returns the values to publish again (the outbox of the last persisted decision:
    its leader may have died before publishing them)."""
    kind = c.policy.kind
    if not isinstance(state, dict) or state.get("version") != VERSION:
        raise StateError(f"controller state version {state.get('version') if isinstance(state, dict) else None!r} "
                         f"is not {VERSION}: a replica of another hp version cannot take this job over")
    if state.get("kind") != kind:
        raise StateError(f"the job's controller is a {state.get('kind')}, this replica runs a {kind} "
                         "(start every node with the same --nnodes and --scaling-policy)")
    b, journal = c.book, c.journal
    try:
        b.generation = int(state["generation"])
        b.state, b.reason, b.restarts = JobState(state["state"]), str(state["reason"]), int(state["restarts"])
        b.finishing = state.get("finishing") is True
        b.nodes = {}
        for fields in state["nodes"]:
            node = NodeRecord(**{f: fields[f] for f in _NODE_FIELDS if f in fields or f != "incarnation"})
            node.last_seen = now
            b.nodes[node.node_rank] = node
        b.members = _ints(state["members"])
        b.holders = _ints(state["holders"])
        b.rank_restarts = _ints(state["rank_restarts"])
        b.rank_exceptions = _ints(state["rank_exceptions"])
        journal.answers = _ints(state["answers"])
        spares = state["spares"]
        b.spares.free.clear()
        b.spares.free.update({str(k): int(v) for k, v in spares["free"].items()})
        b.spares.seen = set(spares["seen"])
        b.spares.ready = set(spares["ready"])
        if "elastic" in state:
            c.policy.load(state["elastic"])
        journal.decisions_before = int(state["decisions"])  # made by earlier leaders; the entries are in the log's keys
        return [(str(k), str(v)) for k, v in state["outbox"]]
    except (KeyError, TypeError, ValueError) as e:
        raise StateError(f"malformed controller state: {type(e).__name__}: {e}") from None


def _pairs(d: dict[int, Any]) -> list[list[Any]]:
    """A dict with int keys as JSON: a list of [key, value] (JSON object keys are strings)."""
    return [[k, v] for k, v in sorted(d.items())]


def _ints(pairs: list[list[Any]]) -> dict[int, Any]:
    return {int(k): v for k, v in pairs}

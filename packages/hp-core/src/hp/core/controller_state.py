"""The job controller's durable state, as JSON: what an HA replica needs to take over.

:func:`dump` is called by :class:`hp.core.controller.Controller` after every request that changed the
job (through its ``persist`` function, see :mod:`hp.core.leader`); :func:`load` puts it into a fresh
controller of the replica that takes over. Liveness is *not* in it: a node's ``last_seen`` is a
reading of one process's monotonic clock, so the new leader starts every node's timeout afresh
(a node that died with the old leader is declared lost one heartbeat timeout after the takeover).
The decision log is not in it either (it is appended to its own keys as decisions are made); only
its length is, so that numbering goes on.

The document is versioned; a replica refuses one it does not know rather than guess.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hp.core.controller import NodeRecord
from hp.core.errors import HpError
from hp.core.protocol import JobState

if TYPE_CHECKING:
    from hp.core.controller import Controller

VERSION = 1
_NODE_FIELDS = ("node_rank", "nproc", "host", "spares", "rank_offset", "done", "lost", "address", "spare_ids",
                "promotions", "forming_store", "incarnation")


class StateError(HpError):
    """A persisted controller state this replica cannot take over from."""


def dump(c: Controller, outbox: list[tuple[str, str]]) -> dict[str, Any]:
    """The controller's state as a JSON-able dict, with the values its last decision publishes
    (called with its lock held)."""
    state: dict[str, Any] = {
        "version": VERSION,
        "kind": type(c).__name__,
        "generation": c.generation,
        "state": c.state.value,
        "reason": c.reason,
        "restarts": c.restarts,
        "finishing": c.finishing,
        "nodes": [{f: getattr(n, f) for f in _NODE_FIELDS} for n in c.nodes.values()],
        "members": _pairs(c.members),
        "holders": _pairs(c.holders),
        "rank_restarts": _pairs(c.rank_restarts),
        "rank_exceptions": _pairs(c.rank_exceptions),
        "spares": {"free": dict(c.spares.free), "seen": sorted(c.spares.seen), "ready": sorted(c.spares.ready)},
        "answers": _pairs(c.answers),
        "decisions": c.decision_count,
        "outbox": [list(kv) for kv in outbox],
    }
    if hasattr(c, "joiners"):  # hp.core.rescale.ElasticController
        state["elastic"] = {"capacity": c.capacity, "joiners": sorted(c.joiners)}
    return state


def load(c: Controller, state: dict[str, Any], now: float) -> list[tuple[str, str]]:
    """Put ``state`` into the fresh controller ``c`` (``now``: its clock, where every node's heartbeat
    timeout starts); returns the values to publish again (the outbox of the last persisted decision:
    its leader may have died before publishing them)."""
    if not isinstance(state, dict) or state.get("version") != VERSION:
        raise StateError(f"controller state version {state.get('version') if isinstance(state, dict) else None!r} "
                         f"is not {VERSION}: a replica of another hp version cannot take this job over")
    if state.get("kind") != type(c).__name__:
        raise StateError(f"the job's controller is a {state.get('kind')}, this replica runs a {type(c).__name__} "
                         "(start every node with the same --nnodes and --scaling-policy)")
    try:
        c.generation = int(state["generation"])
        c.state, c.reason, c.restarts = JobState(state["state"]), str(state["reason"]), int(state["restarts"])
        c.finishing = state.get("finishing") is True
        c.nodes = {}
        for fields in state["nodes"]:
            node = NodeRecord(**{f: fields[f] for f in _NODE_FIELDS if f in fields or f != "incarnation"})
            node.last_seen = now
            c.nodes[node.node_rank] = node
        c.members = _ints(state["members"])
        c.holders = _ints(state["holders"])
        c.rank_restarts = _ints(state["rank_restarts"])
        c.rank_exceptions = _ints(state["rank_exceptions"])
        c.answers = _ints(state["answers"])
        spares = state["spares"]
        c.spares.free.clear()
        c.spares.free.update({str(k): int(v) for k, v in spares["free"].items()})
        c.spares.seen = set(spares["seen"])
        c.spares.ready = set(spares["ready"])
        c.free_spares = c.spares.free
        if "elastic" in state:
            c.capacity = state["elastic"]["capacity"]
            c.joiners = set(state["elastic"]["joiners"])
        c.decisions_before = int(state["decisions"])  # made by earlier leaders; the entries are in the log's keys
        return [(str(k), str(v)) for k, v in state["outbox"]]
    except (KeyError, TypeError, ValueError) as e:
        raise StateError(f"malformed controller state: {type(e).__name__}: {e}") from None


def _pairs(d: dict[int, Any]) -> list[list[Any]]:
    """A dict with int keys as JSON: a list of [key, value] (JSON object keys are strings)."""
    return [[k, v] for k, v in sorted(d.items())]


def _ints(pairs: list[list[Any]]) -> dict[int, Any]:
    return {int(k): v for k, v in pairs}

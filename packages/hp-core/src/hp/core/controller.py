"""The job controller: membership, generations, fencing and recovery decisions.

Pure state machine: it receives decoded, authenticated requests from agents (see
:mod:`hp.core.control_plane` for the wire) and answers with decisions. Every membership change bumps
the generation; a mutating request that carries an older generation is refused, so an agent that
missed a change can never act on a stale view.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

log = logging.getLogger("hp.controller")


class JobState(str, Enum):
    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class Refused(Exception):
    """A request the controller will not act on; ``status`` follows HTTP meanings."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


@dataclass
class NodeRecord:
    node_rank: int
    nproc: int
    host: str
    rank_offset: int = 0
    last_seen: float = 0.0
    done: bool = False


@dataclass
class ControllerConfig:
    nnodes: int
    max_restarts: int = 0  # worker restarts the whole job tolerates, as torchrun counts them
    heartbeat_timeout_s: float = 30.0
    store_host: str = "127.0.0.1"
    store_port: int = 0
    decision_log: str | None = None  # JSON-lines file; None keeps the log in memory only


def describe_exit(exitcode: int | None, signal_name: str | None) -> str:
    if signal_name:
        return f"was killed by {signal_name}"
    return f"exited with code {exitcode}"


def _field(payload: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    value = payload.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise Refused(400, f"malformed request: field {name!r} must be {getattr(kind, '__name__', kind)}")
    return value


class Controller:
    """One per job. Thread-safe: the control server calls it from several threads."""

    def __init__(self, config: ControllerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self.generation = 0
        self.state = JobState.RENDEZVOUS
        self.reason = ""
        self.restarts = 0
        self.nodes: dict[int, NodeRecord] = {}
        self.decisions: list[dict] = []
        self._handlers = {
            "join": self._join,
            "rendezvous": self._rendezvous,
            "heartbeat": self._heartbeat,
            "worker_failed": self._worker_failed,
            "node_done": self._node_done,
            "node_stopping": self._node_stopping,
            "state": lambda p: self.snapshot(),
        }

    # ---- entry points -------------------------------------------------------------------
    def handle(self, verb: str, payload: dict) -> dict:
        """Dispatch one authenticated request; raises :class:`Refused` (and logs it) on refusal."""
        handler = self._handlers.get(verb)
        with self._lock:
            try:
                if handler is None:
                    raise Refused(404, f"unknown request {verb!r}")
                return handler(payload)
            except Refused as r:
                self.record_refusal(verb, r.status, r.message, payload.get("node_rank"))
                raise

    def record_refusal(self, verb: str, status: int, message: str, node_rank: Any = None) -> None:
        log.warning("refused %s from node %s: %s", verb, node_rank, message)
        self._log("refused", request=verb, status=status, reason=message, node_rank=node_rank)

    def check_liveness(self) -> None:
        """Fail the job if a running node stopped heartbeating (no elastic shrink yet)."""
        with self._lock:
            if self.state is not JobState.RUNNING:
                return
            now = self._clock()
            for node in self.nodes.values():
                silent = now - node.last_seen
                if not node.done and silent > self.config.heartbeat_timeout_s:
                    self._bump("node_lost", node_rank=node.node_rank)
                    self._fail(f"node {node.node_rank} ({node.host}) lost: no heartbeat for {silent:.1f} s")
                    return

    def snapshot(self) -> dict:
        return {
            "state": self.state.value,
            "generation": self.generation,
            "reason": self.reason,
            "restarts": self.restarts,
            "nodes": {n.node_rank: {"host": n.host, "nproc": n.nproc, "done": n.done} for n in self.nodes.values()},
            "decisions": len(self.decisions),
        }

    # ---- decisions ----------------------------------------------------------------------
    def _log(self, decision: str, **details: Any) -> None:
        entry = {"t": time.time(), "generation": self.generation, "decision": decision, **details}
        self.decisions.append(entry)
        if self.config.decision_log:
            with open(self.config.decision_log, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def _bump(self, why: str, **details: Any) -> None:
        self.generation += 1
        self._log("new_generation", why=why, **details)

    def _fail(self, reason: str) -> None:
        self.state, self.reason = JobState.FAILED, reason
        self._log("fail_job", reason=reason)

    def _fence(self, payload: dict) -> NodeRecord:
        generation = _field(payload, "generation", int)
        node = self._node(payload)
        if generation != self.generation:
            raise Refused(
                409,
                f"stale generation {generation} (current is {self.generation})"
                if generation < self.generation
                else f"unknown future generation {generation} (current is {self.generation})",
                generation=self.generation,
            )
        return node

    def _node(self, payload: dict) -> NodeRecord:
        node_rank = _field(payload, "node_rank", int)
        if node_rank not in self.nodes:
            raise Refused(403, f"node {node_rank} is not a member of this job")
        return self.nodes[node_rank]

    def _require_running(self) -> None:
        if self.state is not JobState.RUNNING:
            raise Refused(409, f"job is {self.state.value}", state=self.state.value, reason=self.reason)

    # ---- handlers (called with the lock held) -------------------------------------------
    def _join(self, p: dict) -> dict:
        node_rank = _field(p, "node_rank", int)
        nproc = _field(p, "nproc", int)
        host = _field(p, "host", str)
        if not 0 <= node_rank < self.config.nnodes:
            raise Refused(400, f"node_rank {node_rank} outside [0, {self.config.nnodes})")
        if nproc < 1:
            raise Refused(400, f"nproc must be >= 1, got {nproc}")
        known = self.nodes.get(node_rank)
        if self.state is not JobState.RENDEZVOUS:
            raise Refused(409, f"job is {self.state.value}; node {node_rank} cannot join now")
        if known and (known.nproc, known.host) != (nproc, host):
            raise Refused(409, f"node_rank {node_rank} already joined from {known.host}")
        self.nodes[node_rank] = NodeRecord(node_rank, nproc, host)
        self._log("join", node_rank=node_rank, host=host, nproc=nproc)
        if len(self.nodes) == self.config.nnodes:
            offset = 0
            for rank in sorted(self.nodes):
                self.nodes[rank].rank_offset = offset
                self.nodes[rank].last_seen = self._clock()
                offset += self.nodes[rank].nproc
            self.state = JobState.RUNNING
            self._bump("rendezvous_complete", world_size=offset)
        return {"joined": True}

    def _rendezvous(self, p: dict) -> dict:
        node = self._node(p)
        if self.state is JobState.RENDEZVOUS:
            return {"state": self.state.value, "joined": len(self.nodes), "nnodes": self.config.nnodes}
        node.last_seen = self._clock()
        return {
            "state": self.state.value,
            "reason": self.reason,
            "generation": self.generation,
            "world_size": sum(n.nproc for n in self.nodes.values()),
            "rank_offset": node.rank_offset,
            "nnodes": self.config.nnodes,
            "store_host": self.config.store_host,
            "store_port": self.config.store_port,
        }

    def _heartbeat(self, p: dict) -> dict:
        # Liveness is accepted whatever generation the agent has seen; the reply carries the
        # current one so the agent catches up before its next (fenced) report.
        node = self._node(p)
        _field(p, "generation", int)
        node.last_seen = self._clock()
        return {"state": self.state.value, "generation": self.generation, "reason": self.reason}

    def _worker_failed(self, p: dict) -> dict:
        node = self._fence(p)
        self._require_running()
        local_rank = _field(p, "local_rank", int)
        if not 0 <= local_rank < node.nproc:
            raise Refused(400, f"local_rank {local_rank} outside [0, {node.nproc})")
        exitcode = p.get("exitcode")
        signal_name = p.get("signal")
        rank = node.rank_offset + local_rank
        who = f"rank {rank} (node {node.node_rank}, local_rank {local_rank}, pid {p.get('pid')})"
        cause = describe_exit(exitcode, signal_name if isinstance(signal_name, str) else None)
        if self.restarts < self.config.max_restarts:
            self.restarts += 1
            self._bump("worker_restart", rank=rank, cause=cause)
            self._log("restart_worker", rank=rank, node_rank=node.node_rank, local_rank=local_rank,
                      cause=cause, restarts=self.restarts)
            return {"action": "restart", "generation": self.generation, "rank": rank}
        message = p.get("message")
        detail = f": {message}" if isinstance(message, str) and message else ""
        self._fail(f"{who} {cause}{detail}; restarts exhausted ({self.restarts}/{self.config.max_restarts})")
        return {"action": "stop", "reason": self.reason, "generation": self.generation}

    def _node_done(self, p: dict) -> dict:
        node = self._fence(p)
        node.done = True
        self._log("node_done", node_rank=node.node_rank)
        if self.state is JobState.RUNNING and all(n.done for n in self.nodes.values()):
            self.state = JobState.SUCCEEDED
            self._log("job_succeeded")
        return {"state": self.state.value}

    def _node_stopping(self, p: dict) -> dict:
        node = self._node(p)
        why = p.get("reason") if isinstance(p.get("reason"), str) else "stopping"
        if self.state in (JobState.RUNNING, JobState.RENDEZVOUS):
            self._bump("node_stopping", node_rank=node.node_rank)
            self._fail(f"node {node.node_rank} stopped: {why}")
        return {"state": self.state.value}

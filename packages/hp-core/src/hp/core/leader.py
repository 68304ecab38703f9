"""The highly available controller: replicas that elect a leader through etcd and hand the job over.

With the ``etcd`` store (``hp run --store etcd --rdzv-endpoint ETCD,...``) every node's agent runs a
:class:`ControllerReplica`. One holds the job's *lease*, an etcd key with a TTL that it refreshes
(:class:`Lease`); it serves the controller (:mod:`hp.core.controller`, on the wire of
:mod:`hp.core.control_plane`) and publishes where (:data:`hp.core.protocol.CONTROLLER_KEY`, sealed).
The others wait on the lease key. When the leader's agent dies its key expires (after the TTL) and
a standby takes the lease, reads the job's state (:class:`StateKeeper`), takes it over
(:meth:`hp.core.controller.Controller.take_over`) and serves it; agents and workers follow it
(:class:`LeaderResolver`, given to :class:`hp.core.control_plane.ControlClient`). Nothing in the
workers' process groups depends on the controller, so training goes on through the handover.

A replica's states, written down:

============ =================================================================== ===================
state        what it does                                                        leaves for
============ =================================================================== ===================
campaigning  creates the lease key (``prevExist=false``, TTL); while another      leading (created)
             holds it, watches it until it is deleted or expires                 stopped
leading      serves the controller; refreshes the lease every TTL/3              campaigning (lost)
                                                                                 stopped
stopped      releases the lease if held (a standby takes over at once)           -
============ =================================================================== ===================

Fencing: every persisted state is a compare-and-swap on the index of this leader's previous write
(the takeover write, on the index it read). Once a new leader has written, a deposed one's next write
fails, and :class:`hp.core.controller.Controller` then refuses to answer (503): no decision is
answered that is not durable, and none is made by two leaders. The lease's etcd index is the
leader's *epoch*, in every state it writes and in its endpoint: a resolver never goes back to an
older epoch (a replayed sealed endpoint).

Trust: etcd authenticates nobody (see :mod:`hp.core.etcd_store`), so the state is sealed with the job
token (:mod:`hp.core.signed_values`) and a replica refuses one that is not; the lease key itself is
not secret (who can delete it can make the replicas hand over, not forge a decision).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hp.core.control_plane import ControlServer
from hp.core.errors import HpError
from hp.core.protocol import CONTROLLER_KEY, ProtocolError
from hp.core.signed_values import seal, sealing, unseal

if TYPE_CHECKING:
    import torch.distributed as dist

    from hp.core.controller import Controller
    from hp.core.etcd_store import HpEtcdStore

log = logging.getLogger("hp.leader")

DEFAULT_TTL_S = 2  # etcd v2 TTLs are whole seconds
MAX_STATE_BYTES = 64 << 20  # a persisted state inflates to at most this (it is verified before it is inflated)


def _pack(doc: dict) -> str:
    """The state as stored: zlib (level 1) in base64. At 16,384 ranks its JSON is ~1.1 MB (every holder and
    member), above etcd's default 1.5 MiB request limit once sealed; packed it is ~0.27 MB, in ~7 ms."""
    return "z1:" + base64.b64encode(zlib.compress(json.dumps(doc, default=str).encode(), 1)).decode()


def _unpack(value: str) -> dict:
    if not value.startswith("z1:"):
        raise ValueError("not a packed controller state")
    inflate = zlib.decompressobj()
    raw = inflate.decompress(base64.b64decode(value[3:], validate=True), MAX_STATE_BYTES)
    if inflate.unconsumed_tail:
        raise ValueError(f"controller state inflates past {MAX_STATE_BYTES} bytes")
    return json.loads(raw)


class Deposed(HpError):
    """This replica no longer leads: another one wrote the job's state, or its lease was lost."""


def control_dir(store: HpEtcdStore) -> str:
    """The etcd directory of a job's control keys (beside its ``kv/`` store keys)."""
    return store.prefix[: -len("kv/")] + "control/"


class Lease:
    """The job's leadership, one etcd key with a TTL (v2 API): held by at most one candidate."""

    def __init__(self, store: HpEtcdStore, candidate: str, ttl_s: int = DEFAULT_TTL_S) -> None:
        self._store, self.candidate, self.ttl_s = store, candidate, int(ttl_s)
        self.path = control_dir(store) + "leader"
        self.epoch = 0  # etcd index at which this candidate took the lease (0: not held)
        self._index = 0  # of its last refresh

    def try_acquire(self) -> bool:
        import etcd

        try:
            node = self._store.call(lambda: self._store.client.write(
                self.path, self.candidate, ttl=self.ttl_s, prevExist=False), idempotent=False)
        except etcd.EtcdAlreadyExist:
            return False
        self.epoch = self._index = node.modifiedIndex
        return True

    def acquire(self, stop: threading.Event) -> bool:
        """Block until this candidate holds the lease (True) or ``stop`` is set (False). While another
        holds it, one watch per TTL waits for its key to go (no polling)."""
        import etcd

        while not stop.is_set():
            if self.try_acquire():
                return True
            try:
                node = self._store.call(lambda: self._store.client.read(self.path))
                self._store.client.watch(self.path, index=node.modifiedIndex + 1, timeout=self.ttl_s)
            except (etcd.EtcdKeyNotFound, etcd.EtcdWatchTimedOut, etcd.EtcdEventIndexCleared):
                pass  # gone (try again now), or still held: the loop decides
            except etcd.EtcdConnectionFailed:
                stop.wait(0.2)
        return False

    def refresh(self) -> bool:
        """Extend the TTL; False if the lease is no longer this candidate's (expired, taken, deleted)."""
        import etcd

        try:
            node = self._store.call(lambda: self._store.client.write(
                self.path, self.candidate, ttl=self.ttl_s, prevIndex=self._index), deadline=time.monotonic() + self.ttl_s,
                idempotent=False)
        except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound, etcd.EtcdConnectionFailed):
            return False
        self._index = node.modifiedIndex
        return True

    def release(self) -> None:
        import etcd

        if not self.epoch:
            return
        try:
            self._store.call(lambda: self._store.client.delete(self.path, prevValue=self.candidate),
                             deadline=time.monotonic() + 2)
        except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound, etcd.EtcdConnectionFailed):
            pass  # expired or taken meanwhile
        self.epoch = self._index = 0


class StateKeeper:
    """The job's controller state in etcd, sealed, written only by compare-and-swap (see the module
    docstring); the decision log in in-order keys beside it."""

    def __init__(self, store: HpEtcdStore, token: str, epoch: int) -> None:
        self._store, self._token, self.epoch = store, token, epoch
        self.path = control_dir(store) + "state"
        self.log_path = control_dir(store) + "decisions"
        self._index: int | None = None  # etcd index of the state this leader read or last wrote

    def read(self) -> dict | None:
        """The last persisted state (None: a new job); remembers its index for the takeover write."""
        import etcd

        try:
            node = self._store.call(lambda: self._store.client.read(self.path))
        except etcd.EtcdKeyNotFound:
            self._index = None
            return None
        self._index = node.modifiedIndex
        try:
            packed = unseal(self._token, self.path, node.value)
        except ProtocolError as e:
            raise Deposed(f"the job's persisted controller state is not sealed with this job's token: {e}") from None
        try:
            return _unpack(packed)["state"]
        except (ValueError, KeyError, TypeError, zlib.error) as e:  # sealed by this job, yet unreadable: refuse
            raise Deposed(f"the job's persisted controller state is unreadable: {e}") from None

    def persist(self, state: dict, decisions: list[dict]) -> None:
        """``state`` as the job's state, if no other leader wrote since this one; else :class:`Deposed`."""
        import etcd

        client = self._store.client
        for entry in decisions:  # the log first: a state never counts decisions the log lacks
            value = seal(self._token, self.log_path, json.dumps(entry, default=str))
            self._store.call(lambda v=value: client.write(self.log_path, v, append=True), idempotent=False)
        value = seal(self._token, self.path, _pack({"epoch": self.epoch, "state": state}))
        fence = {"prevExist": False} if self._index is None else {"prevIndex": self._index}
        try:
            node = self._store.call(lambda: client.write(self.path, value, **fence), idempotent=False)
        except (etcd.EtcdCompareFailed, etcd.EtcdAlreadyExist, etcd.EtcdKeyNotFound):
            raise Deposed(f"another controller wrote the job's state since epoch {self.epoch} took it") from None
        self._index = node.modifiedIndex

    def decisions(self) -> list[dict]:
        """The job's decision log, every leader's, in order (entries not sealed with the token are skipped)."""
        import etcd

        try:
            listing = self._store.call(lambda: self._store.client.read(self.log_path, recursive=True, sorted=True))
        except etcd.EtcdKeyNotFound:
            return []
        found = []
        for node in listing.leaves:
            if node.dir or node.key == listing.key:
                continue
            try:
                found.append(json.loads(unseal(self._token, self.log_path, node.value)))
            except (ProtocolError, ValueError):
                log.warning("decision log entry %s is not sealed with the job token: skipped", node.key)
        return found


@dataclass(frozen=True)
class LeaderInfo:
    endpoint: str
    epoch: int
    node: str


class LeaderResolver:
    """Where the controller is: the sealed endpoint the leader published in the job's store. Never goes
    back to an older epoch. Any store works (agents and workers read it through their own)."""

    def __init__(self, store: dist.Store, token: str) -> None:
        self._store, self._token = store, token
        self._best = LeaderInfo("", 0, "")

    def current(self) -> LeaderInfo | None:
        try:
            if not self._store.check([CONTROLLER_KEY]):
                return None
            doc = json.loads(unseal(self._token, CONTROLLER_KEY, self._store.get(CONTROLLER_KEY)))
            info = LeaderInfo(str(doc["endpoint"]), int(doc["epoch"]), str(doc["node"]))
        except (ProtocolError, ValueError, KeyError, TypeError) as e:
            log.warning("controller endpoint in the store refused: %s", e)
            return None
        if info.epoch >= self._best.epoch:
            self._best = info
        return self._best if self._best.endpoint else None

    def wait_for_other(self, endpoint: str, deadline: float) -> str | None:
        """An endpoint other than ``endpoint`` (the one that stopped answering), waiting until ``deadline``
        for a new leader to publish one; None if none did. Only while a controller is unreachable."""
        while True:
            info = self.current()
            if info is not None and info.endpoint != endpoint:
                return info.endpoint
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def candidate_id(node: int | str) -> str:
    """A replica's name in the lease: its node and a random part (a restarted agent is a new candidate)."""
    return f"node{node}-{os.getpid()}-{secrets.token_hex(4)}"


class ControllerReplica:
    """One node's candidate for the job's controller (see the module docstring for its states).

    ``make(persist)`` builds a fresh controller that persists through ``persist``; ``host``/``port``:
    where the controller listens while this replica leads (port 0: any free one)."""

    def __init__(self, store: HpEtcdStore, token: str, make: Callable[[Callable[[dict, list[dict]], None]], Controller],
                 host: str, port: int = 0, node: int | str = 0, ttl_s: int = DEFAULT_TTL_S,
                 say: Callable[[str], None] = log.info) -> None:
        self._store, self._token, self._make = store, token, make
        self._host, self._port, self.node, self._say = host, port, node, say
        self.lease = Lease(store, candidate_id(node), ttl_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hp-controller-replica", daemon=True)
        self.server: ControlServer | None = None
        self.controller: Controller | None = None
        self.error: BaseException | None = None  # what ended the replica, if anything but stop()

    def __repr__(self) -> str:  # never the token
        return f"ControllerReplica(node={self.node}, leading={self.leading})"

    @property
    def leading(self) -> bool:
        return self.server is not None

    def start(self) -> ControllerReplica:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            while self.lease.acquire(self._stop):
                try:
                    self._lead()
                except Deposed as e:
                    self._say(f"controller replica of node {self.node} stepped down: {e}")
                finally:
                    self._step_down()
                    self.lease.release()
        except BaseException as e:  # noqa: BLE001  a replica that cannot go on says why, once
            self.error = e
            self._say(f"controller replica of node {self.node} stopped: {e}")
        finally:
            self._step_down()
            self.lease.release()

    def _lead(self) -> None:
        from hp.core.controller import Refused

        started = time.monotonic()
        keeper = StateKeeper(self._store, self._token, self.lease.epoch)
        for attempt in range(3):  # the old leader may write once more between this read and the takeover write
            state = keeper.read()
            controller = self._make(keeper.persist)
            try:
                controller.take_over(state, epoch=self.lease.epoch, node_rank=self.node, resumed=state is not None)
                break
            except Refused:
                if attempt == 2:
                    raise Deposed(controller.deposed) from None
        self.controller = controller
        self.server = ControlServer(controller, self._token, self._host, self._port).start()
        endpoint = {"endpoint": self.server.endpoint, "epoch": self.lease.epoch, "node": str(self.node)}
        sealing(self._store.set, self._token)(CONTROLLER_KEY, json.dumps(endpoint))
        self._say(f"controller elected on node {self.node} (epoch {self.lease.epoch}, "
                  f"{'took over generation ' + str(controller.generation) if state else 'new job'}) at "
                  f"{self.server.endpoint} in {time.monotonic() - started:.3f} s")
        while not self._stop.wait(self.lease.ttl_s / 3):
            if controller.deposed:
                raise Deposed(controller.deposed)
            if not self.lease.refresh():
                controller.deposed = "its lease expired or was taken"
                raise Deposed(controller.deposed)

    def _step_down(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.controller is not None and not self.controller.deposed:
            self.controller.deposed = "its replica stopped"
        self.controller = None

"""Per-node fan-out of the job's membership: one blocking watcher per node instead of a poller per rank.

Issue #14: every worker's watch thread read the generation from the job's store every 10 ms, a waiting
spare polled its assignment every 5 ms: ~200 requests/s per rank, millions per second at 16,384 ranks,
all on one store. Here each node's agent runs one :class:`Relay`, a thread that *blocks* on the store
(a ``get`` of the next generation's plan key, which returns once the controller publishes it; re-issued
every ``wait_s``: no polling) and forwards what it reads to a :class:`Channel` that only this node's
processes reach. Each worker keeps a :class:`Mirror` of the channel, pushed to it, and waits on that: at
idle the store serves one request per node every ``wait_s``, whatever the number of ranks, and a new
generation reaches a node's ranks one store read after the controller published it.

**Forwarded** (:func:`forwarded`): the plans of the newest :data:`KEEP_PLANS` generations, and the
assignments of this node's spares (a plan names a promoted spare among its holders; its assignment follows
the plan by milliseconds and is read until the genuine one is there). Not the generation key: it is a
shortcut for readers of a store that cannot list its keys, and a channel can; the newest genuine plan in
it is the generation. The relay also ends the arrival barrier of the generation a new plan supersedes
(:class:`~hp.core.protocol.ArriveOutcome`), so ranks blocked in it wake at once.

**Trust.** The relay forwards the sealed bytes unchanged, forged or genuine, and the workers verify every
value as they did when they read the store themselves (:class:`hp.checkpointless.membership.JobView`):
neither the relay nor a process that reaches the channel can make a worker act on a forged value. The
relay checks seals only to know whether the plan it waits for has come; a forged value at that key is
forwarded, then read again every :data:`FORGED_RETRY_S` until the controller's own replaces it.

**Why a Unix socket** in a new 0700 directory, pushing frames, not a second ``TCPStore`` on 127.0.0.1:
only this user's processes reach it (any local user reaches a port); a waiter needs "the next plan, or
my assignment, or stop", and ``TCPStore.wait`` returns only once *all* its keys exist; each timed-out
``TCPStore`` wait logs two c10d warnings (and several timing out at once in one process stall ~5 s).
A frame is ``!HI`` (key and value lengths, :data:`_DELETED` for a removed key), the key, the value; a
client gets every current value, then an empty key (in sync), then each change. Stdlib only.

**Bounds.** A store value over :data:`MAX_VALUE_BYTES` is not forwarded (a store writer without the token
could otherwise make every worker of every node hold it): the relay reads it as it reads a forged one. A
mirror drops a connection whose frame claims more, and connects again. An agent killed with SIGKILL
leaves its channel's directory behind: the next channel made on the machine by the same user removes
every such directory whose socket no process listens on (:func:`sweep_stale`).
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

from hp.core.protocol import (
    ARRIVE_OUTCOME, ArriveOutcome, Plan, ProtocolError, SpareAssignment, arrive_prefix, plan_key, spare_holder,
    spare_id, spare_key,
)
from hp.core.signed_values import unseal

if TYPE_CHECKING:
    import torch.distributed as dist

FANOUT_ENV = "HP_FANOUT_SOCKET"  # set by the agent in each worker's environment: the channel's socket path
# a relay's blocking read of the store is re-issued this often (one request each: at idle 0.5 request/s per
# node). A daemon thread still inside torch's C++ read when the interpreter finalizes is killed mid-call
# (std::terminate, exit -6: the fresh-clone run with the relay on every job, once node 0 closed its store):
# hp run ends without that teardown (hp.core.commands); a process that finalizes waits this long for it
RELAY_WAIT_S = 2.0
KEEP_PLANS = 4  # plans of older generations leave the channel (a 16k-rank plan is ~0.4 MB)
FORGED_RETRY_S = 0.1  # a forged value at the key the relay waits for is read again this often
ASSIGNMENT_RETRY_S = (0.002, 1.0)  # a promoted spare's assignment is read again from 2 ms, doubling to 1 s
SEND_TIMEOUT_S = 1.0  # a client that takes no frame for this long is dropped (it reconnects, resyncs)
MAX_VALUE_BYTES = 64 << 20  # a forwarded value's bound (a 16,384-rank plan is ~0.4 MB)
DIR_PREFIX = "hp-fanout-"
_HEADER = struct.Struct("!HI")
_DELETED = 0xFFFFFFFF


def forwarded(key: str) -> bool:
    """Whether a worker reads ``key`` from its node's channel (when it has one) rather than from the store."""
    return key.startswith(("hp/plan/", "hp/spare/"))


def _frame(key: str, value: bytes | None) -> bytes:
    name = key.encode()
    return _HEADER.pack(len(name), _DELETED if value is None else len(value)) + name + (value or b"")


def sweep_stale(parent: str, min_age_s: float = 60.0) -> list[str]:
    """Remove this user's channel directories in ``parent`` that no process serves any more (their agent
    was killed before it could close them): a socket nobody listens on refuses connections. One changed
    within ``min_age_s`` is left alone (its channel may be between its bind and its listen). The removed."""
    removed = []
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        try:
            info = os.lstat(path)
            if not name.startswith(DIR_PREFIX) or info.st_uid != os.getuid() or time.time() - info.st_mtime < min_age_s:
                continue
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(os.path.join(path, "channel.sock"))
                continue  # served
            except (ConnectionRefusedError, FileNotFoundError):  # nobody listens (or killed before binding)
                pass
            finally:
                probe.close()
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class Channel:
    """The node's end: the current forwarded values, pushed to every connected :class:`Mirror`."""

    def __init__(self) -> None:
        # 0700: this user's processes only; in /tmp if $TMPDIR is too long for a socket's path (108 bytes)
        parent = tempfile.gettempdir() if len(tempfile.gettempdir()) < 64 else "/tmp"
        sweep_stale(parent)
        self._dir = tempfile.mkdtemp(prefix=DIR_PREFIX, dir=parent)
        self.path = os.path.join(self._dir, "channel.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(256)
        self._values: dict[str, bytes] = {}
        self._clients: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="hp-fanout-accept", daemon=True)
        self._acceptor.start()

    def update(self, changes: Mapping[str, bytes | None]) -> None:
        """Set each key to its value (None: remove it); the changes go to every client as one batch."""
        with self._lock:
            frames = []
            for key, value in changes.items():
                if self._values.get(key) != value:
                    frames.append(_frame(key, value))
                    if value is None:
                        del self._values[key]
                    else:
                        self._values[key] = value
            if frames:
                self._send(b"".join(frames))

    def _send(self, frame: bytes) -> None:  # under the lock
        for client in list(self._clients):
            try:
                client.sendall(frame)
            except OSError:  # gone, or stuck (a stopped process): it resyncs when it reconnects
                self._clients.remove(client)
                client.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            client.settimeout(SEND_TIMEOUT_S)
            with self._lock:
                if self._closed:
                    client.close()
                    return
                try:  # every current value, then "in sync"
                    client.sendall(b"".join(_frame(k, v) for k, v in self._values.items()) + _frame("", b""))
                    self._clients.append(client)
                except OSError:
                    client.close()

    def close(self) -> None:
        """Disconnect every client, remove the socket and its directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            clients, self._clients = self._clients, []
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._listener.close()
        for client in clients:
            client.close()
        self._acceptor.join(timeout=2)
        shutil.rmtree(self._dir, ignore_errors=True)


class Mirror:
    """A worker's copy of its node's channel, kept current by a reader thread; thread-safe.

    :meth:`wait` blocks until the copy changes: a value that changes nothing (a forged one, refused by
    the reader) costs one wake-up, never a loop. A lost connection is retried every ``retry_s`` (the
    values stay as they were until the channel is back, then are replaced by its snapshot).
    ``on_change(mirror)`` runs on the reader thread after each batch it applied (a harness timing arrivals)."""

    def __init__(self, path: str, timeout_s: float = 10.0, retry_s: float = 0.5,
                 on_change: Callable[[Mirror], None] | None = None) -> None:
        self.path, self._retry, self._on_change = path, retry_s, on_change
        self._values: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self.version = 0  # changes seen (a batch of frames read together counts once)
        self._synced = self._closed = False
        self._sock: socket.socket | None = self._open()
        self._reader = threading.Thread(target=self._read, name="hp-fanout-mirror", daemon=True)
        self._reader.start()
        with self._cond:
            if not self._cond.wait_for(lambda: self._synced, timeout_s):
                self.close()
                raise TimeoutError(f"the node's channel at {path} sent no snapshot in {timeout_s:g} s")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Mirror | None:
        """The mirror of the channel ``hp run`` names in :data:`FANOUT_ENV`; None without one, or if it
        cannot be reached (said on stderr): the worker then reads the job's store directly."""
        path = env.get(FANOUT_ENV)
        if not path:
            return None
        try:
            return cls(path)
        except (OSError, TimeoutError) as e:
            print(f"hp: warning: node channel {path} unreachable ({e}); reading the job's store directly",
                  file=sys.stderr, flush=True)
            return None

    def _open(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        return sock

    def get(self, key: str) -> bytes | None:
        return self._values.get(key)  # one dict read: atomic

    def keys(self, prefix: str = "") -> list[str]:
        with self._cond:
            return [k for k in self._values if k.startswith(prefix)]

    def wait(self, since: int, timeout_s: float, stop: threading.Event | None = None) -> int:
        """Block until :attr:`version` passes ``since``, ``timeout_s`` passes, or ``stop`` is set (and
        :meth:`poke` called); the version."""
        with self._cond:
            self._cond.wait_for(lambda: self.version > since or (stop is not None and stop.is_set()),
                                max(timeout_s, 0.0))
            return self.version

    def poke(self) -> None:
        """Wake every :meth:`wait` to look at its ``stop`` event."""
        with self._cond:
            self._cond.notify_all()

    def _read(self) -> None:
        buffer = bytearray()
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except (OSError, AttributeError):  # closed, or being reconnected: None
                data = b""
            if self._closed:
                return
            if not data:  # the channel went away (the agent restarts it, or dies: then nothing comes back)
                buffer.clear()
                self._reconnect()
                continue
            buffer += data
            if not self._apply(buffer):  # a frame over the bound: not this channel's; connect again
                print(f"hp: warning: node channel {self.path} sent a frame over {MAX_VALUE_BYTES} bytes; "
                      f"connecting again", file=sys.stderr, flush=True)
                buffer.clear()
                time.sleep(self._retry)
                self._reconnect()

    def _apply(self, buffer: bytearray) -> bool:
        """Apply every whole frame in ``buffer`` (removing it); False at a frame over the bound."""
        changed, ok = False, True
        with self._cond:
            while len(buffer) >= _HEADER.size:
                klen, vlen = _HEADER.unpack_from(buffer)
                if vlen != _DELETED and vlen > MAX_VALUE_BYTES:
                    ok = False
                    break
                size = _HEADER.size + klen + (0 if vlen == _DELETED else vlen)
                if len(buffer) < size:
                    break
                key = bytes(buffer[_HEADER.size:_HEADER.size + klen]).decode(errors="replace")
                if not key:
                    self._synced = True
                elif vlen == _DELETED:
                    self._values.pop(key, None)
                else:
                    self._values[key] = bytes(buffer[_HEADER.size + klen:size])
                changed = True
                del buffer[:size]
            if changed:
                self.version += 1
                self._cond.notify_all()
        if changed and self._on_change is not None:
            self._on_change(self)
        return ok

    def _reconnect(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        while not self._closed:
            try:
                sock = self._open()
            except OSError:
                time.sleep(self._retry)
                continue
            with self._cond:
                self._values.clear()  # the snapshot that follows is the whole truth
            self._sock = sock
            if self._closed:  # meanwhile
                sock.close()
            return

    def close(self) -> None:
        self._closed = True
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the reader
            except OSError:
                pass
            sock.close()
        self.poke()


class Relay:
    """One per node, in its agent: forwards the job's membership from the store to a :class:`Channel`.

    ``connect()`` makes the relay's own store client (in its thread: clients are not shared across threads);
    ``node_rank`` names this node's spares; plans are forwarded from ``start_generation`` (the one this
    node's workers start in) on. A failing store (its host gone, a partition) is connected again, backing off."""

    def __init__(self, connect: Callable[[], dist.Store], token: str, node_rank: int, start_generation: int = 1,
                 wait_s: float = RELAY_WAIT_S, log: Callable[[str], None] | None = None) -> None:
        if not token:
            raise ValueError("relaying the job's store needs the job token (HP_JOB_TOKEN)")
        self._connect, self._token, self._wait = connect, token, timedelta(seconds=wait_s)
        self._spares = spare_id(node_rank, 0)[:-1]  # "n<node>s": the ids of this node's spares start so
        self._next = max(1, start_generation)  # the generation whose plan is waited for
        self._pending: dict[str, int] = {}  # spare id -> the generation its genuine assignment is for
        self._promoted_spares: set[str] = set()  # every spare of this node a plan named (ids are never reused)
        self._retry = ASSIGNMENT_RETRY_S[0]
        self._oversized = ""  # the last key found over the bound (said once)
        self._log = log or (lambda m: print(f"hp: relay: {m}", file=sys.stderr, flush=True))
        self._stop = threading.Event()
        self.channel: Channel | None = None
        self._thread = threading.Thread(target=self._run, name="hp-fanout-relay", daemon=True)

    def start(self) -> Relay:
        self.channel = Channel()
        self._thread.start()
        return self

    def env(self) -> dict[str, str]:
        """What a worker of this node needs to reach the channel."""
        return {FANOUT_ENV: self.channel.path} if self.channel is not None else {}

    def stop(self, timeout_s: float = 0.0) -> None:
        """Close the channel now; the (daemon) thread ends once its store read does, within ``wait_s``:
        wait ``timeout_s`` at most for that (a process about to exit waits ``wait_s`` + 1: see
        :data:`RELAY_WAIT_S`)."""
        self._stop.set()
        if self.channel is not None:
            self.channel.close()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        store, backoff = None, 0.1
        while not self._stop.is_set():
            try:
                if store is None:
                    store = self._connect()
                    store.set_timeout(self._wait)  # a get blocks until its key is published, this long at most
                self._step(store)
                backoff = 0.1
            except Exception as e:  # noqa: BLE001 -- the store went away or broke: connect again
                if self._stop.is_set():
                    return
                if backoff >= 0.8:  # an outage, not the store's host leaving first at the job's end
                    self._log(f"store unreachable ({type(e).__name__}: {str(e)[:200]}); again in {backoff:g} s")
                store = None
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _step(self, store: dist.Store) -> None:
        """Forward the next plan once it is published (one blocking get), or the pending assignments."""
        import torch.distributed as dist

        key = plan_key(self._next)
        if self._pending:  # an assignment follows its plan by milliseconds: read both until it is there
            self._assignments(store)
            if self._pending and not store.check([key]):
                self._stop.wait(self._retry)
                self._retry = min(self._retry * 2, ASSIGNMENT_RETRY_S[1])
                return
        try:
            raw = store.get(key)
        except dist.DistStoreError:  # nothing new within wait_s: wait again
            return
        if len(raw) > MAX_VALUE_BYTES:  # not the controller's: not forwarded; its own replaces it
            if self._oversized != key:
                self._oversized = key
                self._log(f"{key} holds {len(raw)} bytes, over {MAX_VALUE_BYTES}: not forwarded")
            self._stop.wait(FORGED_RETRY_S)
            return
        # first, in one batch: the node's ranks learn of it before the relay's own work
        self.channel.update({key: raw, plan_key(self._next - KEEP_PLANS): None})
        try:  # the seal binds the value to the key: a genuine one is this generation's plan
            plan = unseal(self._token, key, raw)
        except ProtocolError:  # forged: the controller's own replaces it
            self._stop.wait(FORGED_RETRY_S)
            return
        if self._next > 1:  # ranks still arriving in the superseded generation: wake them
            dist.PrefixStore(arrive_prefix(self._next - 1), store).compare_set(ARRIVE_OUTCOME, "",
                                                                             ArriveOutcome.ABANDONED.value)
        for sid in self._promoted(plan) - self._promoted_spares:  # its assignment comes with its first plan
            self._pending[sid] = self._next
            self._promoted_spares.add(sid)
        self._retry = ASSIGNMENT_RETRY_S[0]
        self._next += 1
        self._assignments(store)

    def _promoted(self, plan: str) -> set[str]:
        """This node's spares holding a rank in ``plan`` (parsed only if one is named: 16k ranks take ms)."""
        if f'"{spare_holder(self._spares)}' not in plan:
            return set()
        try:
            holders = Plan.from_json(plan).holders.values()
        except ProtocolError:  # sealed yet malformed (a token holder's bug): the workers refuse it too
            return set()
        return {sid for h in holders if h == spare_holder(sid := h.removeprefix("spare."))
                and sid.startswith(self._spares) and sid[len(self._spares):].isdigit()}

    def _assignments(self, store: dist.Store) -> None:
        for sid, generation in list(self._pending.items()):
            key = spare_key(sid)
            if not store.check([key]):
                continue
            raw = store.get(key)
            if len(raw) > MAX_VALUE_BYTES:  # not the controller's (see _step)
                continue
            self.channel.update({key: raw})
            try:
                got = SpareAssignment.from_json(unseal(self._token, key, raw))
            except ProtocolError:  # forged, or not yet overwritten by the genuine one
                continue
            if got.generation >= generation:
                del self._pending[sid]

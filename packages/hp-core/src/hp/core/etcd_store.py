"""The ``etcd`` store backend: the job's rendezvous store on etcd, which no rank (and no agent) hosts.

With the ``tcp`` store the job's keys live in one process (node 0's agent, or rank 0 in a classic
``torchrun`` job): when it dies, so does every key, and no process group can form again. With
``etcd`` they live in an etcd cluster, replicated by Raft across its members: losing any one host
of the job (or one etcd member of three) loses no key, and every rank of a generation reads and
writes the same keys wherever it runs.

The store is torch's own :class:`torch.distributed.elastic.rendezvous.etcd_store.EtcdStore` (a
``dist.Store`` over etcd's v2 API, through the ``python-etcd`` client), with the parts hp needs that
it lacks: ``compare_set``, ``append``, ``delete_key`` and ``num_keys`` (the last two on the store
itself: torch 2.13's bridge from C++, e.g. a ``PrefixStore`` over it, forwards neither); waits that watch the one key
waited for (torch's reads the whole directory on every wake-up and misses keys whose base64 holds a
``/``); an ``add`` that retries a lost compare-and-swap in milliseconds, not up to 100 ms; a timeout
error that is both torch's ``DistStoreError`` (as with ``TCPStore``) and ``LookupError`` (as with
``EtcdStore``); and calls that ride out an etcd restart or a member going away until the store's
timeout (a request that could not even connect is retried; one cut off in flight is retried only
where doing it twice is harmless).

Every job has its own directory, ``/hp/jobs/<job>/kv/``, so many jobs share one etcd cluster; the
job is the ``job=`` argument of :func:`connect`, else ``$HP_STORE_JOB``, else ``default``.

Production: point hp at an existing etcd cluster (etcd >= 3.4 started with ``--enable-v2=true``,
the API torch's etcd rendezvous uses too), the way ``torchrun --rdzv-backend etcd`` is::

    hp run --store etcd --rdzv-endpoint etcd-0:2379,etcd-1:2379,etcd-2:2379 --run-id my-job ...

Each ``HOST[:PORT]`` is one member's client URL (port 2379 where none is given); a client moves to
the next member when one stops answering. (``hp run`` wiring: the agent connects to the endpoint
instead of serving a store, and passes its run id as ``job``; see :class:`EtcdStoreBackend`.)

Tests and single-node runs: :meth:`EtcdStoreBackend.serve` (``hp run --store etcd`` without an
endpoint) starts a private etcd (the Debian ``etcd-server`` package's binary, ``apt-get install
etcd-server``; ``$HP_ETCD_BIN`` overrides) on free loopback ports, with its data in a new 0700
directory that :meth:`EtcdServer.stop` removes. It survives any rank; it does not survive its host.

Security: etcd serves whoever reaches its client port. Bind a private etcd to loopback or the
job's private network only (``serve`` binds the one interface asked for); a shared cluster should
use etcd's TLS client certificates and RBAC (not wired here yet), and hp signs the values workers
act on whatever the store.
"""

from __future__ import annotations

import base64
import datetime
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

from hp.core.config import check_name
from hp.core.errors import BackendUnavailableError

try:
    import etcd  # python-etcd (pip install 'hp-core[etcd]')
except ModuleNotFoundError:  # torch's etcd_store then imports a stub whose every call fails
    etcd = None

JOB_ENV = "HP_STORE_JOB"
ETCD_BIN_ENV = "HP_ETCD_BIN"
DEFAULT_PORT = 2379
DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)  # c10d's default store timeout

T = TypeVar("T")
_WRITES = ("set", "create", "update", "compareAndSwap")  # v2 watch actions that leave the key holding a value


def job_prefix(job: str) -> str:
    """The etcd directory of one job's keys."""
    return f"/hp/jobs/{check_name(job, 'store job')}/kv/"


def parse_endpoints(host: str, port: int = DEFAULT_PORT) -> list[tuple[str, int]]:
    """``"h1:2379,h2,[::1]:2379"`` (``port`` where an entry names none) -> ``[(host, port), ...]``."""
    found = []
    for item in (s.strip() for s in host.split(",")):
        if not item:
            continue
        if item.startswith("["):  # [v6]:port
            h, _, rest = item[1:].partition("]")
            found.append((h, int(rest[1:]) if rest.startswith(":") else port))
        elif item.count(":") == 1:
            h, p = item.split(":")
            found.append((h, int(p)))
        else:  # a name, a v4 address, or a bare v6 address
            found.append((item, port))
    if not found:
        raise ValueError(f"no etcd endpoint in {host!r}")
    return found


class EtcdStoreTimeout(dist.DistStoreError, LookupError):
    """Keys not published within the store's timeout."""


def _unsent(e: Exception) -> bool:
    """The request never reached etcd (connection refused or timed out while connecting), so
    repeating it cannot apply it twice."""
    cause = getattr(e, "cause", None)
    reason = getattr(cause, "reason", cause)  # urllib3's MaxRetryError wraps the first failure
    import urllib3.exceptions as u

    return isinstance(reason, (u.NewConnectionError, u.ConnectTimeoutError, ConnectionRefusedError))


class HpEtcdStore(EtcdStore):
    """torch's ``EtcdStore`` completed for hp (see the module docstring), over one or more etcd
    members. Keys are ``<prefix>k<urlsafe base64 of the key>``: one flat directory, no hidden
    (``_``-first) names, no ``/`` inside a key's name."""

    def __init__(self, clients: list, prefix: str, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__(clients[0], prefix, timeout)
        self._clients = list(clients)

    # ---- keys and values -------------------------------------------------------------
    def _path(self, key: str | bytes) -> str:
        raw = key.encode() if isinstance(key, str) else bytes(key)
        return self.prefix + "k" + base64.urlsafe_b64encode(raw).decode()

    def _value(self, value: str | bytes | list[int]) -> str:
        return self._encode(value if isinstance(value, (str, bytes)) else bytes(value))

    # ---- calls that ride out a member going away --------------------------------------
    def call(self, fn: Callable[[], T], deadline: float | None = None, idempotent: bool = True) -> T:
        """``fn()`` against the current member; on a connection failure move to the next member and
        try again until ``deadline`` (default: the store's timeout from now). A write that may have
        reached etcd is repeated only when ``idempotent``."""
        deadline = time.monotonic() + self.timeout.total_seconds() if deadline is None else deadline
        pause = 0.01
        while True:
            try:
                return fn()
            except etcd.EtcdWatchTimedOut:
                raise
            except etcd.EtcdConnectionFailed as e:
                if not (idempotent or _unsent(e)) or time.monotonic() + pause >= deadline:
                    raise
                if len(self._clients) > 1:
                    self._clients.append(self._clients.pop(0))
                    self.client = self._clients[0]
                time.sleep(pause)
                pause = min(pause * 2, 0.5)

    # ---- the c10d Store API ----------------------------------------------------------
    def set(self, key, value) -> None:
        path, v = self._path(key), self._value(value)
        self.call(lambda: self.client.write(path, v))

    def get(self, key) -> bytes:
        path = self._path(key)
        return self._decode(self._wait_values([path], self.timeout, key)[path])

    def wait(self, keys, override_timeout: datetime.timedelta | None = None) -> None:
        self._wait_values([self._path(k) for k in keys], override_timeout or self.timeout, keys)

    def check(self, keys) -> bool:
        return all(self._read(self._path(k)) is not None for k in keys)

    def add(self, key, num: int) -> int:
        path = self._path(key)
        while True:
            node = self._read(path)
            if node is None:
                try:  # absent: create it with num (0 + num), unless another process just did
                    node = self.call(lambda: self.client.write(path, self._value(str(num)), prevExist=False),
                                      idempotent=False)
                    return int(self._decode(node.value))
                except etcd.EtcdAlreadyExist:
                    continue
            current = int(self._decode(node.value))
            if num == 0:  # a read: no write, no contention
                return current
            new = self._value(str(current + num))
            try:
                self.call(lambda n=node: self.client.test_and_set(path, new, prev_value=n.value), idempotent=False)
                return current + num
            except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
                time.sleep(random.uniform(0, 0.002))  # another writer won this round

    def compare_set(self, key, expected, desired) -> bytes:
        """c10d semantics: set ``desired`` if the value is ``expected`` (an absent key matches an
        empty ``expected``) and return it; else return the current value (``expected`` when absent)."""
        path = self._path(key)
        expected_b = expected.encode() if isinstance(expected, str) else bytes(expected)
        desired_b = desired.encode() if isinstance(desired, str) else bytes(desired)
        while True:
            node = self._read(path)
            if node is None:
                if expected_b:
                    return expected_b
                try:
                    self.call(lambda: self.client.write(path, self._value(desired_b), prevExist=False),
                               idempotent=False)
                    return desired_b
                except etcd.EtcdAlreadyExist:
                    continue
            current = self._decode(node.value)
            if current != expected_b:
                return current
            try:
                self.call(lambda n=node: self.client.test_and_set(path, self._value(desired_b), prev_value=n.value),
                           idempotent=False)
                return desired_b
            except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
                continue

    def append(self, key, value) -> None:
        path, extra = self._path(key), (value.encode() if isinstance(value, str) else bytes(value))
        while True:
            node = self._read(path)
            try:
                if node is None:
                    self.call(lambda: self.client.write(path, self._value(extra), prevExist=False), idempotent=False)
                else:
                    new = self._value(self._decode(node.value) + extra)
                    self.call(lambda n=node: self.client.test_and_set(path, new, prev_value=n.value),
                               idempotent=False)
                return
            except (etcd.EtcdAlreadyExist, etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
                continue

    def delete_key(self, key) -> bool:
        path = self._path(key)
        try:
            self.call(lambda: self.client.delete(path))
            return True
        except etcd.EtcdKeyNotFound:
            return False

    def num_keys(self) -> int:
        try:
            listing = self.call(lambda: self.client.read(self.prefix, recursive=True))
        except etcd.EtcdKeyNotFound:
            return 0
        return sum(1 for n in listing.leaves if not n.dir and n.key != listing.key)

    # ---- reads and waits -------------------------------------------------------------
    def _read(self, path: str, deadline: float | None = None):
        """The node at ``path`` or None."""
        try:
            return self.call(lambda: self.client.read(path), deadline)
        except etcd.EtcdKeyNotFound:
            return None

    def _wait_values(self, paths: list[str], timeout: datetime.timedelta, keys) -> dict[str, str]:
        """Every path's (encoded) value, waiting for the missing ones with a watch on each in turn
        (from the index at which it was found absent, so a write in between is never missed)."""
        deadline = time.monotonic() + timeout.total_seconds()
        found: dict[str, str] = {}
        for path in paths:
            while path not in found:
                try:
                    found[path] = self.call(lambda p=path: self.client.read(p), deadline).value
                    break
                except etcd.EtcdKeyNotFound as e:
                    index = int((e.payload or {}).get("index", 0))
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EtcdStoreTimeout(f"EtcdStore: timed out after {timeout.total_seconds():g} s waiting for "
                                           f"key(s) {keys!r} under {self.prefix}")
                try:
                    event = self.client.watch(path, index=index + 1, timeout=remaining)
                    if event.action in _WRITES and event.key == path:  # the write waited for: its value
                        found[path] = event.value
                except (etcd.EtcdWatchTimedOut, etcd.EtcdEventIndexCleared):
                    pass  # read again: the deadline decides
                except etcd.EtcdConnectionFailed:
                    time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return found


# Every store made here stays referenced for the life of the process. A Python store passed to
# ``init_process_group`` (or wrapped in a ``PrefixStore``) is held from C++ by its C++ half only: once
# the caller drops its last Python reference, the Python half is freed and the group's next store
# call fails ("Not implemented"), where a TCPStore would just work. Stores are small and share one
# HTTP client (one connection pool) per etcd member and process.
_LIVE: list[HpEtcdStore] = []
_CLIENTS: dict[tuple[str, int], object] = {}
_LOCK = threading.Lock()


def _forget_clients() -> None:  # a forked child must not share its parent's pooled connections
    global _LOCK
    _LOCK = threading.Lock()
    _CLIENTS.clear()


os.register_at_fork(after_in_child=_forget_clients)


def _client(host: str, port: int):
    with _LOCK:
        if (host, port) not in _CLIENTS:
            # read_timeout bounds one plain request; a watch passes its own (the time left to wait)
            _CLIENTS[(host, port)] = etcd.Client(host=host, port=port, protocol="http", read_timeout=30,
                                                 allow_reconnect=False, per_host_pool_size=16)
        return _CLIENTS[(host, port)]


def connect(host: str, port: int = DEFAULT_PORT, timeout: datetime.timedelta = DEFAULT_TIMEOUT,
            job: str | None = None) -> HpEtcdStore:
    """A store of ``job``'s keys on the etcd member(s) ``host`` (``HOST[:PORT][,HOST[:PORT]...]``)."""
    if etcd is None:
        raise BackendUnavailableError("store 'etcd' needs the python-etcd client: pip install 'hp-core[etcd]'")
    clients = [_client(h, p) for h, p in parse_endpoints(host, port)]
    store = HpEtcdStore(clients, job_prefix(job or os.environ.get(JOB_ENV) or "default"), timeout)
    with _LOCK:
        _LIVE.append(store)
    return store


# ---- a real etcd process: tests, benchmarks, single-node jobs ---------------------------------------

def etcd_binary() -> str:
    exe = shutil.which(os.environ.get(ETCD_BIN_ENV, "etcd"))
    if exe is None:
        raise BackendUnavailableError("store 'etcd' needs the etcd server to serve one: apt-get install etcd-server "
                                      f"(or set ${ETCD_BIN_ENV}), or point hp at an existing etcd cluster")
    return exe


def etcd_version() -> str | None:
    try:
        out = subprocess.run([etcd_binary(), "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired, BackendUnavailableError):
        return None
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("etcd Version")), None)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class EtcdServer:
    """One real single-member etcd: ``with EtcdServer() as e: connect(e.host, e.port)``.

    Client and peer URLs on ``host`` only (free ports unless ``port`` is given), v2 API on, data in
    a new 0700 directory (``workdir`` or a temporary one) that :meth:`stop` removes; its own
    session, stopped by PID. ``die_with_parent``: etcd is SIGKILLed by the kernel when the thread
    that started it ends (``setpriv --pdeathsig``), so a SIGKILLed test or benchmark leaves no etcd
    behind; only for a server started from a thread that lives as long as it should."""

    ATTEMPTS = 5  # a free port can be taken between choosing it and etcd binding it

    def __init__(self, host: str = "127.0.0.1", port: int = 0, workdir: str | None = None,
                 die_with_parent: bool = False) -> None:
        self.host, self.port, self.peer_port = host, port, 0
        self.die_with_parent = die_with_parent
        self.dir = Path(tempfile.mkdtemp(prefix="hp-etcd-", dir=workdir))  # mode 0700
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.dir / "etcd.log"

    def start(self, timeout: float = 30.0) -> EtcdServer:
        from hp.core.procs import free_port

        exe, fixed = etcd_binary(), self.port
        try:
            for _ in range(self.ATTEMPTS):
                self.port = fixed or free_port(self.host)
                self.peer_port = free_port(self.host)
                if self.peer_port == self.port:
                    continue
                if self._launch(exe, timeout):
                    return self
            raise RuntimeError(f"etcd did not start on {self.host} in {self.ATTEMPTS} attempts: "
                               f"{self._log_tail()}")
        except BaseException:
            self.stop()
            raise

    def _launch(self, exe: str, timeout: float) -> bool:
        client, peer = _url(self.host, self.port), _url(self.host, self.peer_port)
        data = self.dir / "data"
        shutil.rmtree(data, ignore_errors=True)
        args = [exe, "--name", "hp", "--data-dir", str(data),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"hp={peer}", "--initial-cluster-state", "new",
                "--enable-v2=true", "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"]
        if self.die_with_parent and shutil.which("setpriv"):
            args = [shutil.which("setpriv"), "--pdeathsig", "KILL", "--", *args]  # execs etcd: same pid
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, cwd=self.dir, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False  # most likely a port taken meanwhile: the caller tries others
            try:
                with opener.open(f"{client}/v2/keys/", timeout=1) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.02)
        raise TimeoutError(f"etcd on {client} not serving after {timeout:g} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def pause(self) -> None:
        """SIGSTOP etcd (a store outage, for fault injection); :meth:`resume` continues it."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)  # a paused etcd must not ignore the kill
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    close = stop  # a StoreServer closes what it keeps alive

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

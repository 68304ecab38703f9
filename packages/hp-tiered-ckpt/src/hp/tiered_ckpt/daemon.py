"""The per-node checkpoint daemon (``hp ckpt daemon``): owns the memory tier of its node.

Workers ask it for a staging slot, copy their tensors into it and *seal* it; from then on the
daemon owns the bytes: it checksums them, replicates them to ``replicas`` peer daemons and uploads
them to the persistent tier, all off the training loop. Every frame is signed with the job token
(:mod:`hp.tiered_ckpt.wire`: header and payload MACs, a replay window, replies bound to requests);
``peers`` and ``gc`` need the daemon's admin key (``<root>/admin.key``, 0600). The daemon binds the
address it is given (127.0.0.1 by default).
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from hp.core.auth import ReplayWindow
from hp.tiered_ckpt import fmt, wire
from hp.tiered_ckpt.persist import PersistentTier
from hp.tiered_ckpt.store import FileRec, MemoryStore

log = logging.getLogger("hp.tiered_ckpt.daemon")
MAX_CONNECTIONS = 256  # workers keep one open each, peers a few: a node holds far fewer


@dataclass
class DaemonConfig:
    root: Path
    token: str = field(repr=False)
    host: str = "127.0.0.1"
    port: int = 0
    peers: list[tuple[str, int]] = field(default_factory=list)  # other nodes' daemons, ring order
    replicas: int = 1
    keep_memory: int = 2
    keep_persistent: int = 3
    retry_max_s: float = 10.0
    admin_key: str | None = field(default=None, repr=False)  # signs `peers`/`gc`; None: a random one, written to <root>/admin.key
    idle_timeout_s: float = 600.0  # a connection with no frame started for this long is closed
    frame_timeout_s: float = 30.0  # a started frame's header must arrive within this; each later read too
    replay_cap: int = 100_000      # nonces remembered within auth.MAX_CLOCK_SKEW_S (about 220 bytes each)


class Daemon:
    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self.store = MemoryStore(cfg.root, keep=cfg.keep_memory)
        # `peers` redirects replication and `gc` drops steps: not for every job-token holder (every
        # worker and every peer daemon holds it), only for whoever started this daemon or can read its key file
        self.admin_key = cfg.admin_key or secrets.token_hex(32)
        if self.admin_key == cfg.token:
            raise ValueError("the admin key must differ from the job token")
        self.admin_key_file = wire.write_admin_key(cfg.root, self.admin_key)
        self.replay = ReplayWindow(cap=cfg.replay_cap)
        self.work: queue.Queue = queue.Queue()        # checksums, then replication
        self.uploads: queue.Queue = queue.Queue()     # persistent tier, never blocks the above
        self.events: list[dict] = []                  # upload attempts/failures/commits, for status
        self._tiers: dict[tuple[str, str], PersistentTier] = {}
        self.newest_persist: dict[str, int] = {}      # newest step queued for upload, per namespace
        self._waiting: list[dict] = []                # upload jobs queued and not started (store.lock)
        serve = self._serve  # the handler's: one connection's frames

        slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                if not slots.acquire(blocking=False):  # a flood of connections gets closed, not a thread each
                    log.warning("refused a connection: %d already open", MAX_CONNECTIONS)
                    return
                try:
                    serve(self.request)
                finally:
                    slots.release()

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server((cfg.host, cfg.port), Handler)
        self.address = self.server.server_address[:2]
        for target in (self._work_loop, self._upload_loop):
            threading.Thread(target=target, daemon=True).start()

    def serve_forever(self) -> None:
        self.server.serve_forever(poll_interval=0.2)

    def _event(self, kind: str, **kw) -> None:
        self.events.append({"event": kind, "time": time.time(), **kw})
        del self.events[:-200]

    # --- requests --------------------------------------------------------------------------------
    def _serve(self, sock: socket.socket) -> None:
        """Frames until the peer hangs up or idles past ``idle_timeout_s``: workers keep one connection
        open across saves (and reconnect once it was closed). A frame is verified with the job token,
        then the admin key; ``peers`` and ``gc`` need the admin key. A reply is signed with the key of
        its request and carries its nonce; a seen nonce (a replayed frame) closes the connection."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keys = (self.cfg.token, self.admin_key)
        while True:
            try:
                head = wire.recv_header(sock, keys, self.replay, idle_timeout=self.cfg.idle_timeout_s,
                                        frame_timeout=self.cfg.frame_timeout_s)
            except wire.IdleError as e:
                log.debug("connection closed: %s", e)
                return
            except wire.WireError as e:
                log.warning("refused a connection: %s", e)
                return
            except OSError as e:
                log.warning("connection error: %s", e)
                return
            op, reply = head.get("op"), None
            try:
                handler = getattr(self, f"_op_{op}", None) if isinstance(op, str) else None
                if handler is None:
                    raise ValueError(f"unknown op {op!r}")
                if op in wire.ADMIN_OPS and head.key_index != 1:
                    raise ValueError(f"needs the daemon's admin key ({self.admin_key_file}), not the job token")
                reply, payload = handler(sock, head)
            except (ValueError, KeyError, TypeError, TimeoutError) as e:  # refused, with the reason
                error = f"{op}: {e}"
            except (wire.WireError, OSError) as e:
                log.warning("%s failed: %s", op, e)
                return
            try:
                if reply is None:
                    wire.reply(sock, head, {"ok": False, "error": error})
                else:
                    wire.reply(sock, head, {"ok": True, **reply}, payload)
            except (wire.WireError, OSError) as e:
                log.warning("reply to %s failed: %s", op, e)
                return
            if head.pending:  # a payload the handler did not read: the next frame cannot be found
                log.warning("%s left its payload unread; closing the connection", op)
                return

    def _op_ping(self, sock, h):
        return {"address": list(self.address)}, None

    def _op_slot(self, sock, h):
        path = self.store.acquire_slot(h["ns"], int(h["rank"]), int(h["step"]), int(h["size"]))
        return {"path": path}, None

    def _op_seal(self, sock, h):
        f = self.store.seal(h["ns"], int(h["rank"]), int(h["step"]), int(h["world"]), h["path"],
                            int(h["size"]), h["spans"], h.get("persist_url"), h["save_id"])
        self.work.put(("file", h["ns"], int(h["step"]), f, h.get("persist_url"), f.save_id))
        return {}, None

    def _op_commit(self, sock, h):
        blob = wire.recv_payload(sock, h, wire.MAX_HEADER * 16)
        rec = self.store.put_meta(h["ns"], int(h["step"]), int(h["world"]), h["meta"], blob, primary=True,
                                  save_id=h["save_id"])
        rec.persist_url = h.get("persist_url") or rec.persist_url
        self.work.put(("meta", h["ns"], int(h["step"]), None, rec.persist_url, h["save_id"]))
        return {}, None

    def _op_put_meta(self, sock, h):
        blob = wire.recv_payload(sock, h, wire.MAX_HEADER * 16)
        self.store.put_meta(h["ns"], int(h["step"]), int(h["world"]), h["meta"], blob, primary=False,
                            save_id=h["save_id"])
        return {}, None

    def _op_put(self, sock, h):
        self.store.put_replica(h["ns"], int(h["step"]), int(h["world"]), int(h["rank"]), h["items"],
                               h["nbytes"], h["save_id"], lambda out: wire.recv_payload_into(sock, h, out))
        return {}, None

    def _op_list(self, sock, h):
        return {"steps": self.store.listing(h["ns"])}, None

    def _op_manifest(self, sock, h):
        return self.store.manifest(h["ns"], int(h["step"])), None

    def _op_fetch(self, sock, h):
        f = self.store.file(h["ns"], int(h["step"]), int(h["rank"]), h.get("save_id"))
        off, n = int(h["offset"]), int(h["length"])
        with open(f.path, "rb") as fh:
            fh.seek(off)
            return {}, fh.read(n)

    def _op_peers(self, sock, h):
        """Set the other nodes' daemons (ring order): ``hp run --service ckpt`` learns them only after
        every node's daemon is listening. Replaced as one list, so a replication in flight sees
        either the old ring or the new one. Admin key only (:meth:`_serve`): it redirects replication."""
        peers = [wire.parse_addr(p) for p in h["peers"]]
        self.cfg.peers = peers
        return {"peers": [list(p) for p in peers]}, None

    def _op_gc(self, sock, h):
        """Retention by hand (``hp ckpt gc --daemon``); admin key only (:meth:`_serve`)."""
        return {"removed": self.store.gc(h["ns"], int(h["keep"]))}, None

    def _op_status(self, sock, h):
        return {"namespaces": self.store.namespaces(), "events": self.events[-50:],
                "peers": [list(p) for p in self.cfg.peers]}, None

    # --- background work -------------------------------------------------------------------------
    def _work_loop(self) -> None:
        while True:
            kind, ns, step, f, url, save_id = self.work.get()
            try:
                if kind == "file":
                    self.store.checksum(f)
                    self._replicate_file(ns, step, f)
                else:
                    self._replicate_meta(ns, step)
                if url:
                    entry = {"job": (kind, ns, step, f, url, save_id), "released": False}
                    with self.store.lock:  # pinned until uploaded or superseded: the slot keeps its bytes
                        if f is not None:
                            f.busy += 1
                        else:
                            self.store.steps[ns][step].pinned += 1
                        self.newest_persist[ns] = max(self.newest_persist.get(ns, -1), step)
                        self._release_superseded(ns)
                        self._waiting.append(entry)
                    self.uploads.put(entry)
            except Exception as e:  # a bad item must not stop the daemon
                log.exception("background %s of step %d failed: %s", kind, step, e)
                self._event("error", ns=ns, step=step, error=str(e))
            finally:
                if f is not None:
                    with self.store.lock:
                        self.store.lock.notify_all()

    def _targets(self) -> list[tuple[str, int]]:
        return self.cfg.peers[:max(self.cfg.replicas, 0)]

    def _replicate_file(self, ns: str, step: int, f: FileRec) -> None:
        rec = self.store.steps[ns][step]
        with self.store.lock:
            f.busy += 1
        try:
            for peer in self._targets():
                head = {"op": "put", "ns": ns, "step": step, "world": rec.world, "rank": f.rank, "items": f.items,
                        "save_id": f.save_id}
                try:
                    with open(f.path, "rb") as fh:
                        # one pass over the slot: the payload MAC is computed while it streams
                        wire.request(peer, self.cfg.token, head, fh, timeout=60, nbytes=f.nbytes)
                    self._event("replicated", ns=ns, step=step, rank=f.rank, peer=list(peer))
                except (OSError, wire.WireError) as e:
                    log.warning("replica of step %d rank %d to %s failed: %s", step, f.rank, peer, e)
                    self._event("replica_failed", ns=ns, step=step, rank=f.rank, error=str(e))
        finally:
            with self.store.lock:
                f.busy -= 1
                self.store.trim(ns)

    def _replicate_meta(self, ns: str, step: int) -> None:
        rec = self.store.steps[ns][step]
        for peer in self.cfg.peers:  # metadata is small: every daemon gets it
            try:
                wire.request(peer, self.cfg.token, {"op": "put_meta", "ns": ns, "step": step,
                                                    "world": rec.world, "meta": rec.meta_json, "save_id": rec.save_id},
                             rec.meta_pickle, timeout=30)
            except (OSError, wire.WireError) as e:
                log.warning("metadata of step %d to %s failed: %s", step, peer, e)

    def _superseded(self, ns: str, step: int, save_id: str) -> bool:
        """A newer step of the namespace is queued for upload, or a newer save of this step arrived:
        uploading this one is wasted work (and would keep its slot pinned through an outage); the
        newest is what a restart wants."""
        rec = self.store.steps.get(ns, {}).get(step)
        return self.newest_persist.get(ns, step) > step or rec is None or rec.latest_id != save_id

    def _unpin(self, ns: str, step: int, f: FileRec | None) -> None:
        """Caller holds store.lock."""
        if f is not None:
            f.busy -= 1
        else:
            self.store.steps[ns][step].pinned -= 1
        self.store.trim(ns)  # retention skipped this step while it was pinned
        self.store.lock.notify_all()

    def _release_superseded(self, ns: str) -> None:
        """Unpin queued uploads a newer step made pointless, now, not when the upload thread gets to
        them: during an outage it hangs in one PUT, and a save waiting for their slots would stall
        training. Caller holds store.lock."""
        for entry in [e for e in self._waiting if e["job"][1] == ns and self._superseded(ns, e["job"][2], e["job"][5])]:
            kind, _, step, f, _, _ = entry["job"]
            entry["released"] = True
            self._waiting.remove(entry)
            self._unpin(ns, step, f)
            self._event("persist_superseded", ns=ns, step=step, job=kind)

    def _upload_loop(self) -> None:
        while True:
            entry = self.uploads.get()
            with self.store.lock:
                if entry["released"]:
                    continue
                self._waiting.remove(entry)
            job = entry["job"]
            try:
                self._upload_job(job)
            except Exception as e:  # a bug in one job must not end persistence for the daemon's life
                log.exception("upload job %s failed: %s", job[:3], e)
                self._event("error", ns=job[1], step=job[2], error=str(e)[:300])

    def _upload_job(self, job: tuple) -> None:
        kind, ns, step, f, url, save_id = job
        delay = 0.5
        try:
            while True:  # retry with backoff until it lands or a newer step supersedes it
                if self._superseded(ns, step, save_id):
                    self._event("persist_superseded", ns=ns, step=step, job=kind)
                    break
                try:
                    self._upload(*job)
                    break
                except Exception as e:
                    self._tiers.pop((url, ns), None)  # a fresh client after a failure
                    self._event("upload_retry", ns=ns, step=step, error=str(e)[:300])
                    log.warning("upload of step %d failed (%s); retrying in %.1f s", step, e, delay)
                    time.sleep(delay)
                    delay = min(delay * 2, self.cfg.retry_max_s)
        finally:
            with self.store.lock:
                self._unpin(ns, step, f)

    def _tier(self, url: str, ns: str) -> PersistentTier:
        """One filesystem client per (url, namespace): an s3fs client costs a session setup."""
        key = (url, ns)
        if key not in self._tiers:
            self._tiers[key] = PersistentTier(url, ns, self.cfg.token)
        return self._tiers[key]

    def _upload(self, kind: str, ns: str, step: int, f: FileRec | None, url: str, save_id: str) -> None:
        """One rank's file then its signed manifest, or the metadata then the commit marker. Signing
        happens here, in the daemon's upload thread, off the training loop."""
        tier = self._tier(url, ns)
        rec = self.store.steps[ns][step]
        tier.uncommit(step, save_id)  # another save's marker goes before any of this save's files land
        if kind == "file":
            tier.put_file(step, fmt.rank_file(f.rank), f.path, f.nbytes)
            # the manifest goes after the data: the committer waits for every manifest of this save
            tier.put_signed(step, fmt.rank_manifest(f.rank), f.manifest())
            self._event("uploaded", ns=ns, step=step, rank=f.rank)
            return
        meta_json, meta_pickle = rec.meta_json, rec.meta_pickle
        if rec.save_id != save_id:
            return  # a newer save of the step replaced the metadata: its own job commits it
        tier.put_bytes(step, fmt.DCP_METADATA, meta_pickle)
        tier.put_signed(step, fmt.META_JSON, {**meta_json, "save_id": save_id})
        deadline = time.monotonic() + 3600
        while True:
            try:
                tier.commit(step, rec.world, save_id)
                break
            except FileNotFoundError:
                if time.monotonic() > deadline or self._superseded(ns, step, save_id):
                    raise
                time.sleep(0.2)
        rec.persisted = True
        self._event("committed", ns=ns, step=step)
        removed = tier.gc(self.cfg.keep_persistent)
        if removed:
            self._event("persistent_gc", ns=ns, removed=removed)


def _exit_with(parent_pid: int) -> None:
    """Leave when the process that started this daemon (``hp run``'s agent) is gone: a node whose
    agent was killed must not keep a memory tier that nobody will read, or its port."""
    while os.getppid() == parent_pid:
        time.sleep(0.2)
    log.warning("parent %d is gone; exiting", parent_pid)
    os._exit(0)


def main(cfg: DaemonConfig, ready_file: str | None = None, parent_pid: int | None = None) -> None:
    if parent_pid is not None:
        threading.Thread(target=_exit_with, args=(parent_pid,), daemon=True).start()
    d = Daemon(cfg)
    host, port = d.address
    line = f"hp ckpt daemon listening on {host}:{port}"
    print(line, flush=True)
    if ready_file:
        Path(ready_file).write_text(f"{host}:{port}\n")
    d.serve_forever()

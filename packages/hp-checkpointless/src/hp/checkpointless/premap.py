"""A source's mappings of its node's hot spares' receive buffers, made before any failure.

A same-node hydration packs the state straight into the spare's shared buffer (:mod:`hp.checkpointless.shm`).
Mapping that buffer costs page-table work in proportion to its size: for 328 MB ~35 ms with
``MAP_POPULATE``, after which the first write to each page faults once more (the pack then runs at
~2/3 of memcpy speed); ~65 ms with ``MADV_POPULATE_WRITE``, after which it runs at memcpy speed. Done
when the failure comes, that is most of the hydration. So it is done before:

* a spare offers its buffer as soon as it has one, in its node's log folder (``offers/<spare id>.json``,
  0600 in a 0700 folder of this user's: pid, fd, size as JSON, sealed with the job token for that file's
  name, :mod:`hp.core.signed_values`), and withdraws the offer once it holds a rank;
* the two lowest ranks of each node (where a same-node hydration comes from, unless both are behind;
  :meth:`Agreement.source_for <hp.checkpointless.agreement.Agreement.source_for>`) look at that folder at
  every step boundary (one ``stat``; nothing is asked of any server) and map each new offer in a
  background thread; a mapping whose spare is gone is dropped (it would keep the spare's memory alive);
* the hydration takes the mapping that matches the offer the spare then sends over the group, and the
  source unmaps it at its next step boundary (:meth:`Premaps.hold`): unmapping 328 MB costs ~10 ms, and
  while it runs no other thread of the source can fault a page in, so unmapping at once would hold up
  the hydration's last messages, which gloo's threads send.

The file is only a hint of what to map early, and one not sealed by this job (forged, of another job,
moved to another spare's name) is skipped. What is packed into is decided by the offer from the group,
and a mapping is used only if ``/proc/<pid>/fd/<fd>`` is still the very file it mapped (device and
inode); the checks of :meth:`SharedBuffer.attach <hp.checkpointless.shm.SharedBuffer.attach>` (one of
hp's receive buffers, of this user's, large enough) hold for it as for any attach.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from hp.checkpointless import shm
from hp.core.signed_values import seal, unseal

_NAME = re.compile(r"n\d{1,6}s\d{1,9}")  # a spare id (hp.core.protocol.spare_id): the offer file's name
_MAX_FILE = 4096
_TICK_NS = 1_000_000_000


class Premaps:
    """The offers folder of a node, as a spare (:meth:`offer`, :meth:`withdraw`) and as a source
    (:meth:`poll` at step boundaries while :attr:`active`, :meth:`take` in a hydration)."""

    def __init__(self, folder: str, token: str) -> None:
        if not token:
            raise ValueError("offers are sealed with the job token (HP_JOB_TOKEN)")
        self.folder, self._token = folder, token
        self.active = False  # this rank is one a same-node hydration comes from (set after each formation)
        self._seen_ns = -1  # the folder's mtime when last read
        self._maps: dict[tuple[int, int], _Mapping] = {}
        self._held: list[shm.SharedBuffer] = []  # packed into by a hydration: unmapped at the next step boundary

    # ---- a spare ----------------------------------------------------------------------------
    def offer(self, spare_id: str, buf: shm.SharedBuffer) -> None:
        """Say where this spare's buffer is (best effort: without the file a source maps it when the failure
        comes, as it always could)."""
        if not _NAME.fullmatch(spare_id):
            raise ValueError(f"a spare id names the offer file: n<node>s<k>, got {spare_id!r}")
        try:
            self._private_folder()
            path = self._path(spare_id)
            tmp = f"{path}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                pid, fdnum, size = buf.offer().tolist()
                f.write(seal(self._token, _key(spare_id), json.dumps({"pid": pid, "fd": fdnum, "size": size})))
            os.replace(tmp, path)
        except OSError:
            pass

    def withdraw(self, spare_id: str) -> None:
        if _NAME.fullmatch(spare_id):
            try:
                os.unlink(self._path(spare_id))
            except OSError:
                pass

    # ---- a source ---------------------------------------------------------------------------
    def poll(self) -> None:
        """At a step boundary: map new offers (in the background), drop the mappings of spares gone or
        promoted, unmap what a hydration packed into. One ``stat`` when nothing changed for a second;
        nothing on an inactive rank without mappings."""
        while self._held:
            self._held.pop().close()
        if not self.active:
            self._drop_maps()
            return
        try:
            seen = os.stat(self.folder).st_mtime_ns
        except OSError:
            seen = -1
        # a folder's mtime moves in coarse ticks: one changed twice within a tick looks unchanged, so a
        # recent one is read again
        settled = time.time_ns() - seen > _TICK_NS
        if seen == self._seen_ns and settled and all(_alive(m.pid) for m in self._maps.values()):
            return
        self._seen_ns = seen
        offered = dict(self._offers()) if seen >= 0 else {}
        for key in [k for k, m in self._maps.items() if offered.get(k) != m.size or not _alive(m.pid)]:
            self._maps.pop(key).close()
        for key, size in offered.items():
            if key not in self._maps and _alive(key[0]):  # a SIGKILLed spare's file stays: skipped
                self._maps[key] = _Mapping(*key, size)

    def take(self, offer: torch.Tensor, nbytes: int) -> shm.SharedBuffer | None:
        """The buffer mapped early for this offer from the group (None: none, or no longer the same file);
        the caller closes it after packing."""
        pid, fd, size = (int(v) for v in offer.tolist())
        m = self._maps.pop((pid, fd), None)
        if m is None:
            return None
        buf = m.result()
        if buf is None or buf.size < nbytes or size != m.size or not m.same_file():
            if buf is not None:
                buf.close()
            return None
        buf.early = True  # mapped before the failure (what the source's hydration_sent event says)
        return buf

    def hold(self, buf: shm.SharedBuffer) -> None:
        """A buffer this rank packed a hydration into: unmapped at the next :meth:`poll`, not now."""
        self._held.append(buf)

    def wait_mapped(self, timeout: float | None = None) -> int:
        """Wait for the mappings under way (what the steps between a spare's offer and a failure give them
        time for); returns how many are mapped."""
        return sum(m.result(timeout) is not None for m in self._maps.values())

    def close(self) -> None:
        self._drop_maps()
        while self._held:
            self._held.pop().close()

    def _drop_maps(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()
        self._seen_ns = -1

    # ---- the folder -------------------------------------------------------------------------
    def _path(self, spare_id: str) -> str:
        return os.path.join(self.folder, f"{spare_id}.json")

    def _private_folder(self) -> None:
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        st = os.lstat(self.folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise OSError(f"{self.folder} is not a private folder of this user's")

    def _offers(self) -> Iterator[tuple[tuple[int, int], int]]:
        """(pid, fd) -> size of each well-formed offer file of this user's; anything else is skipped."""
        try:
            names = [n for n in os.listdir(self.folder) if n.endswith(".json") and _NAME.fullmatch(n[:-5])]
        except OSError:
            return
        for name in names:
            try:
                fd = os.open(os.path.join(self.folder, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                with os.fdopen(fd) as f:
                    st = os.fstat(f.fileno())
                    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > _MAX_FILE:
                        continue
                    o = json.loads(unseal(self._token, _key(name[:-5]), f.read()))
                pid, fdnum, size = o["pid"], o["fd"], o["size"]
                if all(type(v) is int and v > 0 for v in (pid, size)) and type(fdnum) is int and fdnum >= 0:
                    yield (pid, fdnum), size
            except (OSError, ValueError, KeyError, TypeError):  # ValueError: ProtocolError (not sealed) too
                continue


def _key(spare_id: str) -> str:
    return f"offers/{spare_id}"  # what an offer file's seal is bound to: a file renamed to another spare's fails


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


class _Mapping:
    """One offered buffer, mapped by a background thread (writable page-table entries made up front)."""

    def __init__(self, pid: int, fd: int, size: int) -> None:
        self.pid, self.fd, self.size = pid, fd, size
        self._buf: shm.SharedBuffer | None = None
        self._ident: tuple[int, int] | None = None
        self._thread = threading.Thread(target=self._map, name="hp-premap", daemon=True)
        self._thread.start()

    def _map(self) -> None:
        try:
            buf = shm.SharedBuffer.attach(torch.tensor([self.pid, self.fd, self.size]), self.size, populate_write=True)
        except (OSError, ValueError):
            return
        st = os.fstat(buf.fd)
        self._ident, self._buf = (st.st_dev, st.st_ino), buf

    def result(self, timeout: float | None = None) -> shm.SharedBuffer | None:
        self._thread.join(timeout)
        return None if self._thread.is_alive() else self._buf

    def same_file(self) -> bool:
        try:
            st = os.stat(f"/proc/{self.pid}/fd/{self.fd}")
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._ident

    def close(self) -> None:
        buf: Any = self.result()
        if buf is not None:
            buf.close()
        self._buf = None

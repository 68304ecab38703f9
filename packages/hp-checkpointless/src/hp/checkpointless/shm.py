"""Hydration through shared memory: a peer on the same node packs the state straight into the receiver's memory.

Over the transport a hydration costs a pack, a CRC on each side and the wire (0.44-0.66 GB/s for 328 MB
over gloo on loopback, against ~11 GB/s for a memcpy). On one node none of that is needed: a hot spare's
receive buffer (allocated and faulted in while it waits, :meth:`hp.checkpointless.formation.Formation.assign`)
is anonymous shared memory (``memfd_create``), and a source on the same node maps it through
``/proc/<pid>/fd/<fd>`` and packs the state into it: one copy into memory that is already the receiver's,
which keeps it as its optimizer state (and its parameters: :func:`hp.checkpointless.state.place_parameters`).
A source that saw the buffer offered maps it before the failure (:mod:`hp.checkpointless.premap`).
:mod:`hp.checkpointless.state` then sends only the header and the JSON skeleton over the transport,
flagged: the buffer is in place. Nothing is left behind: the memory
goes with the last process mapping it, a SIGKILLed spare's included (no file in ``/dev/shm``).

What crosses processes is checked like everything hp reads from a peer: the offer (pid, fd, size) is
three integers; the source opens only a regular file of this user's of at least the state's size. The
skeleton travels CRC-checked over the transport as always. The buffer itself has no CRC: it never
crosses a wire (a CRC pass costs more than the copy), and a peer of the same job is trusted with the
state anyway.
"""

from __future__ import annotations

import mmap
import os
import stat

import torch

_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # every page mapped at once: faulting them in one by one during the copy costs 3x
# writable entries made up front (Linux >= 5.14): slower to map than MAP_POPULATE, whose read-only entries
# fault once more on the first write, but the copy into it then runs at memcpy speed (hp.checkpointless.premap)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_NAME = "hp-hydrate"  # what /proc/<pid>/fd/<fd> of a receive buffer links to: "/memfd:hp-hydrate (deleted)"


class SharedBuffer:
    """Bytes in shared memory: made (and faulted in) by a receiver, attached by a source on its node."""

    def __init__(self, fd: int, size: int, owned: bool, populate_write: bool = False) -> None:
        self.fd, self.size, self._owned = fd, size, owned
        self.early = False  # a source's mapping made before the failure (hp.checkpointless.premap)
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED if populate_write else _FLAGS)
        if populate_write:
            try:
                self._map.madvise(_MADV_POPULATE_WRITE)
            except OSError:  # an older kernel: populated as any attach is
                self._map.close()
                self._map = mmap.mmap(fd, size, flags=_FLAGS)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)  # zero-copy; keeps the mapping alive

    @classmethod
    def create(cls, nbytes: int) -> SharedBuffer:
        """A receiver's buffer of ``nbytes``, every page allocated now (not while a hydration waits)."""
        fd = os.memfd_create(_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            buf = cls(fd, nbytes, owned=True)
        except BaseException:
            os.close(fd)
            raise
        buf.tensor.zero_()  # shared memory pages are only allocated when written
        return buf

    def offer(self) -> torch.Tensor:
        """What a source needs to attach it: (pid, fd, size), the fixed-size message of the offer."""
        return torch.tensor([os.getpid(), self.fd, self.size], dtype=torch.int64)

    @classmethod
    def attach(cls, offer: torch.Tensor, nbytes: int, populate_write: bool = False) -> SharedBuffer:
        """The buffer a receiver on this node offered (from the wire). ValueError unless it is one of hp's
        shared buffers (a memfd of :meth:`create`'s) of this user's holding at least ``nbytes``; OSError if
        it cannot be opened. ``populate_write``:
        make writable page-table entries now (slower to attach, faster to pack into: a mapping made early)."""
        pid, fd, size = (int(v) for v in offer.tolist())
        if pid <= 0 or fd < 0 or size < nbytes:
            raise ValueError(f"a shared buffer offer of pid {pid}, fd {fd}, {size} bytes for {nbytes} bytes of state")
        link = f"/proc/{pid}/fd/{fd}"
        if not os.readlink(link).startswith(f"/memfd:{_NAME} "):  # never any other file (a reused pid's, say)
            raise ValueError(f"{link} is no shared buffer of this user's of {nbytes} bytes")
        mine = os.open(link, os.O_RDWR | os.O_CLOEXEC)
        try:
            st = os.fstat(mine)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size < nbytes:
                raise ValueError(f"/proc/{pid}/fd/{fd} is no shared buffer of this user's of {nbytes} bytes")
            return cls(mine, st.st_size, owned=False, populate_write=populate_write)
        except BaseException:
            os.close(mine)
            raise

    def received(self) -> None:
        """A receiver's side, once its hydration is over: no source will attach any more (the mapping
        stays as long as the state it received lives in it)."""
        os.close(self.fd)

    def close(self) -> None:
        """A source's side: drop its mapping (a view still alive keeps it until it goes)."""
        del self.tensor
        try:
            self._map.close()
        except BufferError:  # a view is still alive: the mapping goes with it
            pass
        os.close(self.fd)


def no_offer() -> torch.Tensor:
    """The offer of a receiver without a shared buffer: the state comes over the transport."""
    return torch.zeros(3, dtype=torch.int64)


def offered(message: torch.Tensor) -> bool:
    return bool(message.any())

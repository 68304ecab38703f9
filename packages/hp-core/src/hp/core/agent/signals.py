"""SIGTERM/SIGINT in the agent: raised as :class:`SignalException` in its main thread, except while a worker
process starts, when they wait until the agent has recorded it.

Raised between a worker's spawn and the moment the agent records it, the signal would leave a process
nobody stops (seen: an orphaned worker). So :meth:`SignalDeferral.starting` holds the signal for that
moment and raises the first one that arrived right after it.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

from torch.distributed.elastic.multiprocessing.api import SignalException

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalDeferral:
    """The agent's handler of :data:`STOP_SIGNALS` and its window in which they wait."""

    def __init__(self) -> None:
        self.deferred: list[int] = []  # signals that arrived while a worker was being started
        self.defer = False

    def handle(self, signum: int, frame: object) -> None:
        if self.defer:
            self.deferred.append(signum)
            return
        raise SignalException(f"received {signal.Signals(signum).name}", sigval=signal.Signals(signum))

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Hold SIGTERM/SIGINT while a worker process starts (and is recorded)."""
        self.defer = True
        try:
            yield
        finally:
            self.defer = False
            if self.deferred:
                signum = self.deferred[0]
                self.deferred.clear()
                self.handle(signum, None)

    def install(self) -> dict[int, object]:
        """Make this the handler of :data:`STOP_SIGNALS`; returns the handlers it replaced."""
        return {s: signal.signal(s, self.handle) for s in STOP_SIGNALS}

    @staticmethod
    def restore(previous: dict[int, object]) -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

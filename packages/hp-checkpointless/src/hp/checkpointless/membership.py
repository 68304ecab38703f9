"""A worker's view of the job's membership, read from the coordination store.

The controller publishes (see :mod:`hp.core.protocol`) the plan of every generation, then the
generation number, and the rank it gives a promoted spare. Workers only read; every decision is the
controller's. Background threads beat the heartbeat file the agent uses to detect hangs and abort
the process group as soon as a newer generation appears, which releases a rank blocked in a
collective whose peer is gone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from hp.core.protocol import (
    FINISHED_KEY, GENERATION_KEY, Plan, SpareAssignment, arrive_prefix, plan_key, spare_key,
)


class Superseded(RuntimeError):
    """A newer generation appeared while this one was forming."""


class JobFinished(Exception):
    """The ranks finished the training loop while this process waited to form a generation with them."""


def latest_generation(store: dist.Store) -> int:
    return int(store.get(GENERATION_KEY)) if store.check([GENERATION_KEY]) else 0


def read_plan(store: dist.Store, generation: int) -> Plan:
    return Plan.from_json(store.get(plan_key(generation)))


def wait_for_generation(store: dist.Store, minimum: int, poll_s: float = 0.005,
                        on_slow: Callable[[], None] | None = None, slow_after_s: float = 5.0,
                        timeout_s: float = 600.0) -> Plan:
    """Block until generation >= ``minimum`` is published; returns its plan. ``on_slow`` runs once
    if nothing came within ``slow_after_s`` (a failure no agent reported: ask the controller)."""
    start = time.monotonic()
    slow_called = False
    while True:
        latest = latest_generation(store)
        if latest >= minimum:
            return read_plan(store, latest)
        waited = time.monotonic() - start
        if on_slow is not None and not slow_called and waited > slow_after_s:
            slow_called = True
            on_slow()
        if waited > timeout_s:
            raise TimeoutError(f"no generation >= {minimum} published within {timeout_s:.0f} s")
        time.sleep(poll_s)


def wait_for_assignment(store: dist.Store, spare: str, poll_s: float = 0.005,
                        on_idle: Callable[[dist.Store], None] | None = None, idle_every_s: float = 0.5) -> tuple[int, int]:
    """Block a hot spare until the controller gives it a rank; returns (rank, generation).
    ``on_idle(store)`` runs every ``idle_every_s`` meanwhile (preparation that must not delay a promotion
    by more than one call)."""
    key = spare_key(spare)
    last_idle = 0.0
    while not store.check([key]):
        if on_idle is not None and time.monotonic() - last_idle >= idle_every_s:
            on_idle(store)
            last_idle = time.monotonic()
        time.sleep(poll_s)
    assignment = SpareAssignment.from_json(store.get(key))
    return assignment.rank, assignment.generation


def arrive(store: dist.Store, generation: int, world_size: int, poll_s: float = 0.002) -> None:
    """Barrier of one generation on the store, abandoned (``Superseded``) if a newer generation
    appears: only then is the process group initialised, so init never waits on a dead rank."""
    prefixed = dist.PrefixStore(arrive_prefix(generation), store)
    prefixed.add("count", 1)
    while prefixed.add("count", 0) < world_size:
        if latest_generation(store) > generation:
            raise Superseded(f"generation {generation} superseded while forming")
        if store.check([FINISHED_KEY]):
            raise JobFinished(f"the job finished at step {int(store.get(FINISHED_KEY))} before generation "
                              f"{generation} formed")
        time.sleep(poll_s)


class Watch:
    """Background threads: one beats the heartbeat file and ends a process whose agent died (its
    workers would otherwise train on, or a spare wait, unsupervised); one hands each newly published
    plan to ``on_superseded`` (the runtime stops a step whose group is dead). Two threads, because a store read can block (a partition, a loaded store host) and a
    heartbeat must say only that this process runs, or the agent would kill it as hung."""

    def __init__(self, connect: Callable[[], dist.Store], heartbeat_file: str | None,
                 on_superseded: Callable[[Plan], None], period_s: float = 0.01, beat_every_s: float = 0.1,
                 on_orphaned: Callable[[], None] | None = None) -> None:
        self._connect, self._heartbeat_file = connect, heartbeat_file
        self._on_superseded, self._on_orphaned = on_superseded, on_orphaned
        self._parent = os.getppid()  # the agent: a worker whose agent died is re-parented
        self._period, self._beat_every = period_s, beat_every_s
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._beat_loop, name="hp-heartbeat", daemon=True),
                         threading.Thread(target=self._watch_loop, name="hp-watch", daemon=True)]

    def start(self) -> Watch:
        self.beat()
        for thread in self._threads:
            thread.start()
        return self

    def orphaned(self) -> bool:
        """Whether the agent that started this process died (it was re-parented)."""
        return os.getppid() != self._parent

    def beat(self) -> None:
        if self._heartbeat_file:
            with open(self._heartbeat_file, "a"):
                os.utime(self._heartbeat_file)

    def _beat_loop(self) -> None:
        while not self._stop.wait(self._beat_every):
            self.beat()
            if self._on_orphaned is not None and self.orphaned():
                self._on_orphaned()  # nobody supervises this process any more
                return

    def _watch_loop(self) -> None:
        store = None  # its own connection: store clients are not shared across threads
        seen = 0
        while not self._stop.wait(self._period):
            try:
                if store is None:
                    store = self._connect()
                latest = latest_generation(store)
                if latest > seen:  # each new generation's plan is read once
                    self._on_superseded(read_plan(store, latest))
                    seen = latest
            except Exception:  # the store is gone at job end; the main thread notices on its own
                if self._stop.is_set():
                    return

    def stop(self) -> None:
        """Stop beating and remove the heartbeat file: a process that left the step loop (and
        may take a while to exit) is no longer watched for hangs."""
        self._stop.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=2)
        if self._heartbeat_file:
            try:
                os.unlink(self._heartbeat_file)
            except FileNotFoundError:
                pass


def connect_store(host: str, port: int, timeout: timedelta = timedelta(seconds=60)) -> dist.Store:
    from hp.core.plugins import get_backend

    return get_backend("store", os.environ.get("HP_STORE", "tcp")).connect(host, port, timeout)

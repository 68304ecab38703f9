"""A worker's view of the job's membership, read from the coordination store.

The controller publishes (see :mod:`hp.core.protocol`) the plan of every generation, then the
generation number, and the rank it gives a promoted spare. Workers only read; every decision is the
controller's. Every value is sealed with the job token (:mod:`hp.core.signed_values`) and read through
a :class:`JobView`: a forged one is refused and read as absent, so a store writer without the token
can delay the job at most, never steer or stop it. Background threads beat the heartbeat file the agent uses to detect hangs and abort
the process group as soon as a newer generation appears, which releases a rank blocked in a
collective whose peer is gone.

Under ``hp run`` the generation, the plans and the spare assignments come from the node's channel
(:mod:`hp.core.fanout`: the agent's one watcher of the store forwards them, sealed as they are) and every
wait blocks on it: a rank sends the store no request while it waits for a generation. Without a channel
(a worker started without an agent) they are read from the store, polling.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import torch.distributed as dist

from hp.core.fanout import Mirror, forwarded
from hp.core.protocol import (
    ARRIVE_OUTCOME, FINISHED_KEY, GENERATION_KEY, STATE_NBYTES_KEY, ArriveOutcome, Plan, ProtocolError,
    SpareAssignment, arrive_prefix, plan_key, spare_key,
)
from hp.core.signed_values import Refusals, unseal
from hp.core.worker_signals import parent_death_signal, pid_alive

ARRIVE_SLICE_S = 2.0  # with a channel: a rank blocked in the arrival barrier looks whether the job finished this often
WATCH_WAKE_S = 5.0  # with a channel: the watch thread re-waits this often (a change or a stop wakes it at once)


class Superseded(RuntimeError):
    """A newer generation appeared while this one was forming."""


class JobFinished(Exception):
    """The ranks finished the training loop while this process waited to form a generation with them."""


class JobView:
    """This process's reads of the sealed values in the job's store (one per thread, as its client).

    A value not sealed with the job token for its key (forged, moved from another key) is refused:
    reported to ``refusals`` (rate limited: a warning, an event) and read as absent, so every reader
    goes on waiting for the genuine one. :meth:`generation` never goes back below one it returned (an
    old genuine value replayed into the key), and does without the generation key when it cannot be
    trusted. The last verified raw value of each key is remembered: only a changed value is verified again.

    With the node's ``channel`` (:class:`hp.core.fanout.Mirror`) the keys it forwards are read from it,
    the rest from ``store`` (None: a reader of the forwarded keys only)."""

    def __init__(self, store: dist.Store | None, token: str, refusals: Refusals | None = None,
                 channel: Mirror | None = None) -> None:
        if not token:
            raise ValueError("reading the job's store needs the job token (HP_JOB_TOKEN)")
        self.store, self._token, self.channel = store, token, channel
        self.refusals = refusals if refusals is not None else Refusals()
        self._generation = 0
        self._verified: dict[str, tuple[bytes, str]] = {}

    def value(self, key: str) -> str | None:
        """The genuine value at ``key``; None if there is none, or if it is refused."""
        if self.channel is not None and forwarded(key):
            raw = self.channel.get(key)
            if raw is None:
                return None
        elif not self.store.check([key]):
            return None
        else:
            raw = self.store.get(key)
        known = self._verified.get(key)
        if known is not None and known[0] == raw:
            return known[1]
        try:
            value = unseal(self._token, key, raw)
        except ProtocolError as e:
            self.refusals.report(key, e)
            return None
        self._verified[key] = (raw, value)
        return value

    def _parsed(self, key: str, parse: Callable[[str], object]) -> object | None:
        value = self.value(key)
        if value is None:
            return None
        try:
            return parse(value)
        except (ProtocolError, ValueError) as e:  # sealed, yet malformed: a token holder's bug; refused too
            self.refusals.report(key, f"malformed store value at {key!r}: {e}")
            return None

    def generation(self, expected: int = 0) -> int:
        """The newest generation published (0: none yet), never lower than one returned before.

        The generation key is only a shortcut: the controller seals each generation's plan before its
        number. So where the key is absent, refused (forged), replayed (lower than one seen before) or
        behind ``expected`` (a generation the caller knows is due: a stale value replayed to a fresh
        reader), the plans are read from there on: one more store read while the key cannot be trusted
        or while waiting for a generation, none on the watch thread's usual path.

        With the node's channel, which holds the newest plans and lists them, the newest genuine one is
        the generation: no key is needed."""
        if self.channel is not None:
            forwarded_plans = (k.removeprefix("hp/plan/") for k in self.channel.keys("hp/plan/"))
            for g in sorted((int(n) for n in forwarded_plans if n.isdigit()), reverse=True):
                if g <= self._generation:
                    break
                if self.plan(g) is not None:
                    self._generation = g
                    break
            return self._generation
        hint = self._parsed(GENERATION_KEY, _count)
        if hint is not None and hint >= self._generation:
            self._generation = hint
            if hint >= expected:
                return hint
        g = start = max(self._generation, expected - 1)
        while self.plan(g + 1) is not None:
            g += 1
        if g > start:
            self._generation = max(self._generation, g)
        return self._generation

    def plan(self, generation: int) -> Plan | None:
        """The plan of ``generation``; None if absent or refused."""
        plan = self._parsed(plan_key(generation), Plan.from_json)
        if plan is not None and plan.generation != generation:
            self.refusals.report(plan_key(generation), f"store value at {plan_key(generation)!r} is the plan of "
                                                       f"generation {plan.generation}")
            return None
        return plan

    def assignment(self, spare: str) -> SpareAssignment | None:
        return self._parsed(spare_key(spare), SpareAssignment.from_json)

    def finished(self) -> int | None:
        """The last step of the ranks that finished the training loop, once they did."""
        return self._parsed(FINISHED_KEY, int)

    def state_nbytes(self) -> int | None:
        """The size of a full hydration, once rank 0 published it."""
        return self._parsed(STATE_NBYTES_KEY, _count)

    def changes(self) -> int:
        """How many times the node's channel changed (0 without one): what :meth:`pause` waits past."""
        return self.channel.version if self.channel is not None else 0

    def pause(self, since: int, poll_s: float, longest_s: float) -> None:
        """Between two reads of the same values: block until the node's channel changed since ``since``
        (``longest_s`` at most); without a channel, sleep ``poll_s`` (the reads poll the store)."""
        if self.channel is None:
            time.sleep(poll_s)
        else:
            self.channel.wait(since, longest_s)


def _count(value: str) -> int:
    got = int(value)
    if got < 0:
        raise ValueError(f"expected a count >= 0, got {got}")
    return got


def wait_for_generation(view: JobView, minimum: int, poll_s: float = 0.005,
                        on_slow: Callable[[], None] | None = None, slow_after_s: float = 5.0,
                        timeout_s: float = 600.0) -> Plan:
    """Block until generation >= ``minimum`` is published; returns its plan. ``on_slow`` runs once
    if nothing came within ``slow_after_s`` (a failure no agent reported: ask the controller)."""
    start = time.monotonic()
    slow_called = False
    while True:
        seen = view.changes()
        latest = view.generation(minimum)
        plan = view.plan(latest) if latest >= minimum else None
        if plan is not None:  # a refused plan is waited out like a missing one
            return plan
        waited = time.monotonic() - start
        if on_slow is not None and not slow_called and waited > slow_after_s:
            slow_called = True
            on_slow()
        if waited > timeout_s:
            raise TimeoutError(f"no generation >= {minimum} published within {timeout_s:.0f} s")
        due = slow_after_s if on_slow is not None and not slow_called else timeout_s
        view.pause(seen, poll_s, max(due - waited, 0.0) + 0.001)


def wait_for_assignment(view: JobView, spare: str, poll_s: float = 0.005,
                        on_idle: Callable[[JobView], None] | None = None, idle_every_s: float = 0.5) -> tuple[int, int]:
    """Block a hot spare until the controller gives it a rank; returns (rank, generation).
    ``on_idle(view)`` runs every ``idle_every_s`` meanwhile (preparation that must not delay a promotion
    by more than one call). A refused assignment is waited out like a missing one."""
    last_idle = 0.0
    while True:
        seen = view.changes()
        if (assignment := view.assignment(spare)) is not None:
            return assignment.rank, assignment.generation
        if on_idle is not None and time.monotonic() - last_idle >= idle_every_s:
            on_idle(view)
            last_idle = time.monotonic()
        view.pause(seen, poll_s, idle_every_s)


def arrive(view: JobView, generation: int, world_size: int, poll_s: float = 0.002,
           slice_s: float = ARRIVE_SLICE_S) -> None:
    """Barrier of one generation on the store, abandoned (``Superseded``) if a newer generation
    appears: only then is the process group initialised, so init never waits on a dead rank.

    With the node's channel, ranks block on the barrier's outcome (:class:`ArriveOutcome`), set by the
    rank that arrives last, or by a relay once a newer plan is published; every ``slice_s`` a rank also
    looks whether the job finished. Without one, ranks poll the counter every ``poll_s``."""
    barrier = dist.PrefixStore(arrive_prefix(generation), view.store)
    arrived = barrier.add("count", 1)
    if view.channel is None:
        while barrier.add("count", 0) < world_size:
            _left_behind(view, generation)
            time.sleep(poll_s)
        # a peer on a node with a channel (or whose mirror failed: it then reads the store, as here) blocks
        # on the outcome, not the count: the last to arrive may be this rank
        barrier.compare_set(ARRIVE_OUTCOME, "", ArriveOutcome.FORMED.value)
        return
    if arrived >= world_size:
        barrier.compare_set(ARRIVE_OUTCOME, "", ArriveOutcome.FORMED.value)
    while True:
        seen = view.changes()
        try:
            barrier.wait([ARRIVE_OUTCOME], timedelta(seconds=slice_s))
            outcome = barrier.get(ARRIVE_OUTCOME)
        except dist.DistStoreError:  # not decided yet
            outcome = None
        if outcome == ArriveOutcome.FORMED.value.encode():
            return
        _left_behind(view, generation)
        if outcome is not None:  # abandoned, and this node's relay has not forwarded the newer plan yet (or forged)
            view.pause(seen, poll_s, slice_s)


def _left_behind(view: JobView, generation: int) -> None:
    """Raise if the barrier of ``generation`` can no longer complete: a newer generation, or the job finished."""
    if view.generation() > generation:
        raise Superseded(f"generation {generation} superseded while forming")
    finished = view.finished()
    if finished is not None:
        raise JobFinished(f"the job finished at step {finished} before generation {generation} formed")


class Watch:
    """Background threads: one beats the heartbeat file and ends a process whose agent died (its
    workers would otherwise train on, or a spare wait, unsupervised); one hands each newly published
    plan to ``on_superseded`` (the runtime stops a step whose group is dead). Two threads, because a store read can block (a partition, a loaded store host) and a
    heartbeat must say only that this process runs, or the agent would kill it as hung."""

    def __init__(self, connect: Callable[[], dist.Store], heartbeat_file: str | None,
                 on_superseded: Callable[[Plan], None], period_s: float = 0.01, beat_every_s: float = 0.1,
                 on_orphaned: Callable[[], None] | None = None, *, token: str,
                 refusals: Refusals | None = None, channel: Mirror | None = None, agent_pid: int | None = None) -> None:
        if not token:
            raise ValueError("watching the job's store needs the job token (HP_JOB_TOKEN)")
        self._connect, self._heartbeat_file, self._channel = connect, heartbeat_file, channel
        self._token, self._refusals = token, refusals if refusals is not None else Refusals()
        self._on_superseded, self._on_orphaned = on_superseded, on_orphaned
        self._parent = os.getppid()  # the agent or its fork server: a worker whose agent died is re-parented
        self._agent = agent_pid  # the agent itself (HP_AGENT_PID): a forked worker's parent is the fork server
        self._period, self._beat_every = period_s, beat_every_s
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._beat_loop, name="hp-heartbeat", daemon=True),
                         threading.Thread(target=self._watch_loop, name="hp-watch", daemon=True)]

    def start(self) -> Watch:
        if self._on_orphaned is not None:  # this watch says why the rank leaves when its agent dies
            parent_death_signal(0)
        self.beat()
        for thread in self._threads:
            thread.start()
        return self

    def orphaned(self) -> bool:
        """Whether the agent that started this process died: it was re-parented, or (a forked worker, whose
        parent is the node's fork server, killed only once the kernel has seen the agent die) the agent's
        process is gone. Asked by the main thread when a failure comes first (the store lived in the
        agent), the second answer does not depend on how soon the fork server dies."""
        return os.getppid() != self._parent or (self._agent is not None and not pid_alive(self._agent))

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
        if self._channel is not None:
            self._watch_channel()
            return
        view = None  # its own connection: store clients are not shared across threads
        seen = 0
        while not self._stop.wait(self._period):
            try:
                if view is None:
                    view = JobView(self._connect(), self._token, self._refusals)
                seen = self._hand_on(view, seen, view.generation())  # a forged or replayed (older) one is ignored
            except Exception:  # the store is gone at job end; the main thread notices on its own
                if self._stop.is_set():
                    return

    def _watch_channel(self) -> None:
        """The same, from the node's channel: block until it changes (or :meth:`stop`); no store request."""
        view, seen = JobView(None, self._token, self._refusals, self._channel), 0
        while not self._stop.is_set():
            version = self._channel.version
            seen = self._hand_on(view, seen, view.generation())
            self._channel.wait(version, WATCH_WAKE_S, self._stop)

    def _hand_on(self, view: JobView, seen: int, latest: int) -> int:
        """Hand the plan of ``latest`` on if it is newer than ``seen`` (each new generation's plan is read
        once; a forged one is never handed on: the genuine one is waited for); the generation seen now.

        A planned generation (``at_boundary``: a grow) published just after an unplanned one (a rank died)
        must not hide it: a watch that woke once for both would hand on only the planned one, which
        abandons nothing, and a rank forming the generation the dead rank was in would wait out the
        group's whole timeout (elastic-kill-during-grow, on a loaded machine). So the newest plan is
        handed on as unplanned unless every generation it skipped was planned too (one more read per
        skipped generation, only when one was skipped)."""
        if latest <= seen:
            return seen
        plan = view.plan(latest)
        if plan is None:
            return seen
        if seen and plan.at_boundary and not all(
                (skipped := view.plan(g)) is not None and skipped.at_boundary for g in range(seen + 1, latest)):
            plan = replace(plan, at_boundary=False)
        self._on_superseded(plan)
        return latest

    def stop(self) -> None:
        """Stop beating and remove the heartbeat file: a process that left the step loop (and
        may take a while to exit) is no longer watched for hangs."""
        self._stop.set()
        if self._channel is not None:
            self._channel.poke()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=2)
        if self._heartbeat_file:
            try:
                os.unlink(self._heartbeat_file)
            except FileNotFoundError:
                pass


def connect_store(host: str, port: int, backend: str = "tcp", timeout: timedelta = timedelta(seconds=60)) -> dist.Store:
    """A client of the job's store; ``backend``: the store plugin's name (:attr:`hp.core.worker_env.WorkerEnv.store`)."""
    from hp.core.plugins import get_backend

    return get_backend("store", backend).connect(host, port, timeout)

"""``hp k8s watch``: a running hp job acting on what Kubernetes says about its pods and nodes.

It runs beside ``hp controller`` (a native sidecar of the controller pod, :func:`hp.core.schedulers.k8s.manifest.watch_args`)
and keeps three watches open on the API server: the job's worker Pods (label selector), the Nodes and, where
Kueue is installed, the namespace's Workloads. Every event goes through :class:`hp.core.schedulers.k8s.watch.JobWatch`,
the pure state machine that turns them into scale decisions; :class:`Reactions` acts on those:

================  ==================================================================================
decision          action
================  ==================================================================================
``failure``       ``node_failed`` for each pod's node rank, naming the pod's uid (its incarnation):
                  the controller loses the node now (a spare takes its ranks, or an elastic job
                  shrinks) instead of after ``--heartbeat-timeout``: a node NotReady for
                  ``--not-ready-grace``, a pod deleted or failed with no disruption announced
``preemption``    none, said: the pod's SIGTERM (kubelet, Kueue) makes its agent leave at a step
                  boundary within the grace period; the decision is the notice
``capacity``      none, said: a new pod joins the running job itself (``hp run`` in it)
================  ==================================================================================

A report that could not be made (the controller unreachable) is made again each tick. A report about a pod
that was replaced since (its node rank now held by a pod with another uid) changes nothing: the controller
fences ``node_failed`` by incarnation (:mod:`hp.core.node_failure`). A watch that breaks (a 410 Gone, the
connection) is opened again from scratch, which re-sends every object as ADDED; an object deleted meanwhile
is not seen deleted (its node's heartbeat timeout still catches it).

Scale: one watcher per job, three streams whatever the job's size; the API server filters the pods by
label. Nothing per rank asks anything.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hp.core.schedulers.k8s.backend import KUEUE, KubernetesScheduler
from hp.core.schedulers.k8s.manifest import JOB_LABEL, ROLE_LABEL
from hp.core.schedulers.k8s.watch import Decision, JobWatch, WatchEventError
from hp.core.scaling import FAILURE

TICK_S = 0.5  # JobWatch.tick (a node's NotReady grace ending) and reports to retry, at least this often
STREAM_S = 300  # a watch request's own timeout: it is opened again from the last resourceVersion
RETRY_S = (0.5, 10.0)  # backoff of a watch that broke


@dataclass
class Reactions:
    """What the job does about the decisions (see the module docstring). ``report([(node_rank, reason,
    incarnation), ...])`` tells the controller (:meth:`hp.core.node_failure.FailureReport.report_all`) and
    returns those it could not. Pure: no clock, no I/O of its own."""

    report: Callable[[list[tuple[int, str, str]]], list[tuple[int, str, str]]]
    log: Callable[[str], None] = lambda m: print(f"hp k8s watch: {m}", file=sys.stderr, flush=True)
    pending: list[tuple[int, str, str]] = field(default_factory=list)  # (node rank, reason, uid) not told yet
    told: list[tuple[int, str, str]] = field(default_factory=list)

    def act(self, decisions: list[Decision]) -> None:
        for d in decisions:
            self.log(f"{d.event.kind} {d.event.count}: {d.reason} (capacity {d.capacity.hosts} hosts"
                     f"{', preemption under way' if d.capacity.preemption_requested else ''})")
            if d.event.kind != FAILURE:
                continue
            for pod in d.pods:
                if pod.node_rank is None:
                    self.log(f"pod {pod.name} names no node rank: left to the heartbeat timeout")
                else:
                    self.pending.append((pod.node_rank, f"{d.reason} (pod {pod.name})", pod.uid))
        self.flush()

    def flush(self) -> None:
        """Make the pending reports; keep those that could not be made."""
        if self.pending:
            left = self.report(self.pending)
            self.told += [item for item in self.pending if item not in left]
            self.pending = list(left)


class Streams:
    """The three watches, each in a thread of its own, feeding one queue of raw watch events."""

    def __init__(self, scheduler: KubernetesScheduler, job: str, log: Callable[[str], None]) -> None:
        self.scheduler, self.job, self._log = scheduler, job, log
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._watches: list[Any] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> Streams:
        core, custom = self.scheduler.core(), self.scheduler.custom()
        ns = self.scheduler.namespace
        selector = f"{JOB_LABEL}={self.job},{ROLE_LABEL}=worker"
        for what, fn, args, kwargs in (
                ("Pod", core.list_namespaced_pod, (ns,), {"label_selector": selector}),
                ("Node", core.list_node, (), {}),
                ("Workload", custom.list_namespaced_custom_object, (*KUEUE, ns, "workloads"), {})):
            t = threading.Thread(target=self._run, args=(what, fn, args, kwargs), name=f"hp-k8s-watch-{what}",
                                 daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for w in list(self._watches):
            w.stop()

    def _run(self, kind: str, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        backoff, version = RETRY_S[0], None
        while not self._stop.is_set():
            w = watch.Watch()
            self._watches.append(w)
            try:
                extra = {"resource_version": version} if version else {}
                for event in w.stream(fn, *args, deserialize=False, timeout_seconds=STREAM_S, **kwargs, **extra):
                    obj = event.get("object") if isinstance(event, dict) else None
                    if not isinstance(obj, dict) or event.get("type") == "ERROR":
                        continue  # Watch.stream raises for an ERROR it does not retry itself
                    obj.setdefault("kind", kind)
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    self.events.put(event)
                    backoff = RETRY_S[0]
                continue  # the request's own timeout: open it again from the last resourceVersion seen
            except ApiException as e:
                if e.status == 404 and kind == "Workload":
                    self._log("no Kueue in the cluster (workloads: 404): not watched")
                    return
                self._log(f"the {kind} watch broke ({e.status} {e.reason}): opened again from scratch")
                version = None
            except Exception as e:  # noqa: BLE001 -- the connection; a 410 Gone (raw events: a KeyError in the client)
                if self._stop.is_set():
                    return
                self._log(f"the {kind} watch broke ({type(e).__name__}): opened again from scratch in {backoff:g} s")
                version = None
            finally:
                self._watches.remove(w)
            self._stop.wait(backoff)
            backoff = min(backoff * 2, RETRY_S[1])


def run(scheduler: KubernetesScheduler, job: str, reactions: Reactions, nproc_per_node: int = 1,
        not_ready_grace_s: float = 10.0, stop: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic) -> JobWatch:
    """Watch ``job`` and act on its decisions until ``stop`` is set; the :class:`JobWatch` at the end."""
    stop = stop or threading.Event()
    state = JobWatch(job, nproc_per_node, not_ready_grace_s, clock)
    streams = Streams(scheduler, job, reactions.log).start()
    try:
        while not stop.is_set():
            try:
                event = streams.events.get(timeout=TICK_S)
            except queue.Empty:
                reactions.act(state.tick())
            else:
                try:
                    reactions.act(state.feed(event))
                except WatchEventError as e:
                    reactions.log(str(e))
    finally:
        streams.stop()
    return state

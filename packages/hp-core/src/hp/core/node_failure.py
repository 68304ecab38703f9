"""A scheduler telling the job's controller that a node failed: one mechanism for every backend.

The Slurm base job (:mod:`hp.core.schedulers.slurm.units`) and the Kubernetes watcher (:mod:`hp.core.schedulers.k8s.operator`)
learn of a failed node before the controller's heartbeat timeout would: Slurm takes a node out of a job,
Kubernetes reports a node NotReady or a pod gone. :class:`FailureReport` tells the controller
(``node_failed``, as the operator: the job token), so the node's ranks go to spares, or an elastic job
shrinks, now. It is fenced twice: by the generation read just before (``state``), and, where the scheduler
names which run of the node failed (``incarnation``: a pod's uid), by that, so a report about a pod that
was replaced never hits the pod that replaced it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from hp.core.auth import OPERATOR
from hp.core.errors import UsageError
from hp.core.protocol import Verb


class FailureReport:
    """``endpoint``: the controller's HOST:PORT; ``token``: the job token, or a function reading it (called
    once, when the first report is made); ``log``: where a report that could not be made is said."""

    def __init__(self, endpoint: str, token: str | Callable[[], str],
                 log: Callable[[str], None] | None = None) -> None:
        self.endpoint, self._token, self._client = endpoint, token, None
        self._log = log or (lambda m: print(f"hp: {m}", file=sys.stderr, flush=True))

    def report(self, node: int, reason: str, incarnation: str = "") -> bool:
        """Whether the controller has that node lost (now, or already), or knows it is not that run of the
        node (``incarnation``); False: it could not be told, ask again later."""
        return not self.report_all([(node, reason, incarnation)])

    def report_all(self, failures: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
        """Report each (node, reason, incarnation) on one reading of the job's state (a watch re-listed
        after a restart may hold many old pods: one ``state`` for all of them); those that could not be
        told, to ask again later."""
        from hp.core.control_plane import ControlClient, ControlPlaneError

        left = list(failures)
        try:
            if self._client is None:
                token = self._token() if callable(self._token) else self._token
                self._client = ControlClient(self.endpoint, token, node=OPERATOR)
            state = self._client.call(Verb.STATE, {})
            generation, nodes = state["generation"], state.get("nodes", {})
            while left:
                node, reason, incarnation = left[0]
                known = nodes.get(str(node))
                if known is not None and not (known["lost"] or known["done"]):
                    if incarnation and known.get("incarnation") != incarnation:  # the failed run is gone already
                        self._log(f"node {node} failed as {incarnation}, but the job's node {node} is "
                                  f"{known.get('incarnation') or 'another run'}: nothing to do")
                    else:
                        answer = self._client.call(Verb.NODE_FAILED, {
                            "node": node, "generation": generation, "reason": reason,
                            **({"incarnation": incarnation} if incarnation else {})})
                        generation, known["lost"] = answer["generation"], True  # each loss is a new generation
                left.pop(0)
        except (ControlPlaneError, OSError, UsageError, KeyError, TypeError) as e:
            self._log(f"could not report node {left[0][0]}'s failure to the controller: {e}")
        return left

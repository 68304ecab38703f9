"""The job controller: membership, generations, fencing and recovery decisions.

Pure state machine: it receives decoded, authenticated requests from agents (see
:mod:`hp.core.control_plane` for the wire) and answers with decisions. Every membership change bumps
the generation; a mutating request that carries an older generation is refused, so an agent that
missed a change can never act on a stale view.

One module per idea, over one shared :class:`JobBook` (who holds which rank, in which generation):

- :mod:`~hp.core.controller.dispatch`: :class:`Controller`, the thin front: the lock and the verb table.
- :mod:`~hp.core.controller.journal`: the decision log, remembered answers, the outbox and durability.
- :mod:`~hp.core.controller.state`: the durable state's JSON, what an HA replica takes over.
- :mod:`~hp.core.controller.membership`: nodes, the rendezvous, fencing by generation and holder.
- :mod:`~hp.core.controller.liveness`: heartbeats, silent nodes, the scheduler's failure reports.
- :mod:`~hp.core.controller.recovery`: dead ranks, failing steps, lost nodes' ranks, spares' news.
- :mod:`~hp.core.controller.lifecycle`: new generations and their published plans, the job's end.
- :mod:`~hp.core.controller.policy`: :class:`RecoveryPolicy`, the decisions fixed-size and elastic jobs
  make differently; :mod:`~hp.core.controller.elastic` is the elastic job's (:class:`ElasticController`).

Fencing, verb by verb (every request names its node, which must be a member and not declared lost):

============== ======================================================================================
verb           fenced by
============== ======================================================================================
worker_failed  the current generation and the holder: the reporting process must hold the rank now
rank_failed    the current generation and the holder (the worker's own report)
spare_failed   the current generation (the agent catches up once and asks again)
spare_added    the current generation
node_done      the current generation
node_leaving   the current generation (:class:`ElasticController`)
node_stopping  a generation no newer than the current one: a member node that stops takes its ranks
               with it whatever it has seen, but one that names a generation not made yet is forged
spare_ready    the spare itself: only a free spare of that node moves up the free list, nothing else
heartbeat      none: liveness whatever the agent has seen; the answer carries the current generation
join           the job's state: only during rendezvous (or, elastic, a node not yet a member)
scale          none: the operator sets the desired capacity, not a change relative to a generation
node_failed    the generation the reporter read (``state``): the scheduler (an operator identity, e.g.
               the Slurm base job, hp k8s watch) says a node failed; a node already lost or done is left
               alone, and so is one whose ``incarnation`` (a pod's uid) is not the one the report names
============== ======================================================================================

Durability (the HA controller, :mod:`hp.core.leader`): with a ``persist`` function injected, every
request that changed the job's state is written through it before its answer is sent and before the
values it publishes reach the store; see :mod:`hp.core.controller.journal`.
"""

from __future__ import annotations

from hp.core.controller.book import (
    MAX_INCARNATION, ControllerConfig, JobBook, NodeRecord, Refused, describe_exit, request_field,
)
from hp.core.controller.dispatch import Controller
from hp.core.controller.elastic import ElasticController, ElasticPolicy
from hp.core.controller.journal import ANSWERS_KEPT
from hp.core.controller.policy import Parts, RecoveryPolicy
from hp.core.controller.spares import SparePool
from hp.core.controller.state import StateError

__all__ = [
    "ANSWERS_KEPT", "MAX_INCARNATION", "Controller", "ControllerConfig", "ElasticController", "ElasticPolicy",
    "JobBook", "NodeRecord", "Parts", "RecoveryPolicy", "Refused", "SparePool", "StateError", "describe_exit",
    "request_field",
]

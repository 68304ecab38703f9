"""Hook specifications of hp-core: the plugin families every hp package and third party plugs into.

Plugins are found through the ``hp`` entry-point group (see :mod:`hp.core.plugins`). A plugin is
any object (usually a module) with functions named like the hooks below and marked with
:data:`hookimpl`. Each family has one hook that *contributes* backends; nothing in hp selects a
backend with ``if name == ...`` — lookups go through :func:`hp.core.plugins.get_backend`.

All ``hp_*_backends`` hooks are collecting hooks (not ``firstresult``): pluggy calls every
implementation and hp concatenates the returned lists. Two backends of one family with the same
``name`` are a configuration error reported when the family is first listed.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from hp.core.backends.api import HealthCheck, NodeService, StoreBackend, TransportBackend
    from hp.core.scaling import Scaler
    from hp.core.schedulers.api import SchedulerBackend

PROJECT_NAME = "hp"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def hp_transport_backends() -> list[TransportBackend]:
    """Contribute collective transports (family ``transport``).

    A transport creates, aborts and rebuilds the collective process group of one generation
    (``gloo`` for CPU, ``nccl`` for GPUs). See :class:`hp.core.backends.api.TransportBackend`.

    :return: a list of transport backend instances, each with a unique ``name``.
    """


@hookspec
def hp_scheduler_backends() -> list[SchedulerBackend]:
    """Contribute schedulers (family ``scheduler``).

    A scheduler says where processes run and how capacity changes: host lists, capacity
    signals, job submission and cancellation. See :class:`hp.core.schedulers.api.SchedulerBackend`.

    :return: a list of scheduler backend instances, each with a unique ``name``.
    """


@hookspec
def hp_store_backends() -> list[StoreBackend]:
    """Contribute coordination stores (family ``store``).

    The store is the job's key-value rendezvous (torch ``TCPStore`` by default; etcd for HA).
    See :class:`hp.core.store.StoreBackend`.

    :return: a list of store backend instances, each with a unique ``name``.
    """


@hookspec
def hp_storage_tiers() -> list[object]:
    """Contribute checkpoint storage tiers (family ``storage``), fastest first.

    Implemented by ``hp-tiered-ckpt`` (memory tier with cross-node replicas, fsspec persistence).
    hp-core defines no tier of its own.

    :return: a list of storage tier objects, each with a unique ``name`` and an integer
        ``rank`` (lower is faster) used to order reads.
    """


@hookspec
def hp_node_services() -> list[NodeService]:
    """Contribute per-node services (family ``node_service``) that ``hp run --service NAME`` starts.

    A node service is a process (or thread) that must live on every node beside the workers and
    outlive any one of them: ``hp-tiered-ckpt``'s checkpoint daemon, which holds the memory tier, is
    one. The agent starts the services named with ``--service`` after the rendezvous and before its
    workers, tells each one where its counterparts on the other nodes are, passes the environment
    each returns to every worker it starts, and stops them after its workers.
    See :class:`hp.core.services.NodeService`.

    :return: a list of node service instances, each with a unique ``name``.
    """


@hookspec
def hp_health_checks() -> list[HealthCheck]:
    """Contribute health checks (family ``health``) a rank passes before it re-enters training after a
    failure (a CUDA context that survived the failure, enough free device memory, ...).

    See :class:`hp.core.health.HealthCheck`; a failing check makes the process leave, and a spare
    takes its rank.

    :return: a list of health check instances, each with a unique ``name``.
    """


@hookspec(firstresult=True)
def hp_scaler(policy: str) -> Scaler | None:
    """Build the scaling decision of an elastic job from ``hp run --scaling-policy FILE`` (firstresult).

    Implemented by ``hp-elastic`` (a ``ScalingPolicy`` read from the YAML file ``policy``). The
    controller asks the returned :class:`hp.core.scaling.Scaler` for a target world size when a rank
    dies with no spare left, when a node is preempted and when capacity changes; hp-core never imports
    the implementation. Raise :class:`hp.core.errors.UsageError` for a bad policy (one line, exit 2).

    :param policy: the path given to ``--scaling-policy``.
    :return: a :class:`hp.core.scaling.Scaler`, or None to let another plugin answer.
    """


@hookspec
def hp_forkserver_preload() -> list[str]:
    """Modules the node's fork server imports before it forks workers (collecting hook).

    Every worker and spare of ``hp run --start-method forkserver`` is forked from one process per node
    that has already imported torch (:mod:`hp.core.fork_context`). A package whose runtime every worker
    of a job imports names its modules here, so that a worker (and a replacement forked while the job
    waits for it) does not pay for them again. Import only what has no side effects beyond defining
    names: the modules are imported once per node, before any worker exists.

    :return: importable module names.
    """


@hookspec
def hp_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``hp`` sub-commands (family ``cli``).

    Called once while the ``hp`` argument parser is built. Each implementation adds its
    sub-commands with ``subparsers.add_parser(name, ...)`` and must set a handler with
    ``parser.set_defaults(handler=fn)`` where ``fn(args: argparse.Namespace) -> int`` returns the
    process exit code. Raise :class:`hp.core.errors.UsageError` from a handler for bad input:
    the CLI prints it as one line and exits with code 2.

    :param subparsers: the ``hp`` parser's sub-parser action.
    :return: nothing; results are ignored.
    """

"""Hook specifications of hp-chaos: the ``fault`` plugin family.

hp-core's plugin manager loads this module through the ``hp.hookspecs`` entry point and reads
:data:`FAMILY_HOOKS`, so ``fault`` becomes a family like ``transport``: ``hp backends`` lists its
members and :func:`hp.core.plugins.get_backend` ``("fault", name)`` finds one. Built-in kinds are
registered by ``hp`` entry points of hp-chaos exactly like a third party's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hp.core.hookspecs import hookspec

if TYPE_CHECKING:
    from hp.chaos.faults.base import FaultKind

FAMILY_HOOKS = {"fault": "hp_fault_kinds"}


@hookspec
def hp_fault_kinds() -> list[FaultKind]:
    """Contribute fault kinds (family ``fault``) that scenario files can name in ``kind:``.

    Collecting hook (not ``firstresult``): every implementation is called and the lists are
    concatenated; two kinds with one ``name`` are a configuration error.

    A kind is an instance of :class:`hp.chaos.faults.base.FaultKind`: it says which ``target``
    forms it accepts, validates its own parameters (:meth:`~FaultKind.validate` raises
    :class:`hp.chaos.faults.base.ScenarioError` naming the key) and turns a validated fault into
    an :class:`~hp.chaos.faults.base.Injection` (:meth:`~FaultKind.inject`): entries for the
    in-process plan (``HP_FAULTS``, step- and phase-precise) and/or actions the runner performs
    from outside while the job runs (signals, iptables rules), each undone when the fault's
    ``duration_s`` ends or, at the latest, when the run ends.

    :return: a list of fault kinds, each with a unique ``name``.
    """

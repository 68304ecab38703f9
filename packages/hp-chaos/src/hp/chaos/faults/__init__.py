"""Fault kinds (plugin family ``fault``): the built-in ones are registered by ``hp`` entry points
of hp-chaos (:mod:`.process`: kill, hang, exception, slow; :mod:`.network`: node, partition, loss;
:mod:`.storage`: storage; :mod:`.store`: store; :mod:`.elastic`: preempt, join) and found, like a
third party's, through :func:`fault_kinds`."""

from __future__ import annotations

from hp.chaos.faults.base import FaultKind, FaultSpec, Injection, ScenarioError, Target


def fault_kinds() -> dict[str, FaultKind]:
    """Every discovered fault kind by name."""
    from hp.core.plugins import backends

    return backends("fault")


__all__ = ["FaultKind", "FaultSpec", "Injection", "ScenarioError", "Target", "fault_kinds"]

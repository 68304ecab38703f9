"""hp chaos harness: fault plugins, scenarios, recovery and goodput benchmarks

- scenarios (:mod:`hp.chaos.scenario`): a job, faults and expectations, from YAML;
- fault kinds (plugin family ``fault``, :mod:`hp.chaos.faults`): kill, hang, exception, slow,
  node, partition, loss, storage, and for elastic jobs preempt, join;
- the runner (:mod:`hp.chaos.runner`): reference vs faulted job, every expectation checked;
- ``hp chaos run|report|faults``, the pytest plugin (:mod:`hp.chaos.pytest_plugin`), ``hp bench
  recovery`` (:mod:`hp.chaos.bench.recovery`).

Names are imported on first use: the package itself stays importable without torch or
hp-checkpointless (which the runner and the benchmarks need, the distribution does not).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FaultKind": "hp.chaos.faults.base",
    "FaultSpec": "hp.chaos.faults.base",
    "Injection": "hp.chaos.faults.base",
    "ScenarioError": "hp.chaos.faults.base",
    "Target": "hp.chaos.faults.base",
    "fault_kinds": "hp.chaos.faults",
    "StorageOutage": "hp.chaos.faults.storage",
    "StorageServer": "hp.chaos.faults.storage",
    "Expect": "hp.chaos.scenario",
    "JobSpec": "hp.chaos.scenario",
    "Scenario": "hp.chaos.scenario",
    "load_scenario": "hp.chaos.scenario",
    "parse_scenario": "hp.chaos.scenario",
    "ReferenceCache": "hp.chaos.references",
    "run_scenario": "hp.chaos.runner",
    "Topology": "hp.chaos.topology",
    "TopologyError": "hp.chaos.topology",
    "cleanup_stale": "hp.chaos.topology",
    "MultiNodeJob": "hp.chaos.multinode",
    "GoodputConfig": "hp.chaos.bench.goodput",
    "simulate": "hp.chaos.goodput_sim",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hp.chaos' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

"""The suite's schedule (longest tests first, from the newest durations results file); hp's pytest plugin.

``hp.testing.plugin`` gives every test the session's warm start (each ``hp run`` a test starts has its agent
forked from one server per pytest process that has already imported torch; ``HP_WARM_START=`` opts out), the
``launch`` and ``free_port`` fixtures.

Schedule:

``pytest -n 2`` (``--dist worksteal``, pytest.ini) gives each worker a contiguous share of the collected
tests and lets an idle worker take the end of another's queue. A long test collected last runs
alone while the other worker idles: ordering by the durations of the last measured run
(``benchmarks/results/*-suite-*.json``, written by ``scripts/suite_durations.py``) lets the two workers
finish together. A test the file does not know yet (new or renamed) goes first, as if it were long.
Only the order changes, never what runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest_plugins = ["hp.testing.plugin"]

ROOT = Path(__file__).resolve().parent
UNKNOWN_S = 60.0  # a test not in the file: scheduled as a long one, so that it never runs alone at the end


def _durations() -> dict[str, float]:
    """Every test's seconds from the newest suite file that lists them (a CI-run summary lists only the
    slowest 25 and is passed over)."""
    for path in sorted((ROOT / "benchmarks" / "results").glob("*-suite-*.json"), reverse=True):
        try:
            return {t["id"]: float(t["s"]) for t in json.loads(path.read_text())["tests"]}
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return {}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    known = _durations()
    if not known:
        return
    items.sort(key=lambda item: -known.get(item.nodeid, UNKNOWN_S))  # stable: ties keep collection order
    # worksteal hands worker k the k-th contiguous share of this list, and an idle worker takes the end of
    # another's queue: deal the sorted list out like cards so that every share runs longest first and the
    # shares are about equally long
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    items[:] = [item for k in range(workers) for item in items[k::workers]]

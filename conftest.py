"""The suite's schedule (longest tests first, from the newest durations results file) and its warm start.

Warm start: every ``hp run`` a test starts has its agent forked from one server per pytest process that has
already imported torch (:mod:`hp.core.warm_start`), instead of importing it anew (~3.5 CPU s an agent).
The agent is the same code, process and environment; ``HP_WARM_START=`` in a test's environment opts out.

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
import os
from pathlib import Path

import pytest

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


@pytest.fixture(scope="session", autouse=True)
def warm_start():
    """The session's warm-start server; ``HP_WARM_START=`` (set, empty) runs the session cold."""
    from hp.core import warm_start
    from hp.core.protocol import WARM_START_ENV

    if os.environ.get(WARM_START_ENV) == "":
        yield None
        return
    with warm_start.session() as path:
        yield path


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

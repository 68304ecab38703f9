"""hp's pytest plugin, opt-in (``pytest_plugins = ["hp.testing.plugin"]`` in a ``conftest.py``), as pytest's
own ``pytester``: fixtures for tests that start real ``hp`` processes.

* ``hp_warm_start`` (session, autouse): one server per pytest process that has already imported torch;
  every ``hp run|demo|bench|chaos`` and warm-started program a test starts forks from it instead of importing
  torch anew (~3.5 CPU s a process; :mod:`hp.core.warm_start`). The process, its code and environment are
  the same; ``HP_WARM_START=`` (set, empty) runs the session cold.
* ``launch``: start ``hp`` with ``HP_TEST_DIR`` set to the test's ``tmp_path``; every process it started (and
  every process tagged with that directory) is killed when the test ends, passed or failed.
* ``free_port``: a TCP port free on 127.0.0.1 now.

No shipped module imports this plugin; the helpers it builds on are in :mod:`hp.testing`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hp import testing
from hp.testing import Launched, kill_tagged


@pytest.fixture(scope="session", autouse=True)
def hp_warm_start() -> Iterator[str | None]:
    """The session's warm-start server (its folder), or None when ``HP_WARM_START=`` runs the session cold."""
    from hp.core import warm_start
    from hp.core.protocol import WARM_START_ENV

    if os.environ.get(WARM_START_ENV) == "":
        yield None
        return
    with warm_start.session() as path:
        yield path


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Launched]]:
    """Start ``hp`` with ``HP_TEST_DIR=tmp_path``; every process group started is killed afterwards."""
    started: list[Launched] = []

    def _launch(*args: str, extra_env: dict[str, str] | None = None) -> Launched:
        env = {**os.environ, "HP_TEST_DIR": str(tmp_path), **(extra_env or {})}
        launched = Launched(list(args), env, tmp_path)
        started.append(launched)
        return launched

    yield _launch
    for launched in started:
        launched.stop()
    kill_tagged(f"HP_TEST_DIR={tmp_path}")


@pytest.fixture
def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    return testing.free_port()

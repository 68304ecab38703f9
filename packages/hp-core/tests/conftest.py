"""Fixtures for tests that launch real `hp` processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hp.core import testing
from hp.core.testing import Launched, kill_tagged

WORKERS = Path(__file__).parent / "workers"


@pytest.fixture
def launch(tmp_path: Path):
    """Start `hp` with HP_TEST_DIR=tmp_path; every process group started is killed afterwards."""
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
    return testing.free_port()


@pytest.fixture
def workers_dir() -> Path:
    return WORKERS

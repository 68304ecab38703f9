"""Fixtures of hp-core's tests (``launch`` and ``free_port`` come from the ``hp.testing.plugin`` plugin)."""

from __future__ import annotations

from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"


@pytest.fixture
def workers_dir() -> Path:
    return WORKERS

"""The node's fork server (:mod:`hp.core.forkserver`): its multiprocessing context and its start.

Torch-free, so that ``hp run`` starts the server before it imports torch itself (``hp.core.commands``):
the server's imports (~5 CPU s) run beside the agent's (~3 CPU s) instead of after them.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any
from unittest.mock import patch

PRELOAD = ["hp.core.fork_preload"]


def context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def warm(env: dict[str, str], wait: bool = False) -> None:
    """Start the fork server and its imports now, at job start, rather than on the first fork; with
    ``wait``, return once they are done (a first fork would otherwise block that long: an agent that has
    joined its job must not go that long without a heartbeat).

    ``env`` is what the workers get on top of the agent's environment. The server is started with
    it because some of it is read once, at import: OpenMP sizes its thread pool from
    ``OMP_NUM_THREADS`` when torch loads it, so a server started without the workers' ``1`` would
    fork spares that each run as many threads as the host has cores (measured: every step of the
    job slowed 4x once such a spare held a rank)."""
    from multiprocessing import forkserver

    context()
    with patch.dict(os.environ, env):  # the server inherits the workers' environment, this process keeps its own
        forkserver.ensure_running()
    if wait:  # the server accepts a fork request once its imports are done
        probe = context().Process(target=int, name="hp-forkserver-ready")
        probe.start()
        probe.join()
        probe.close()

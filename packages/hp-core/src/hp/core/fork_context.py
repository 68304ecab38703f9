"""The node's fork server (:mod:`hp.core.forkserver`): its multiprocessing context and its start.

Two ways to start it, one server either way (multiprocessing's forkserver loop, the same requests):

* :func:`fork_here` (``hp run``, the default): the agent imports what the server preloads — it imports
  torch anyway — and forks the server from itself before it starts any thread. The server's own imports
  (~4.5 CPU s on the 2-core box) are not paid a second time, and the server is ready as soon as the
  agent's imports are done.
* :func:`warm` (an agent run in a process that has already started threads, ``--start-method spawn``'s
  replacements): a new interpreter that imports :mod:`hp.core.fork_preload`.

This module is torch-free; :func:`fork_here` imports torch.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing
import os
import signal
import threading
from typing import Any
from unittest.mock import patch

PRELOAD = ["hp.core.fork_preload"]  # what a started server imports first (it then calls import_preloaded)
# what every worker imports: torch, its distributed and optimizer packages, and torch._dynamo, which the
# first Optimizer.add_param_group imports (~3 of a cold worker's ~6 CPU s on the 2-core box)
IMPORTS = ["torch", "torch._dynamo", "torch.distributed", "torch.optim", "hp.core.forkserver"]
PARENT_ENV = "HP_FORKSERVER_PARENT"  # the agent's pid, in a started server's environment


def context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def preloaded_modules() -> list[str]:
    """:data:`IMPORTS` and what installed plugins name (``hp_forkserver_preload``)."""
    from hp.core.plugins import get_plugin_manager

    extra = [m for names in get_plugin_manager().hook.hp_forkserver_preload() for m in names]
    return list(dict.fromkeys([*IMPORTS, *extra]))


def import_preloaded() -> None:
    for name in preloaded_modules():
        importlib.import_module(name)


def become_server(parent: int | None, env: dict[str, str]) -> None:
    """What the server does before it serves, however it was started: it dies with the agent that started
    it (``parent``; a server that outlived its agent would keep the workers it forked and multiprocessing's
    resource tracker alive), blocks SIGTERM (Slurm signals every process of a job step at a preemption
    notice; a server that died of it would orphan the workers), sizes torch's threads as the workers' and
    freezes what it imported (never traversed by a child's garbage collections, its pages stay shared)."""
    from hp.core.worker_signals import set_title

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    if parent is not None:
        _die_with_parent(parent)
    set_title(f"hp forkserver (agent {os.getppid()})")  # what ps shows; its children set their own
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS", "").isdigit():
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    gc.freeze()


def _die_with_parent(parent: int) -> None:
    from hp.core.worker_signals import parent_death_signal

    parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(0)


def fork_here(env: dict[str, str]) -> None:
    """Start the fork server as a fork of this process (see the module docstring): import what it
    preloads, then fork. Call from the main thread before this process starts threads of its own (torch's
    own native thread holds nothing the server needs). ``env`` is what the workers get on top of this
    process's environment; the server, not this process, takes it."""
    import socket
    from multiprocessing import connection, forkserver, resource_tracker

    assert threading.current_thread() is threading.main_thread(), "fork_here: call from the main thread"
    import_preloaded()
    server = forkserver._forkserver
    with server._lock:
        if server._forkserver_pid is not None:
            return
        resource_tracker.ensure_running()
        parent = os.getpid()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the server
                code = 1
                try:
                    os.close(alive_w)
                    become_server(parent, env)
                    forkserver.main(listener.fileno(), alive_r, [])
                    code = 0
                finally:
                    os._exit(code)
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid


def warm(env: dict[str, str], wait: bool = False) -> None:
    """Start the fork server as a new interpreter (unless one runs), its imports now, at job start, rather
    than on the first fork; with ``wait``, return once they are done (a first fork would otherwise block
    that long: an agent that has joined its job must not go that long without a heartbeat).

    ``env`` is what the workers get on top of the agent's environment. The server is started with
    it because some of it is read once, at import: OpenMP sizes its thread pool from
    ``OMP_NUM_THREADS`` when torch loads it, so a server started without the workers' ``1`` would
    fork spares that each run as many threads as the host has cores (measured: every step of the
    job slowed 4x once such a spare held a rank)."""
    from multiprocessing import forkserver

    context()
    parent = {PARENT_ENV: str(os.getpid())} if threading.current_thread() is threading.main_thread() else {}
    with patch.dict(os.environ, {**env, **parent}):  # the server inherits them, this process keeps its own
        forkserver.ensure_running()
    if wait:  # the server accepts a fork request once its imports are done
        probe = context().Process(target=int, name="hp-forkserver-ready")
        probe.start()
        probe.join()
        probe.close()

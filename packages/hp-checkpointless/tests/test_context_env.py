"""A Context reads its environment once, through :class:`hp.core.worker_env.WorkerEnv`: a process that
``hp run`` did not start (or whose environment is malformed) is refused in one line before anything
connects, and a well-formed environment passed in (not ``os.environ``) is the one the parts are wired
from: its store backend, its rank, its device, its world size."""

from __future__ import annotations

import signal
from datetime import timedelta

import pytest
import torch.distributed as dist

from hp.checkpointless.interrupt import INTERRUPT_SIGNAL
from hp.checkpointless.runtime import Context
from hp.core.errors import UsageError
from hp.testing import free_port

TOKEN = "0" * 64


def worker_env(port: int, **kw: str) -> dict[str, str]:
    env = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "HP_GENERATION": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "HP_JOB_TOKEN": TOKEN, "HP_STORE": "tcp", "HP_TRANSPORT": "gloo",
           "HP_NODE_RANK": "0", "HP_HOLDER": "r1a0"}
    env.update(kw)
    return {k: v for k, v in env.items() if v is not None}


@pytest.mark.parametrize("change, message", [
    ({"HP_GENERATION": None}, "hp.checkpointless needs `hp run` (HP_GENERATION is not set)"),
    ({"HP_JOB_TOKEN": None}, "hp.checkpointless needs the job token in HP_JOB_TOKEN (`hp run` sets it)"),
    ({"HP_JOB_TOKEN": ""}, "hp.checkpointless needs the job token in HP_JOB_TOKEN (`hp run` sets it)"),
    ({"MASTER_ADDR": None}, "not started by `hp run` (missing MASTER_ADDR)"),
    ({"RANK": None}, "not started by `hp run` (missing RANK)"),
    ({"WORLD_SIZE": "two"}, "the worker environment `hp run` set is malformed"),
    ({"MASTER_PORT": "http"}, "the worker environment `hp run` set is malformed"),
])
def test_a_missing_or_malformed_environment_is_refused_in_one_line(change, message):
    with pytest.raises(UsageError) as info:
        Context(env=worker_env(1, **change))  # port 1: nothing may connect before the refusal
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_the_parts_are_wired_from_the_environment_passed_in(monkeypatch):
    monkeypatch.setenv("HP_STORE", "no-such-store")  # the process's own environment is not read
    monkeypatch.setenv("LOCAL_RANK", "7")
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    handler = signal.getsignal(INTERRUPT_SIGNAL)
    ctx = Context(env=worker_env(port))
    try:
        assert ctx.rank == 1 and ctx.world_size == 2 and ctx.generation == 0 and ctx.committed == -1
        assert str(ctx.device) == "cpu" and ctx.last_loss is None and ctx.optimizer is None
        steps = ctx.steps(3)  # a generator, as before: nothing runs until the loop asks for a step
        with pytest.raises(UsageError, match="before ctx.steps()"):
            next(steps)
        with pytest.raises(UsageError, match="ctx.commit"):
            ctx.commit(0.0)
    finally:
        ctx.close()
        ctx.close()  # idempotent
        signal.signal(INTERRUPT_SIGNAL, handler)
        del master


def test_a_spares_environment_needs_no_rank():
    env = worker_env(1, RANK=None, HP_ROLE="spare", HP_SPARE_ID="n0s0", HP_JOB_TOKEN=None)
    with pytest.raises(UsageError, match="job token"):  # a spare's environment has no RANK: not refused for it
        Context(env=env)

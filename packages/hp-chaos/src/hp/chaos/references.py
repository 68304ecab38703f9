"""Fault-free runs computed once per job and shared: by the tests of one session (``pytest -n 2``'s workers
too) and by the scenarios, benchmarks and elastic runs that compare against them."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from hp.checkpointless.demo.run import DemoConfig, RunResult
from hp.checkpointless.demo.run import run_job as run_demo_job

from hp.chaos.launch import run_job

if TYPE_CHECKING:
    from hp.chaos.scenario import JobSpec


class ReferenceCache:
    """Fault-free runs by key (a scenario job's :meth:`JobSpec.reference_key`; any other job's own
    tuple): in memory, and in ``directory`` if given (shared by the processes of one session, e.g.
    ``pytest -n 2`` workers; a file lock makes the second one wait for the first instead of running
    the same job again). Only a run that exited 0 is kept."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory
        self._memory: dict[tuple, RunResult] = {}

    def get(self, job: JobSpec, env: dict[str, str] | None, fallback_dir: str) -> RunResult:
        """The fault-free run of a scenario's ``job``."""
        return self.run(job.reference_key(), lambda log_dir: fault_free_run(job, log_dir, env), fallback_dir)

    def demo(self, cfg: DemoConfig, env: dict[str, str] | None, fallback_dir: str) -> RunResult:
        """The fault-free run of the demo job ``cfg`` (:func:`hp.checkpointless.demo.run.run_job`), keyed by
        the config and the names of the variables ``env`` adds (their values are paths and ports: they
        differ between callers, never the bits)."""
        key = ("demo", json.dumps(asdict(cfg), sort_keys=True), tuple(sorted(env or {})))
        return self.run(key, lambda log_dir: run_demo_job(cfg, log_dir, [], env), fallback_dir)

    def run(self, key: tuple, run: Callable[[str], RunResult], fallback_dir: str) -> RunResult:
        """``run(log_dir)``'s result for ``key``, run once: in ``fallback_dir``/reference without a directory."""
        if key in self._memory:
            return self._memory[key]
        if self.directory is None:
            result = run(os.path.join(fallback_dir, "reference"))
        else:
            name = "reference-" + hashlib.sha1(repr(key).encode()).hexdigest()[:16]
            path = os.path.join(self.directory, name + ".json")
            os.makedirs(self.directory, exist_ok=True)
            with open(path + ".lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if os.path.exists(path):
                    with open(path) as f:
                        result = RunResult(**json.load(f))
                else:
                    result = run(os.path.join(self.directory, name))
                    if result.returncode == 0:
                        with open(path + ".tmp", "w") as f:
                            json.dump(asdict(result), f)
                        os.replace(path + ".tmp", path)
        if result.returncode == 0:
            self._memory[key] = result
        return result


def fault_free_run(job: JobSpec, log_dir: str, env: dict[str, str] | None) -> RunResult:
    """A scenario job with no fault (its reference)."""
    # no spares: a fault-free run never uses one, and the losses do not depend on it; the default tcp
    # store whatever the job's (nor do the losses depend on that): one reference per reference_key,
    # whichever scenario ran it first, and an etcd job is held to the tcp store's bits
    job = replace(job, store="tcp")
    with checkpoint_storage(job, log_dir) as ck:
        run = run_job(job, log_dir, [], env=storage_env(env, ck), spares=0, train_args=ck.train_args if ck else ())
    return run.result


def checkpoint_storage(job: JobSpec, log_dir: str) -> contextlib.AbstractContextManager:
    """The run's own S3 endpoint + ckpt daemon + namespace when the job checkpoints, else nothing."""
    if job.checkpoint is None:
        return contextlib.nullcontext()
    from hp.chaos.ckpt_storage import CheckpointStorage

    return CheckpointStorage(job.checkpoint, log_dir)


def storage_env(env: dict[str, str] | None, ck: Any) -> dict[str, str] | None:
    return {**(env or {}), **ck.env} if ck else env

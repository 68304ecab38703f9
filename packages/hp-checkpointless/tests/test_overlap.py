"""The gradient all-reduce overlapping backward (hp.checkpointless.overlap, issue #16): buckets start in
order whatever order backward finishes them in, a second accumulation is refused, and in real jobs (CPU
gloo, 2 ranks + a hot spare) the overlapped step is bit-identical to the plain one and a SIGKILL while
buckets are in flight (in backward, in the reduction) is recovered bit-identically with 0 lost steps."""

from __future__ import annotations

import pytest
import torch

from hp.checkpointless.demo.run import DemoConfig, compare, compare_state, run_demo, run_job
from hp.checkpointless.overlap import OverlappedMeanReduction
from hp.core.errors import UsageError
from hp.testing import kill_tagged


class Work:
    def __init__(self, log: list, what: tuple) -> None:
        self.log, self.what = log, what

    def wait(self) -> None:
        self.log.append(("wait", *self.what))


def _reduction(sizes: list[int], bucket_bytes: int) -> tuple[OverlappedMeanReduction, torch.Tensor, list, object]:
    r = OverlappedMeanReduction(bucket_mb=bucket_bytes / (1 << 20))
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    r.plan(list(zip(offsets, sizes)), 4)
    grads, log = torch.ones(sum(sizes)), []

    def collective(fn, *args, async_op=False):  # noqa: ANN001, ANN202
        if fn is not torch.distributed.all_reduce:
            return fn()  # a work's wait
        t = args[0]
        what = (t.data_ptr() - grads.data_ptr()) // 4, t.numel()
        log.append(("async" if async_op else "sync", *what))
        return Work(log, what) if async_op else None

    return r, grads, log, collective


def test_buckets_are_whole_parameters_from_the_last_and_start_in_order():
    # parameters of 4, 4, 2, 6 floats; buckets of >= 8 floats (32 bytes), cut from the last parameter back
    r, grads, log, collective = _reduction([4, 4, 2, 6], 32)
    assert r.buckets == [(8, 16), (0, 8)]  # params 2+3, then 0+1
    r.begin()
    r.gradient_ready(grads, 1, collective)
    r.gradient_ready(grads, 0, collective)  # bucket 1 is complete first: it must wait for bucket 0
    assert log == []
    r.gradient_ready(grads, 3, collective)
    r.gradient_ready(grads, 2, collective)  # bucket 0 complete: both start, in order
    assert log == [("async", 8, 8), ("async", 0, 8)] and r.overlapped == 2
    r.reduce(grads, 2, collective)
    assert log[2:] == [("wait", 8, 8), ("wait", 0, 8)] and torch.equal(grads, torch.full((16,), 0.5))


def test_buckets_that_did_not_start_are_reduced_in_order_at_the_end():
    r, grads, log, collective = _reduction([4, 4, 2, 6], 32)
    r.begin()
    r.gradient_ready(grads, 1, collective)  # bucket 0 never completes (param 3 unused, say)
    r.reduce(grads, 1, collective)
    assert log == [("sync", 8, 8), ("sync", 0, 8)] and r.overlapped == 0


def test_a_gradient_accumulated_again_after_its_bucket_started_is_refused():
    r, grads, log, collective = _reduction([4, 4], 16)
    r.begin()
    r.gradient_ready(grads, 1, collective)
    with pytest.raises(UsageError, match="one backward"):
        r.gradient_ready(grads, 1, collective)
    with pytest.raises(UsageError, match="bucket_mb must be > 0"):
        OverlappedMeanReduction(bucket_mb=0)


def test_a_new_attempt_waits_for_the_failed_one_s_all_reduces():
    r, grads, log, collective = _reduction([4, 4], 16)
    r.begin()
    r.gradient_ready(grads, 1, collective)  # started; the step then failed before reduce()
    r.begin()  # the replay
    assert log == [("async", 4, 4), ("wait", 4, 4)] and r.overlapped == 0


# ---- real jobs ----------------------------------------------------------------------------------
OVERLAP = ["--overlap", "--bucket-mb", "0.1"]  # the tiny model's 0.5 MB of gradients in 5 buckets


@pytest.fixture
def env(tmp_path, monkeypatch):
    (tmp_path / "cache").mkdir()
    monkeypatch.setenv("HP_DATA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HP_TEST_DIR", str(tmp_path))
    yield tmp_path
    kill_tagged(f"HP_TEST_DIR={tmp_path}")


def test_the_overlapped_step_is_the_plain_step_s_bits(env):
    """At 2 ranks: every loss and every rank's final state equal the plain reduction's, and buckets did
    start during backward (all of them, from the second step on: the first one's gradients are not yet
    views of the flat buffer)."""
    cfg = dict(nproc=2, spares=0, steps=8, corpus_mb=2)
    plain = run_job(DemoConfig(**cfg), str(env / "plain"), [])
    overlapped = run_job(DemoConfig(**cfg, train_args=OVERLAP), str(env / "overlap"), [])
    assert plain.returncode == overlapped.returncode == 0, overlapped.output[-2000:]
    assert compare(plain, overlapped) == {"bitwise_equal": True, "lost_steps": 0, "steps_compared": 8}
    assert compare_state(plain, overlapped, nproc=2)["state_equal"]
    started = {(e["rank"], e["step"]): e["overlapped"] for e in overlapped.events if e["event"] == "commit"}
    assert started[(0, 0)] == started[(1, 0)] == 0 and min(v for (_, s), v in started.items() if s > 0) == 5


@pytest.mark.parametrize("phase", ["backward", "allreduce"])  # where buckets are in flight
def test_a_kill_with_overlap_is_recovered_bit_identically(env, phase):
    cfg = DemoConfig(nproc=2, spares=1, steps=10, fault_step=4, corpus_mb=2, hang_timeout_s=20.0, phase=phase,
                     train_args=OVERLAP, log_dir=str(env / "logs"))
    r = run_demo(cfg)
    assert r["completed"], r.get("error_tail")
    assert r["bitwise_equal"] and r["state_equal"] and r["lost_steps"] == 0, r

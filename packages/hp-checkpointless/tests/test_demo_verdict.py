"""`hp demo`'s bit-equality can fail: a real job whose replacement rank ends one ulp off in one weight.

The demo's training script moves one weight of the process that took rank 1 over (a promoted spare) by
one ulp after the last commit (``--ulp-after-recovery 1``, a harness self-test flag). Every loss is still
the reference's bits, so only the final-state comparison of every rank can see it, and it must."""

from __future__ import annotations

import pytest

from hp.checkpointless.demo.run import DemoConfig, run_demo
from hp.testing import kill_tagged


@pytest.mark.timeout(280)
def test_one_ulp_in_a_replacement_s_weights_fails_bit_equality(tmp_path, monkeypatch):
    (tmp_path / "cache").mkdir()
    monkeypatch.setenv("HP_DATA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HP_TEST_DIR", str(tmp_path))
    cfg = DemoConfig(nproc=2, spares=1, steps=10, fault_step=4, corpus_mb=2, hang_timeout_s=20.0,
                     train_args=["--ulp-after-recovery", "1"], log_dir=str(tmp_path / "logs"))
    try:
        r = run_demo(cfg)
    finally:
        kill_tagged(f"HP_TEST_DIR={tmp_path}")
    assert r["completed"], r.get("error_tail")
    assert r["losses_equal"] is True and r["lost_steps"] == 0  # the losses cannot see it
    assert r["state_equal"] is False and r["bitwise_equal"] is False
    assert "rank 1 params: not the reference's" in r["state_differences"]
    assert "rank 1 params: not rank 0's" in r["state_differences"]

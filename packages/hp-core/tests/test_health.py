"""Health checks before re-entry (family ``health``): which apply to which device, and the first failure."""

from __future__ import annotations

from hp.core.health import CudaHealth, HealthCheck, first_failure
from hp.core.plugins import backends


class Broken(HealthCheck):
    name = "broken"

    def applies(self, device: str) -> bool:
        return device == "cpu"

    def run(self, device: str) -> str | None:
        return f"{device} is on fire"


def test_the_cuda_check_is_built_in_and_only_for_cuda_devices():
    assert isinstance(backends("health")["cuda"], CudaHealth)
    assert CudaHealth().applies("cuda:3") and not CudaHealth().applies("cpu")
    assert first_failure(backends("health").values(), "cpu") is None  # nothing to check on a CPU rank


def test_the_first_failing_check_for_the_device_is_named_with_its_reason():
    assert first_failure([CudaHealth(), Broken()], "cpu") == ("broken", "cpu is on fire")
    assert first_failure([Broken()], "cuda:0") is None  # not for that device


def test_a_bad_minimum_free_memory_is_refused_by_hp_run_in_one_line(tmp_path):
    import os
    import subprocess
    import sys

    from hp.core.health import min_free_mb

    assert min_free_mb({}) == 256 and min_free_mb({"HP_HEALTH_MIN_FREE_MB": "1024"}) == 1024
    done = subprocess.run([sys.executable, "-m", "hp.core.cli", "run", "--nproc-per-node", "1", "--log-dir",
                           str(tmp_path / "logs"), "-m", "json.tool"],
                          env={**os.environ, "HP_HEALTH_MIN_FREE_MB": "lots"}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "HP_HEALTH_MIN_FREE_MB must be a non-negative integer (MiB), got 'lots'" in done.stderr
    assert not (tmp_path / "logs").exists()  # refused before anything started

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

"""The chaos scenario suite CI runs (``integration/scenarios/``): every scenario file through the
hp-chaos pytest plugin, which fails a test with the scenario's unmet expectations and prints the
recovery time of every fault at the end of the session."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

SCENARIOS = sorted((Path(__file__).parent / "scenarios").glob("*.yaml"))

# Scenarios whose job does not exist yet: `hp chaos run` raises NotImplementedError naming it.
FOLLOW_UP = {
    "storage-outage": "needs a scenario job that checkpoints through hp-tiered-ckpt (issue 5) to an S3 endpoint "
                      "the harness starts; the storage fault itself is tested in "
                      "packages/hp-chaos/tests/test_storage_fault.py",
}


def _param(path: Path):
    marks = [pytest.mark.xfail(strict=True, raises=NotImplementedError, reason=FOLLOW_UP[path.stem])] \
        if path.stem in FOLLOW_UP else []
    return pytest.param(path, id=path.stem, marks=marks)


@pytest.mark.parametrize("path", [_param(p) for p in SCENARIOS])
def test_scenario(chaos_run, path):
    chaos_run(path)


def test_every_fault_kind_has_a_scenario_and_two_node_faults_run_on_two_nodes():
    from hp.chaos.faults import fault_kinds

    used: dict[str, set[int]] = {}
    for path in SCENARIOS:
        raw = yaml.safe_load(path.read_text())
        assert raw["name"] == path.stem, f"{path.name}: name must match the file name"
        for fault in raw["faults"]:
            used.setdefault(fault["kind"], set()).add(raw["job"].get("nodes", 1))
    assert set(used) == set(fault_kinds())
    assert used["partition"] == {2} and used["node"] == {2}

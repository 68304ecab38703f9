"""The chaos scenario suite CI runs (``integration/scenarios/``): every scenario file through the
hp-chaos pytest plugin, which fails a test with the scenario's unmet expectations and prints the
recovery time of every fault at the end of the session."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

SCENARIOS = sorted((Path(__file__).parent / "scenarios").glob("*.yaml"))


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem) for p in SCENARIOS])
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

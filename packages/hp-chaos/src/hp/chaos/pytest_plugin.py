"""pytest plugin of hp-chaos (``pytest11`` entry point ``hp_chaos``): scenarios inside tests.

```python
@pytest.mark.chaos_scenario("scenarios/kill-rank.yaml")   # relative to the test file
def test_kill(chaos_scenario):                           # the run's result; the test already
    assert chaos_scenario["recovery_s"][0] < 5           # failed if an expectation was unmet

def test_many(chaos_run):                                # or run one (or several) yourself
    result = chaos_run("scenarios/hang.yaml")
```

A scenario whose expectations are not met fails its test with the list of unmet expectations. At
the end of the session a table of recovery times is printed, gathered from every test that ran a
scenario (under ``pytest -n 2`` too: results travel to the controller in the reports'
``user_properties``). Fault-free reference runs are cached per job for the whole session and
shared by xdist workers. Nothing heavy is imported unless a scenario runs: this plugin is loaded
in every pytest session where hp-chaos is installed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

_PROPERTY = "hp_chaos"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "chaos_scenario(path): run this hp chaos scenario file (relative to the "
                                       "test file) for the chaos_scenario fixture")
    config.pluginmanager.register(_Summary(), "hp_chaos_summary")


def _session_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.getbasetemp()
    # xdist workers get basetemp/popen-gwN under one session directory: share its parent
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def chaos_reference_cache(tmp_path_factory: pytest.TempPathFactory):
    """Fault-free runs of the session, by job (:class:`hp.chaos.references.ReferenceCache`)."""
    from hp.chaos.references import ReferenceCache

    return ReferenceCache(str(_session_root(tmp_path_factory) / "hp-chaos-references"))


@pytest.fixture(scope="session")
def chaos_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment of the scenario jobs: a data cache of the session's own (not /dev/shm)."""
    cache = _session_root(tmp_path_factory) / "hp-chaos-data"
    cache.mkdir(exist_ok=True)
    return {"HP_DATA_CACHE_DIR": str(cache)}


@pytest.fixture
def chaos_run(request: pytest.FixtureRequest, tmp_path: Path, chaos_reference_cache, chaos_env):
    """``chaos_run(path_or_scenario, check=True, **run_kw) -> result``: run a scenario; with ``check``
    the test fails with the unmet expectations. Relative paths are from the test file's folder."""
    from hp.chaos.runner import run_scenario
    from hp.chaos.scenario import Scenario, load_scenario

    runs = 0

    def run(scenario: str | os.PathLike | Scenario, check: bool = True, **run_kw) -> dict:
        nonlocal runs
        if not isinstance(scenario, Scenario):
            path = Path(scenario)
            scenario = load_scenario(path if path.is_absolute() else request.path.parent / path)
        runs += 1
        result = run_scenario(scenario, log_dir=str(tmp_path / f"chaos{runs}"), cache=chaos_reference_cache,
                              env={**chaos_env, **run_kw.pop("env", {})}, **run_kw)
        request.node.user_properties.append((_PROPERTY, json.dumps(_summary(result))))
        if check and not result["passed"]:
            unmet = "\n".join(f"  - {f}" for f in result["failures"])
            pytest.fail(f"scenario {result['name']}: unmet expectations:\n{unmet}\nlogs: {result['log_dir']}",
                        pytrace=False)
        return result

    return run


@pytest.fixture
def chaos_scenario(request: pytest.FixtureRequest, chaos_run) -> dict:
    """The result of the scenario named by the test's ``chaos_scenario(path)`` marker."""
    marker = request.node.get_closest_marker("chaos_scenario")
    if marker is None or not marker.args:
        pytest.fail("the chaos_scenario fixture needs @pytest.mark.chaos_scenario('path/to/scenario.yaml')",
                    pytrace=False)
    return chaos_run(marker.args[0])


def _summary(r: dict) -> dict:
    return {"name": r["name"], "passed": r["passed"], "recovery_s": r["recovery_s"], "lost_steps": r["lost_steps"],
            "bitwise_equal": r["bitwise_equal"], "goodput": r["goodput"],
            "faults": [f["fault"] for f in r["faults"]]}


class _Summary:
    """Collects every scenario result reported in the session (from xdist workers too)."""

    def __init__(self) -> None:
        self.results: list[dict] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            self.results += [json.loads(v) for k, v in report.user_properties if k == _PROPERTY]

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.results:
            return
        tr = terminalreporter
        tr.write_sep("=", "hp chaos: recovery time per fault (fault -> next committed step)")
        rows = [("scenario", "verdict", "fault", "recovery", "lost", "bit-equal", "goodput")]
        for r in sorted(self.results, key=lambda r: r["name"]):
            gp = "-" if r["goodput"] is None else f"{r['goodput']:.2f}"
            for i, (fault, secs) in enumerate(zip(r["faults"], r["recovery_s"])):
                head = (r["name"], "passed" if r["passed"] else "FAILED") if i == 0 else ("", "")
                tail = (str(r["lost_steps"]), "yes" if r["bitwise_equal"] else "NO", gp) if i == 0 else ("", "", "")
                rows.append((*head, fault, "-" if secs is None else f"{secs:.3f} s", *tail))
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        for row in rows:
            tr.write_line("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())

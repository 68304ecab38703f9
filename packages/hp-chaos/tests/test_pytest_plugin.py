"""The pytest plugin in a real ``pytest -n 2`` session: a marked test gets its scenario's result, an
unmet expectation fails its test with the list, the terminal summary shows every scenario's
recovery time (gathered from both xdist workers), and the two workers share one reference run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

JOB = "job: {nodes: 1, nproc_per_node: 2, spares: 1, steps: 6, model: tiny, seed: 0}\n"

TESTS = '''
import pytest

@pytest.mark.chaos_scenario("kill.yaml")
def test_marked(chaos_scenario):
    assert chaos_scenario["passed"] and chaos_scenario["bitwise_equal"]
    assert chaos_scenario["recovery_s"][0] > 0

def test_unmet(chaos_run):
    chaos_run("unmet.yaml")
'''


@pytest.mark.timeout(600)  # three real jobs on a shared 2-core machine; the bound only catches hangs
def test_plugin_runs_scenarios_under_xdist_and_summarises_recovery_times(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    (tmp_path / "test_chaos.py").write_text(TESTS)
    (tmp_path / "kill.yaml").write_text("name: plugin-kill\n" + JOB + textwrap.dedent("""\
        faults: [{at_step: 3, phase: allreduce, kind: kill, target: "rank:1"}]
        expect: {completes: true, bitwise_equal: true, lost_steps: 0}
        """))
    (tmp_path / "unmet.yaml").write_text("name: plugin-unmet\n" + JOB + textwrap.dedent("""\
        faults: [{at_step: 3, kind: exception, target: "rank:0"}]
        expect: {completes: true, recoveries: 0}
        """))
    base = tmp_path / "basetemp"
    out = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", f"--basetemp={base}", "-rf",
                          str(tmp_path / "test_chaos.py")], cwd=tmp_path, capture_output=True, text=True,
                         timeout=560, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    text = out.stdout + out.stderr
    assert out.returncode == 1, text  # one test failed, on purpose
    assert "1 failed, 1 passed" in text, text
    assert "scenario plugin-unmet: unmet expectations:" in text and "recoveries: expected <= 0, got 1" in text
    summary = text[text.index("hp chaos: recovery time per fault"):]
    lines = {line.split()[0]: line.split() for line in summary.splitlines()[1:] if line.startswith("plugin-")}
    assert set(lines) == {"plugin-kill", "plugin-unmet"}, summary
    assert lines["plugin-kill"][1] == "passed" and lines["plugin-unmet"][1] == "FAILED"
    assert "exception of rank:0 at step 3 (forward)" in summary
    # both workers needed the same fault-free job: it ran once
    assert len(list((base / "hp-chaos-references").glob("reference-*.json"))) == 1

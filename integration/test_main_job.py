"""The README's two commands are the ones CI runs, and the main job trains and exits 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    """The first two commands of the README's first code block."""
    text = (ROOT / "README.md").read_text()
    block = text.split("```")[1].splitlines()[1:]
    return [line.split("#")[0].strip() for line in block if line.strip() and not line.startswith("#")][:2]


def test_ci_runs_exactly_the_readme_commands():
    setup_and_main, tests = readme_commands()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert setup_and_main.startswith("./scripts/setup.sh && .venv/bin/hp run")
    assert setup_and_main in ci and tests in ci
    assert tests == ".venv/bin/python -m pytest -n 2"


def test_main_job_trains_on_four_local_workers(tmp_path):
    main_job = readme_commands()[0].split("&& ", 1)[1].split()
    assert main_job[0] == ".venv/bin/hp"
    cmd = [sys.executable, "-m", "hp.core.cli", *main_job[1:], "--steps", "6"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    losses = [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("[rank0]:step")]
    assert len(losses) == 6 and all(0 < loss < 10 for loss in losses)
    assert "[rank0]:done: 6 steps on 4 ranks" in out.stdout

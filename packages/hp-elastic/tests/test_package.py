"""The distribution installs, imports on its own, depends only on hp-core among hp-* dists, and
``import hp.elastic`` stays light (no torch until a name that needs it is used)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import distribution, requires
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import hp.elastic


def test_imports_and_depends_on_hp_core_and_hp_checkpointless():
    assert hp.elastic.__all__ and all(hasattr(hp.elastic, n) for n in hp.elastic.__all__)
    hp_deps = [r for r in requires("hp-elastic") or [] if r.startswith("hp-")]
    assert hp_deps == ["hp-core==0.1.0", "hp-checkpointless==0.1.0"], hp_deps  # DESIGN.md: a scale event is a re-form
    assert distribution("hp-elastic").version == "0.1.0"


def test_declares_what_it_imports():
    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    names = {d.split("=")[0].split(">")[0].split("<")[0].strip().lower() for d in deps}
    assert names == {"hp-core", "hp-checkpointless", "torch", "pyyaml"}, deps


def test_import_does_not_load_torch():
    code = ("import sys, hp.elastic; from hp.elastic import ScalingPolicy, decide, owned; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

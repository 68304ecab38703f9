"""The distribution installs, imports on its own and depends only on hp-core."""

from importlib.metadata import distribution, requires

import hp.checkpointless


def test_imports_and_depends_only_on_hp_core():
    assert hp.checkpointless.__all__ == [] or all(hasattr(hp.checkpointless, n) for n in hp.checkpointless.__all__)
    hp_deps = [r for r in requires("hp-checkpointless") or [] if r.startswith("hp-") and "extra ==" not in r]
    assert hp_deps == ["hp-core==0.1.0"], hp_deps
    assert distribution("hp-checkpointless").version == "0.1.0"

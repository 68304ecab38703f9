"""The distribution installs, imports on its own and depends only on hp-core."""

from importlib.metadata import distribution, requires

import hp.elastic


def test_imports_and_depends_only_on_hp_core():
    assert hp.elastic.__all__ == [] or all(hasattr(hp.elastic, n) for n in hp.elastic.__all__)
    hp_deps = [r for r in requires("hp-elastic") or [] if r.startswith("hp-")]
    assert hp_deps == ["hp-core==0.1.0"], hp_deps
    assert distribution("hp-elastic").version == "0.1.0"

"""The distribution installs, imports on its own and depends only on hp-core."""

from importlib.metadata import distribution, requires

import hp.tiered_ckpt


def test_imports_and_depends_only_on_hp_core():
    assert hp.tiered_ckpt.__all__ == [] or all(hasattr(hp.tiered_ckpt, n) for n in hp.tiered_ckpt.__all__)
    hp_deps = [r for r in requires("hp-tiered-ckpt") or [] if r.startswith("hp-")]
    assert hp_deps == ["hp-core==0.1.0"], hp_deps
    assert distribution("hp-tiered-ckpt").version == "0.1.0"

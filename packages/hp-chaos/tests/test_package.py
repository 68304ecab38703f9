"""The distribution installs, imports on its own and depends only on hp-core."""

from importlib.metadata import distribution, requires

import hp.chaos


def test_imports_and_depends_on_the_hp_distributions_it_drives():
    assert hp.chaos.__all__ == [] or all(hasattr(hp.chaos, n) for n in hp.chaos.__all__)
    hp_deps = sorted(r for r in requires("hp-chaos") or [] if r.startswith("hp-") and "extra ==" not in r)
    assert hp_deps == ["hp-checkpointless==0.1.0", "hp-core==0.1.0", "hp-elastic==0.1.0", "hp-tiered-ckpt==0.1.0"], hp_deps
    assert distribution("hp-chaos").version == "0.1.0"

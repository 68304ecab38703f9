"""The plugin manager checks its plugins at load (pluggy's ``check_pending``): a hook implementation that no
hookspec declares (a misspelt name) or that takes an argument its spec lacks is a one-line error, in code and
from the ``hp`` command with such a plugin installed, instead of a hook silently never called."""

from __future__ import annotations

import subprocess
import sys
import types

import pluggy
import pytest

from hp.core.hookspecs import PROJECT_NAME
from hp.core.plugins import PluginError, backends, make_plugin_manager

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


def plugin(name: str, **hooks) -> types.ModuleType:
    module = types.ModuleType(name)
    for hook, fn in hooks.items():
        setattr(module, hook, hookimpl(fn))
    return module


def test_a_misspelt_hook_is_a_one_line_error_naming_the_plugin_and_the_hooks():
    with pytest.raises(PluginError) as e:
        make_plugin_manager((plugin("typo_plugin", hp_schedular_backends=lambda: []),),)
    said = str(e.value)
    assert "\n" not in said and said.startswith("plugin typo_plugin (")
    assert "unknown hook 'hp_schedular_backends'" in said and "hp_scheduler_backends" in said


def test_an_argument_no_spec_has_is_a_one_line_error():
    with pytest.raises(PluginError) as e:
        make_plugin_manager((plugin("args_plugin", hp_scheduler_backends=lambda cluster: []),))
    assert "\n" not in str(e.value) and "'cluster'" in str(e.value) and "hp_scheduler_backends" in str(e.value)


def test_a_correct_plugin_is_called_through_the_hook_and_named_by_its_distribution():
    class Extra:
        name = "extra"

    pm = make_plugin_manager((plugin("extra_plugin", hp_scheduler_backends=lambda: [Extra()]),))
    found = backends("scheduler", pm)
    assert {"local", "slurm", "kubernetes", "extra"} <= set(found)
    from hp.core.plugins import list_backends

    rows = {(b.family, b.name): b.dist for b in list_backends(pm)}
    assert rows[("scheduler", "extra")] == "(registered at run time)" and rows[("scheduler", "slurm")] == "hp-core"


def test_hp_with_a_misspelt_plugin_installed_says_so_in_one_line(tmp_path):
    (tmp_path / "typo_hp_plugin.py").write_text(
        "import pluggy\nhookimpl = pluggy.HookimplMarker('hp')\n\n"
        "@hookimpl\ndef hp_cli_comands(subparsers):\n    pass\n")
    info = tmp_path / "typo_hp_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: typo-hp-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[hp]\ntypo = typo_hp_plugin\n")
    done = subprocess.run([sys.executable, "-m", "hp.core.cli", "backends"], capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("hp: error: plugin typo_hp_plugin (typo-hp-plugin): ")
    assert "unknown hook 'hp_cli_comands'" in done.stderr


def test_a_familys_backends_are_built_once_per_plugin_manager_and_each_scheduler_is_its_own_entry_point():
    built = []

    class Counted:
        name = "counted"

        def __init__(self) -> None:
            built.append(self)

    pm = make_plugin_manager((plugin("counted_plugin", hp_scheduler_backends=lambda: [Counted()]),))
    from hp.core.plugins import get_backend, list_backends

    first = get_backend("scheduler", "counted", pm)
    assert get_backend("scheduler", "counted", pm) is first and backends("scheduler", pm)["counted"] is first
    list_backends(pm)
    assert len(built) == 1  # the agent looks its scheduler up at every heartbeat: it is built once
    other = backends("scheduler", make_plugin_manager((plugin("again", hp_scheduler_backends=lambda: [Counted()]),)))
    assert other["counted"] is not first and len(built) == 2  # another manager builds its own
    names = {impl.plugin_name: impl.plugin.__name__ for impl in pm.hook.hp_scheduler_backends.get_hookimpls()}
    assert {"hp.core.schedulers.local", "hp.core.schedulers.slurm", "hp.core.schedulers.k8s"} <= set(names.values())

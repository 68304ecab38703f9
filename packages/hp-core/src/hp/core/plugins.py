"""The hp plugin manager: hookspecs + every plugin registered under the ``hp`` entry-point group."""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

from hp.core import hookspecs
from hp.core.errors import UnknownBackendError, UsageError
from hp.core.hookspecs import PROJECT_NAME

if TYPE_CHECKING:
    from hp.core.scaling import Scaler

ENTRY_POINT_GROUP = "hp"

# family name -> the hook that contributes its backends. Packages that add a family (hp-chaos adds
# ``fault``) declare it as ``FAMILY_HOOKS`` in the hookspec module they register under ``hp.hookspecs``.
FAMILY_HOOKS: dict[str, str] = {
    "transport": "hp_transport_backends",
    "scheduler": "hp_scheduler_backends",
    "store": "hp_store_backends",
    "storage": "hp_storage_tiers",
    "node_service": "hp_node_services",
    "health": "hp_health_checks",
}


@dataclass(frozen=True)
class BackendInfo:
    """One discovered backend: which family, its name and the distribution that provides it."""

    family: str
    name: str
    dist: str

    def as_dict(self) -> dict[str, str]:
        return {"family": self.family, "name": self.name, "dist": self.dist}


class PluginError(UsageError):
    """A plugin that does not fit the hookspecs (a misspelt hook, an argument no spec has), in one line."""


@functools.lru_cache(maxsize=1)
def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager with every ``hp`` entry point loaded and checked."""
    return make_plugin_manager()


def make_plugin_manager(plugins: tuple[object, ...] = ()) -> pluggy.PluginManager:
    """A plugin manager with hp's hookspecs (and those other packages declare under ``hp.hookspecs``), every
    ``hp`` entry point and ``plugins`` registered, then ``check_pending``: a hook implementation that no spec
    declares (a misspelt name) is a :class:`PluginError` here, not a hook silently never called."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for module in _extra_hookspec_modules():
        pm.add_hookspecs(module)
        FAMILY_HOOKS.update(getattr(module, "FAMILY_HOOKS", {}))
    try:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        for plugin in plugins:
            pm.register(plugin)
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        dist = _dist_of(pm, e.plugin) if pm.is_registered(e.plugin) else "not registered"
        name = getattr(e.plugin, "__name__", type(e.plugin).__name__)
        raise PluginError(f"plugin {name} ({dist}): " + "; ".join(str(e).splitlines())
                          + f" (the hooks: {', '.join(sorted(_spec_names(pm)))})") from None
    return pm


def _spec_names(pm: pluggy.PluginManager) -> list[str]:
    return [name for name, caller in vars(pm.hook).items() if getattr(caller, "spec", None) is not None]


def _extra_hookspec_modules() -> list[Any]:
    """Hookspec modules of other hp packages, declared under the ``hp.hookspecs`` entry points."""
    from importlib.metadata import entry_points

    return [ep.load() for ep in entry_points(group="hp.hookspecs")]


def _dist_of(pm: pluggy.PluginManager, plugin: object) -> str:
    for plugin_obj, dist in pm.list_plugin_distinfo():
        if plugin_obj is plugin:
            return dist.project_name
    return "(registered at run time)"


# Each family's backends, built once per plugin manager: a lookup (the agent asks for its scheduler at every
# heartbeat) returns the same objects. Backends hold no per-job state; one configured otherwise (a scheduler
# for another cluster, a client with other credentials) is constructed directly, not looked up.
_BUILT: weakref.WeakKeyDictionary[pluggy.PluginManager, dict[str, list[tuple[Any, str]]]] = weakref.WeakKeyDictionary()


def _collect(pm: pluggy.PluginManager, family: str) -> list[tuple[Any, str]]:
    """Every backend of ``family`` with the distribution that contributed it (built on the first call)."""
    if family not in FAMILY_HOOKS:
        raise UnknownBackendError("plugin family", family, list(FAMILY_HOOKS))
    built = _BUILT.setdefault(pm, {})
    if family not in built:
        built[family] = _build(pm, family)
    return built[family]


def _build(pm: pluggy.PluginManager, family: str) -> list[tuple[Any, str]]:
    name = FAMILY_HOOKS[family]
    plugins = [impl.plugin for impl in getattr(pm.hook, name).get_hookimpls()]
    found: list[tuple[Any, str]] = []
    for plugin in plugins:  # each plugin's call through pluggy (tracing, wrappers), to name its distribution
        one = pm.subset_hook_caller(name, remove_plugins=[p for p in plugins if p is not plugin])
        for backend in [b for result in one() for b in result or []]:
            found.append((backend, _dist_of(pm, plugin)))
    seen: dict[str, str] = {}
    for backend, dist in found:
        if backend.name in seen:
            raise RuntimeError(
                f"{family} backend {backend.name!r} is provided twice ({seen[backend.name]} and {dist})"
            )
        seen[backend.name] = dist
    return found


def backends(family: str, pm: pluggy.PluginManager | None = None) -> dict[str, Any]:
    """All backends of a family, by name."""
    return {b.name: b for b, _ in _collect(pm or get_plugin_manager(), family)}


def get_backend(family: str, name: str, pm: pluggy.PluginManager | None = None) -> Any:
    """The backend called ``name`` in ``family``; :class:`UnknownBackendError` if none is."""
    found = backends(family, pm)
    if name not in found:
        raise UnknownBackendError(family, name, list(found))
    return found[name]


def list_backends(pm: pluggy.PluginManager | None = None) -> list[BackendInfo]:
    """Every discovered backend and CLI command, sorted by family then name."""
    pm = pm or get_plugin_manager()
    infos = [
        BackendInfo(family, backend.name, dist)
        for family in list(FAMILY_HOOKS)
        for backend, dist in _collect(pm, family)
    ]
    infos += _cli_commands(pm)
    return sorted(infos, key=lambda i: (i.family, i.name))


def _cli_commands(pm: pluggy.PluginManager) -> list[BackendInfo]:
    import argparse

    infos = []
    plugins = [impl.plugin for impl in pm.hook.hp_cli_commands.get_hookimpls()]
    for plugin in plugins:
        sub = argparse.ArgumentParser().add_subparsers()
        pm.subset_hook_caller("hp_cli_commands", remove_plugins=[p for p in plugins if p is not plugin])(subparsers=sub)
        infos += [BackendInfo("cli", name, _dist_of(pm, plugin)) for name in sub.choices]
    return infos


def load_scaler(policy: str, pm: pluggy.PluginManager | None = None) -> Scaler:
    """The scaling decision of an elastic job (``hp run --scaling-policy FILE``), from the plugin that
    implements ``hp_scaler`` (hp-elastic); a :class:`UsageError` when none does or the policy is bad."""
    scaler = (pm or get_plugin_manager()).hook.hp_scaler(policy=policy)
    if scaler is None:
        raise UsageError("--scaling-policy needs a plugin implementing hp_scaler: pip install hp-elastic")
    return scaler

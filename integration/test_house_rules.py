"""The house rules of hp's source, read from the source itself (ast), so that a refactoring cannot quietly undo them:

- no module reads another object's private attributes (``other._x``): a part that needs something of another
  gets it passed in or through a public name. Third-party privates hp cannot avoid are used only in the module
  that is the seam for that library, each listed below with why;
- no shipped module imports the test helpers (``hp.testing``);
- no import circle among hp's modules (``scripts/import_graph.py``: TYPE_CHECKING and function-level imports
  count, they are dependencies too).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(ROOT.glob("packages/*/src/hp/**/*.py"))

# (module path under src/, attribute): the seam that owns a library's private, and why
SEAMS: dict[str, dict[str, str]] = {
    "hp/core/pg.py": dict.fromkeys(
        ("_world", "_abort_process_group", "_resolve_process_group", "_register_process_group",
         "_get_default_group", "_set_pg_timeout", "_get_backend", "_timeout", "_dim_group_names", "_pg_registry",
         "_unregister_process_group", "_unregister_all_process_groups", "_destroy_process_group"),
        "torch.distributed's process-group internals: the one seam (torchft's ProcessGroup.configure)"),
    "hp/checkpointless/sharded.py": dict.fromkeys(
        ("_overlap_with_ddp", "_partition_parameters", "_clear_cache", "_local_step", "_opt_called",
         "_init_local_optimizer", "_build_param_buckets", "_optim_constructor", "_optim_defaults",
         "_sync_param_groups"),
        "ZeroRedundancyOptimizer's internals, needed to rebuild a lost shard: ZeRO's seam"),
    "hp/checkpointless/fsdp.py": dict.fromkeys(
        ("_get_fsdp_state", "_is_root", "_unsharded_param"), "FSDP2's per-module state: FSDP2's seam"),
    "hp/core/fork_context.py": dict.fromkeys(
        ("_forkserver", "_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_lock"),
        "torch.multiprocessing's fork server, reused as the node's: the fork server's seam"),
    "hp/core/forkserver.py": dict.fromkeys(("_forkserver", "_forkserver_alive_fd", "_run_exitfuncs"),
                                           "the same fork server; atexit handlers run before a fork's os._exit"),
    "hp/core/warm_server.py": dict.fromkeys(("_run_exitfuncs", "_shutdown"),
                                            "a forked program's interpreter exit, done by hand before os._exit"),
    "hp/core/commands.py": {"_run_exitfuncs": "hp run's exit through os._exit runs atexit handlers first"},
    "hp/core/cli.py": {"_actions": "argparse has no public list of a parser's sub-parser actions"},
}
# names that are public API despite the underscore
PUBLIC = {"_exit": "os._exit", "_SubParsersAction": "argparse's type of add_subparsers(), used in annotations",
          "_metadata": "a state dict's documented _metadata attribute (nn.Module.state_dict)",
          "_asdict": "a named tuple's public method", "_replace": "a named tuple's public method",
          "_fields": "a named tuple's public attribute"}


def _private_reads(path: Path) -> list[tuple[int, str]]:
    """``other._x`` (not ``self``/``cls``), and ``from hp.… import _x``: another module's private name."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hp.") and not node.level:
            hits += [(node.lineno, a.name) for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        hits.append((node.lineno, node.attr))
    return hits


def test_no_module_reads_another_objects_private_attributes():
    found = []
    for path in SOURCES:
        rel = str(path.relative_to(path.parents[len(path.relative_to(ROOT).parts) - 4]))  # hp/...
        allowed = SEAMS.get(rel, {})
        found += [f"{path.relative_to(ROOT)}:{line}: .{attr}" for line, attr in _private_reads(path)
                  if attr not in allowed and attr not in PUBLIC]
    assert not found, "private attributes of other objects read outside their seam:\n" + "\n".join(found)


def test_the_private_check_finds_a_read_of_another_objects_private(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("from hp.core.x import _hidden, shown\n"
                      "class A:\n    def f(self, other):\n        return self._mine, other._theirs\n")
    assert sorted(_private_reads(sample)) == [(1, "_hidden"), (4, "_theirs")]


def test_no_shipped_module_imports_the_test_helpers():
    found = []
    for path in SOURCES:
        if "hp/testing/" in path.as_posix():
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                      if n == "hp.testing" or n.startswith("hp.testing.")]
    assert not found, "shipped modules importing hp.testing:\n" + "\n".join(found)


@pytest.fixture(scope="module")
def import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_circle_among_hps_modules(import_graph):
    circles = import_graph.circles(import_graph.edges(import_graph.modules(ROOT)))
    assert not circles, "import circles:\n" + "\n".join(", ".join(c) for c in circles)


def test_the_circle_check_finds_a_circle(import_graph):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_graph.circles(graph) == [["a", "b", "c"]]

"""Repository layout: top level, Pants BUILD files vs. disk, dependency rule, declared dependencies vs. real
imports, wheels, import isolation, each distribution installed alone."""

from __future__ import annotations

import ast
import builtins
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
DISTS = ("hp-core", "hp-elastic", "hp-checkpointless", "hp-tiered-ckpt", "hp-chaos")
CORE = "hp-core"
# DESIGN.md's allowed directions beyond "everything -> hp-core": a scale event is a re-form and hydration
# of the checkpointless runtime, so hp-elastic builds on hp-checkpointless; the chaos harness runs and
# measures hp jobs of every kind, so it depends on what it drives (and nothing depends on it)
ALSO_ALLOWED = {"hp-elastic": {"hp-checkpointless"},
                "hp-chaos": {"hp-checkpointless", "hp-elastic", "hp-tiered-ckpt"}}
Target = tuple[str, dict[str, Any]]


def import_name(dist: str) -> str:
    """The distribution's own package under the ``hp`` namespace (``hp-tiered-ckpt`` -> ``tiered_ckpt``)."""
    return dist.removeprefix("hp-").replace("-", "_")


def import_packages(dist: str) -> list[str]:
    """Every package the distribution ships under ``hp``: its own and any other it declares (hp-core ships the
    opt-in test helpers ``hp.testing`` beside ``hp.core``)."""
    return sorted(p.name for p in (ROOT / "packages" / dist / "src" / "hp").iterdir()
                  if p.is_dir() and p.name != "__pycache__")


def owner_of(package: str) -> str:
    """The distribution that ships ``hp.<package>`` (``?hp.<package>`` when none does)."""
    return next((d for d in DISTS if package in import_packages(d)), f"?hp.{package}")


def pyproject(pkgdir: Path) -> dict[str, Any]:
    with open(pkgdir / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def project(pkgdir: Path) -> dict[str, Any]:
    return pyproject(pkgdir)["project"]


def req_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    assert m, f"unparsable requirement {req!r}"
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def check_dependency_rule(dist: str, reqs: list[str], where: str) -> None:
    hp_deps = {req_name(r) for r in reqs if req_name(r).startswith("hp-")}
    if dist == CORE:
        assert not hp_deps, f"{where}: {CORE} must depend on no other hp-* distribution, has {sorted(hp_deps)}"
    else:
        assert CORE in hp_deps, f"{where}: {dist} does not depend on {CORE} (requirements: {reqs})"
        extra = hp_deps - {CORE} - ALSO_ALLOWED.get(dist, set())
        assert not extra, f"{where}: {dist} may depend only on {CORE} among hp-* dists, also has {sorted(extra)}"


class _Recorder(dict):  # type: ignore[type-arg]
    """exec() locals: any unknown name (a target type) becomes a function recording its kwargs."""

    def __init__(self) -> None:
        super().__init__(python_artifact=lambda **kw: kw)
        self.targets: list[Target] = []

    def __missing__(self, name: str) -> Any:
        if hasattr(builtins, name):
            return getattr(builtins, name)

        def record(**kwargs: Any) -> None:
            self.targets.append((name, kwargs))

        return record


def parse_build(path: Path) -> list[Target]:
    rec = _Recorder()
    exec(compile(path.read_text(), str(path), "exec"), {}, rec)
    return rec.targets


def build_files() -> list[Path]:
    skip = {".git", ".venv", "node_modules", "__pycache__", "build", "dist"}
    return sorted(p for p in ROOT.rglob("BUILD") if p.is_file() and not skip & set(p.relative_to(ROOT).parts))


def matched(build_dir: Path, kwargs: dict[str, Any]) -> dict[str, set[Path]]:
    """Each include glob of a target -> the files it matches (minus the target's `!` excludes)."""
    globs = kwargs.get("sources", [kwargs["source"]] if "source" in kwargs else [])
    excluded = {p for g in globs if g.startswith("!") for p in build_dir.glob(g[1:])}
    return {g: {p for p in build_dir.glob(g) if p.is_file()} - excluded for g in globs if not g.startswith("!")}


def test_top_level_exists() -> None:
    missing = [n for n in ("integration", "pants.toml", "BUILD", "README.md", ".ci/run") if not (ROOT / n).exists()]
    assert not missing, f"missing at the repository root: {missing}"
    on_disk = {p.name for p in (ROOT / "packages").iterdir() if p.is_dir()}
    assert on_disk == set(DISTS), f"packages/ holds {sorted(on_disk)}; expected exactly {sorted(DISTS)}"


def test_build_files_match_disk() -> None:
    builds = {p: parse_build(p) for p in build_files()}
    problems: list[str] = []
    covered: set[Path] = set()
    for path, targets in builds.items():
        rel = path.relative_to(ROOT)
        for kind, kwargs in targets:
            for glob, files in matched(path.parent, kwargs).items():
                if not files and kind != "python_test_utils":
                    problems.append(f"{rel}: {kind}(name={kwargs.get('name')!r}) glob {glob!r} matches no file")
                if kind == "python_sources":
                    covered |= files
    for pkgdir in sorted(p for p in (ROOT / "packages").iterdir() if p.is_dir()):
        build = pkgdir / "BUILD"
        if build not in builds:
            problems.append(f"{pkgdir.relative_to(ROOT)} has no BUILD file")
            continue
        proj = project(pkgdir)
        if proj["name"] != pkgdir.name:
            problems.append(f"{pkgdir.name}/pyproject.toml names the distribution {proj['name']!r}")
        arts = [kw.get("provides", {}) for kind, kw in builds[build] if kind == "python_distribution"]
        want = {"name": proj["name"], "version": proj["version"]}
        got = [{k: a.get(k) for k in want} for a in arts]
        if got != [want]:
            problems.append(f"{build.relative_to(ROOT)}: python_distribution artifacts {got} != pyproject {want}")
    for py in sorted(ROOT.glob("packages/*/src/hp/**/*.py")):
        if py not in covered and "__pycache__" not in py.parts:
            problems.append(f"{py.relative_to(ROOT)} is owned by no python_sources target")
    assert not problems, "BUILD files disagree with the disk:\n" + "\n".join(problems)


def test_pants_toml_source_roots() -> None:
    with open(ROOT / "pants.toml", "rb") as f:
        cfg = tomllib.load(f)
    assert cfg["GLOBAL"]["pants_version"].startswith("2."), "pants.toml: pants_version is not Pants 2.x"
    assert "pants.backend.python" in cfg["GLOBAL"]["backend_packages"], "pants.toml: Python backend not enabled"
    patterns: list[str] = cfg["source"]["root_patterns"]

    def is_root(rel: str) -> bool:
        # Pants: a leading "/" anchors at the build root, otherwise the pattern matches any suffix.
        return any(
            fnmatch.fnmatchcase(rel, p[1:]) if p.startswith("/") else fnmatch.fnmatchcase(rel, f"*{p}")
            for p in patterns
        )

    dirs = [d for pkg in sorted((ROOT / "packages").iterdir()) for d in (pkg / "src", pkg / "tests") if d.is_dir()]
    uncovered = [str(d.relative_to(ROOT)) for d in dirs if not is_root(str(d.relative_to(ROOT)))]
    uncovered += [n for n in ("integration",) if not is_root(n)]
    assert not uncovered, f"pants.toml [source] root_patterns {patterns} miss {uncovered}"


def test_dependency_rule_and_namespace() -> None:
    for pkgdir in sorted(p for p in (ROOT / "packages").iterdir() if p.is_dir()):
        proj = project(pkgdir)
        check_dependency_rule(proj["name"], proj.get("dependencies", []), f"{pkgdir.name}/pyproject.toml")
        init = pkgdir / "src" / "hp" / "__init__.py"
        assert not init.exists(), f"{init.relative_to(ROOT)} exists: `hp` must stay a PEP 420 namespace"


@pytest.mark.parametrize("dist", DISTS)
def test_wheel_builds(dist: str, tmp_path: Path) -> None:
    # Build from a copy: setuptools reuses a stale build/ dir, which would also race other builds.
    src = tmp_path / "src"
    shutil.copytree(ROOT / "packages" / dist, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    out = tmp_path / "wheels"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)]
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, f"pip wheel {dist} failed:\n{proc.stdout}\n{proc.stderr}"
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, f"pip wheel {dist} produced {wheels}"
    with zipfile.ZipFile(wheels[0]) as whl:
        names = whl.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = whl.read(meta_name).decode()
    assert import_name(dist) in import_packages(dist), f"{dist} has no src/hp/{import_name(dist)}"
    pkgs = [f"hp/{p}/" for p in import_packages(dist)]
    for pkg in pkgs:
        assert f"{pkg}__init__.py" in names, f"{wheels[0].name} lacks {pkg}__init__.py"
    assert "hp/__init__.py" not in names, f"{wheels[0].name} ships hp/__init__.py, breaking the namespace"
    strays = [n for n in names if n.startswith("hp/") and not n.startswith(tuple(pkgs))]
    assert not strays, f"{wheels[0].name} ships modules outside {pkgs}: {strays}"
    assert re.search(rf"^Name: {re.escape(dist)}$", meta, re.M), f"{meta_name} does not name {dist}"
    reqs = [r for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M) if "extra ==" not in r]
    check_dependency_rule(dist, reqs, f"{wheels[0].name} METADATA")


def test_core_imports_alone(tmp_path: Path) -> None:
    code = 'import hp.core, sys; print(sorted(m for m in sys.modules if m.startswith("hp.")))'
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, f"`import hp.core` failed:\n{proc.stderr}"
    loaded: list[str] = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    others = [f"hp.{p}" for d in DISTS if d != CORE for p in import_packages(d)]
    leaked = [m for m in loaded if any(m == o or m.startswith(o + ".") for o in others)]
    assert not leaked, f"importing hp.core also imported other distributions' modules: {leaked}"


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level module name, whether imported at module level) of every absolute import in a file."""
    tree = ast.parse(path.read_text(), str(path))
    module_level = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        out += [(n if n.split(".")[0] == "hp" else n.split(".")[0], id(node) in module_level) for n in names]
    return out


@pytest.mark.parametrize("dist", DISTS)
def test_declared_dependencies_match_real_imports(dist: str) -> None:
    """Every distribution a module imports is declared: a module-level import as a dependency, an import
    inside a function (an optional feature) at least in an extra. Import names map to distributions
    through the installed metadata (``packages_distributions``), not a hand-written table."""
    from importlib.metadata import packages_distributions

    whole = pyproject(ROOT / "packages" / dist)
    proj = whole["project"]
    declared = {req_name(r) for r in proj.get("dependencies", [])}
    extras = {req_name(r) for reqs in proj.get("optional-dependencies", {}).values() for r in reqs}
    # loaded by pytest only: pytest11 entry points, and plugins a conftest names (``pytest_plugins``)
    plugins = {*proj.get("entry-points", {}).get("pytest11", {}).values(),
               *whole.get("tool", {}).get("hp", {}).get("opt-in-pytest-plugins", [])}
    providers = packages_distributions()
    missing = []
    for path in sorted((ROOT / "packages" / dist / "src").rglob("*.py")):
        rel = path.relative_to(ROOT / "packages" / dist / "src").with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        for name, at_module_level in _imports(path):
            if name.split(".")[0] == "hp":
                dists = {owner_of(name.split(".")[1])} if "." in name else set()
            elif name in sys.stdlib_module_names or name == "__future__":
                continue
            else:
                dists = {req_name(d) for d in providers.get(name, [f"?{name}"])}
            if not dists or dist in dists:
                continue
            ok = dists & declared or (dists & extras and (not at_module_level or module in plugins and name == "pytest"))
            if not ok:
                missing.append(f"{module} imports {name} ({'/'.join(sorted(dists))}"
                               f"{'' if at_module_level else ', in a function'})")
    assert not missing, f"{dist}/pyproject.toml does not declare: " + "; ".join(sorted(set(missing)))


# -- each distribution installs alone ------------------------------------------------------------------
# A wheel of it and of the hp distributions it declares, with their declared third-party requirements,
# into a fresh venv; then it imports, and every ``hp`` command (and sub-command) that install offers
# prints its help. torch is installed once, into a directory every venv sees through a ``.pth`` file (a
# CPU wheel is ~700 MB: once per venv would cost minutes); pip counts it as installed, so a requirement on
# torch installs nothing more. Everything else comes from the index, as a user's install would.
# The venvs have no pip of their own: this interpreter's pip installs into them (``pip --python``), and no
# install byte-compiles (``--no-compile``: Python compiles what it imports). Measured for hp-chaos: a
# venv 11.4 s -> 0.1 s, its third-party requirements 80 s -> 17 s, torch 37 s -> 11 s.

PIP_ENV = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
TORCH = os.environ.get("HP_TORCH", "torch==2.13.0")  # as scripts/setup.sh


def _run(cmd: list[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=PIP_ENV, **kw)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


def _once_per_session(tmp_path_factory, name: str, make) -> Path:
    """``make(folder)`` run once for the whole session, whichever xdist worker needs it first (the other
    waits on a lock, then reuses the folder): the install tests of one session share one build."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # popen-gwN's parent: the session's
    folder, done = root / f"repo-layout-{name}", root / f"repo-layout-{name}.done"
    with open(root / f"repo-layout-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def wheels(tmp_path_factory) -> Path:
    def build(out: Path) -> None:
        for dist in DISTS:  # from copies: setuptools reuses a stale build/ dir, which would race other builds
            src = out.parent / f"{out.name}-src" / dist
            shutil.rmtree(src, ignore_errors=True)
            shutil.copytree(ROOT / "packages" / dist, src, ignore=shutil.ignore_patterns("build", "*.egg-info",
                                                                                        "__pycache__"))
            _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                  str(src)])

    return _once_per_session(tmp_path_factory, "wheels", build)


@pytest.fixture(scope="session")
def torch_dir(tmp_path_factory) -> Path:
    return _once_per_session(tmp_path_factory, "torch", lambda target: _run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-compile", "--no-deps", "--target", str(target), TORCH]))


def _requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as whl:
        meta = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    return [r for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M) if "extra ==" not in r]


# Every command and sub-command's --help, in one process of the install's interpreter (a process per command
# paid the install's imports ~40 times for hp-chaos): argparse lists a sub-parser's choices under its metavar
# (``COMMAND ...`` in the usage), one per line, indented by 4; each --help must exit 0.
_WALK = r"""
import contextlib, io, json, re, sys
from hp.core.cli import main

def help_of(path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = main([*path, "--help"])
        except SystemExit as e:
            code = e.code
    if code not in (0, None):
        sys.exit(f"hp {' '.join(path)} --help exited {code}")
    return out.getvalue()

def commands(*prefix):
    text = help_of(prefix)
    metavar = re.search(r"([A-Z][A-Z_]*) \.\.\.\s*$", text.split("\n\n")[0])
    if not metavar:
        return []
    lines = text.splitlines()
    subs = []
    for line in lines[lines.index(f"  {metavar.group(1)}") + 1:]:
        if not line.strip():
            break
        if m := re.match(r"^    ([a-z][a-z0-9_-]*)(\s|$)", line):
            subs.append(m.group(1))
    return [[*prefix, sub] for sub in subs] + [c for sub in subs for c in commands(*prefix, sub)]

print(json.dumps(commands()))
"""


def _commands(hp: Path, cwd: Path) -> list[tuple[str, ...]]:
    """Every command and sub-command of this install's ``hp``, each of which printed its help (exit 0) on
    the way: ``hp --help`` through the installed entry point, the rest from the install's interpreter."""
    assert "COMMAND" in _run([str(hp), "--help"], timeout=120, cwd=cwd).stdout
    out = _run([str(hp.parent / "python"), "-c", _WALK], timeout=300, cwd=cwd).stdout
    return [tuple(c) for c in json.loads(out.strip().splitlines()[-1])]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dist", DISTS)
def test_each_distribution_installs_alone_imports_and_every_command_prints_help(dist, wheels, torch_dir, tmp_path):
    by_name = {req_name(w.name.split("-")[0].replace("_", "-")): w for w in wheels.glob("*.whl")}
    assert set(by_name) == set(DISTS), sorted(by_name)
    closure, todo, third_party = set(), [dist], []
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        for req in _requirements(by_name[name]):
            (todo if req_name(req).startswith("hp-") else third_party).append(req_name(req) if
                                                                              req_name(req).startswith("hp-") else req)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(py)]
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "hp_test_torch.pth").write_text(str(torch_dir) + "\n")
    _run([*pip, "install", "-q", "--no-compile", "--no-deps", *[str(by_name[n]) for n in sorted(closure)]])
    _run([*pip, "install", "-q", "--no-compile", *sorted(set(third_party))])  # torch: already there
    installed = _run([*pip, "list", "--format=freeze"]).stdout
    hp_installed = sorted(req_name(line.split("==")[0]) for line in installed.splitlines()
                          if req_name(line.split("==")[0]).startswith("hp-"))
    assert hp_installed == sorted(closure), f"{dist} alone brought {hp_installed}"
    _run([str(py), "-c", f"import hp.{import_name(dist)}"], timeout=120, cwd=tmp_path)
    hp = venv / "bin" / "hp"
    commands = _commands(hp, cwd=tmp_path)  # each one's --help ran: outside the checkout, from the install
    assert ("run",) in commands and ("backends",) in commands  # hp-core's, in every install

"""The hp import graph, from the source (ast): modules, lines, import edges and the import circles.

``python scripts/import_graph.py [ROOT] [--json OUT]`` reads every module under ``ROOT/packages/*/src/hp``
(default: this checkout), counts an edge A → B for every ``import``/``from … import`` of an hp module in A,
those under ``if TYPE_CHECKING:`` and inside functions included (they are still a dependency of the code),
and prints the strongly connected components of more than one module (the circles), the lines and module
counts per distribution, and the largest modules. Run it at two commits to compare a refactoring
(``git worktree add /tmp/x COMMIT && python scripts/import_graph.py /tmp/x``).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path


def modules(root: Path) -> dict[str, tuple[Path, str]]:
    """Module name → (file, distribution) for every hp module under root/packages/*/src."""
    out = {}
    for src in sorted(root.glob("packages/*/src")):
        dist = src.parent.name
        for f in sorted(src.rglob("*.py")):
            parts = list(f.relative_to(src).with_suffix("").parts)
            if parts[0] != "hp":
                continue
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = (f, dist)
    return out


def _resolve(name: str, known: dict) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def edges(known: dict[str, tuple[Path, str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in known}
    for mod, (path, _) in known.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                hit = _resolve(t, known)
                if hit and hit != mod and not mod.startswith(hit + "."):  # a package's own __init__ is no edge
                    graph[mod].add(hit)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found, key=len, reverse=True)


def classes(known: dict[str, tuple[Path, str]]) -> list[tuple[str, tuple[int, int]]]:
    """Every class: (module.Class, (lines, methods)), largest first."""
    out = []
    for mod, (path, _) in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                out.append((f"{mod}.{node.name}", (node.end_lineno - node.lineno + 1, methods)))
    return sorted(out, key=lambda kv: -kv[1][0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--json", dest="out")
    args = ap.parse_args(argv)
    known = modules(Path(args.root))
    graph = edges(known)
    found = circles(graph)
    lines = {m: len(p.read_text().splitlines()) for m, (p, _) in known.items()}
    per_dist: dict[str, list[int]] = {}
    for m, (_, dist) in known.items():
        per_dist.setdefault(dist, [0, 0])
        per_dist[dist][0] += 1
        per_dist[dist][1] += lines[m]
    print("distribution          modules   lines")
    for dist, (n, total) in sorted(per_dist.items()):
        print(f"{dist:20s} {n:8d} {total:7d}")
    print(f"import circles: {len(found)}")
    for comp in found:
        print(f"  {len(comp)} modules: {', '.join(comp)}")
    big = sorted(lines.items(), key=lambda kv: -kv[1])[:12]
    print("largest modules: " + ", ".join(f"{m} {n}" for m, n in big))
    sizes = classes(known)
    print("largest classes (lines/methods): " + ", ".join(f"{c} {n}/{k}" for c, (n, k) in sizes[:12]))
    if args.out:
        Path(args.out).write_text(json.dumps({
            "distributions": {d: {"modules": n, "lines": t} for d, (n, t) in per_dist.items()},
            "circles": found, "classes": dict(sizes), "edges": {m: sorted(e) for m, e in graph.items()}, "lines": lines}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

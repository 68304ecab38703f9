"""README and docs figures are the committed results file's: every quoted figure links to the value it shows.

A figure is written ``[0.79 s](benchmarks/results/<name>.json#benchmarks.recovery.variants.hp.downtime_s.median)``
(``hp bench all`` writes the file; see :mod:`hp.chaos.bench.suite`). This test resolves each link and
fails when the file, the key or the value is not what the text says, and when a headline figure is
quoted without a link. The same holds on every page of the documentation site (``docs/**/*.md``): a page
links to the file by its path from the page (``../benchmarks/results/...`` from ``docs/``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = [ROOT / "README.md", *sorted((ROOT / "packages").glob("*/README.md"))]
DOCS = sorted((ROOT / "docs").rglob("*.md"))
LINK = re.compile(r"\[([^\]]*?)\]\(((?:\.\./)*benchmarks/results/[\w.-]+\.json)#([\w.\-]+)\)")
NUMBER = re.compile(r"(-?[\d,]*\.?\d+)\s*(ms|s|%|×|x|h|k)?")
SCALE = {"ms": 1000.0, "%": 100.0, "k": 0.001}
MIN_N = 3  # values behind a quoted median (hp bench recovery's default --repeats)
# the figures a reader compares us on: README.md must quote each from the results file
HEADLINE = [
    "benchmarks.recovery.variants.hp.downtime_s.median",
    "benchmarks.recovery.variants.torchrun_dcp.downtime_s.median",
    "benchmarks.recovery.variants.hp.recovery_s.median",
    "benchmarks.goodput.goodput",
    "benchmarks.ckpt.hp_stall_s.warm.median",
    "benchmarks.ckpt.floor_s.median",
]


def resolve(doc: object, path: str) -> object:
    for part in path.split("."):
        if isinstance(doc, list):
            doc = doc[int(part)]
        elif isinstance(doc, dict) and part in doc:
            doc = doc[part]
        else:
            raise KeyError(f"{path}: no {part!r}")
    return doc


def matches(text: str, value: object) -> bool:
    """The first number in ``text`` is ``value`` rounded to the digits shown (in the text's unit)."""
    m = NUMBER.search(text)
    if m is None or not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    shown, unit = m.group(1).replace(",", ""), m.group(2)
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    return round(float(value) * SCALE.get(unit, 1.0), decimals) == float(shown)


def links(readme: Path) -> list[tuple[str, Path, str]]:
    return [(text, (readme.parent / target).resolve(), key) for text, target, key in LINK.findall(readme.read_text())]


def check(readme: Path) -> list[str]:
    """What is wrong with ``readme``'s linked figures: a file not committed, a key it lacks, a value
    that is not the text's, a median over too few values."""
    wrong = []
    for text, path, key in links(readme):
        if not path.is_file():
            wrong.append(f"{text!r}: {path} is not committed")
            continue
        try:
            doc = json.loads(path.read_text())
            value = resolve(doc, key)
            spread = resolve(doc, key.rsplit(".", 1)[0]) if key.endswith(".median") else {"n": MIN_N}
        except (KeyError, IndexError, ValueError) as e:
            wrong.append(f"{text!r}: {e}")
            continue
        if not matches(text, value):
            wrong.append(f"{text!r}: the file holds {value!r} at {key}")
        if not isinstance(spread, dict) or spread.get("n", 0) < MIN_N:  # a smoke run's median is no figure
            wrong.append(f"{text!r}: a median over {spread.get('n') if isinstance(spread, dict) else '?'} values "
                         f"(a quoted median needs >= {MIN_N})")
    return wrong


@pytest.mark.parametrize("readme", READMES + DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_linked_figure_is_the_value_in_the_committed_results_file(readme):
    wrong = check(readme)
    assert not wrong, "\n".join(wrong)


def test_readme_quotes_the_headline_figures_from_a_full_clean_run():
    quoted = links(ROOT / "README.md")
    files = {path for _, path, _ in quoted}
    assert files, "README.md quotes no figure from benchmarks/results/"
    for path in files:
        r = json.loads(path.read_text())
        assert r["schema"] == "hp-bench-results/1" and r["quick"] is False, path
        assert r["clean_tree"] is True and re.fullmatch(r"[0-9a-f]{40}", r["commit"] or ""), path
        assert r["completed"] is True, path
        for name, b in r["benchmarks"].items():
            assert "definition_version" in b and "machine" in b and "load_avg" in b, (path, name)
    missing = [k for k in HEADLINE if k not in {key for _, _, key in quoted}]
    assert not missing, f"README.md does not quote {missing} from the results file"


def test_the_docs_pages_quote_figures_too():
    """The figures moved from the README to docs/ are still checked: the site is not a way around the
    checker (a page with no linked figure would pass it vacuously)."""
    assert DOCS, "docs/ has no pages"
    quoted = [link for page in DOCS for link in links(page)]
    assert len(quoted) >= 100, f"docs/ quotes {len(quoted)} linked figures"
    assert all(path.is_relative_to(ROOT / "benchmarks" / "results") for _, path, _ in quoted)


def test_the_checker_itself_rejects_a_figure_that_is_not_the_value():
    assert matches("0.79 s", 0.7912) and matches("97.3 %", 0.9731) and matches("790 ms", 0.7904)
    assert matches("7.4×", 7.43) and matches("$4,693", 4693.3)
    assert not matches("0.80 s", 0.7912) and not matches("97.4 %", 0.9731) and not matches("fast", 1.0)
    assert not matches("1 s", True)


def test_the_checker_refuses_a_median_of_a_smoke_run(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    spread = {"median": 0.5, "min": 0.4, "max": 0.6, "n": 3}
    (results / "r.json").write_text(json.dumps({"a": spread, "b": {**spread, "n": 1}}))
    readme = tmp_path / "README.md"
    readme.write_text("[0.50 s](benchmarks/results/r.json#a.median) [0.50 s](benchmarks/results/r.json#b.median) "
                      "[0.60 s](benchmarks/results/r.json#b.max) [0.4 s](benchmarks/results/r.json#a.median)")
    assert check(readme) == ["'0.50 s': a median over 1 values (a quoted median needs >= 3)",
                             "'0.4 s': the file holds 0.5 at a.median"]

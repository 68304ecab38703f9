"""The documentation site builds strictly: ``mkdocs build --strict`` over ``mkdocs.yml`` and ``docs/``.

Strict mode turns every warning into a failed build: a nav entry without its page, a page left out of
the nav, a relative link whose target is not there (a page, an anchor, or a committed file outside
docs/ such as a results file: ``docs/_hooks/repo_files.py`` adds those that exist). The site is built
into a temporary directory, never into the repository. mkdocs comes from ``docs/requirements.txt``
(``scripts/setup.sh`` installs it): without it these tests fail, they do not skip."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # material's banner about its successor, not a warning of ours
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, env=env, capture_output=True, text=True, timeout=120)


def test_the_site_builds_strictly(tmp_path):
    out = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    # every page of the nav became a page of the site, and the results files the pages link to came along
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(nav) == pages, "mkdocs.yml's nav and docs/ differ"
    assert any((tmp_path / "site" / "benchmarks" / "results").glob("*.json"))


def test_a_broken_link_fails_the_build(tmp_path):
    """The check above is not vacuous: the same site with one link to a missing page, and one to a results
    file that is not committed, does not build."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    shutil.copytree(ROOT / "benchmarks" / "results", copy / "benchmarks" / "results")
    page = copy / "docs" / "status.md"
    page.write_text(page.read_text() + "\n[a page](concepts/no-such-page.md)\n")
    out = build(copy / "mkdocs.yml", tmp_path / "site")
    assert out.returncode != 0 and "no-such-page.md" in out.stdout + out.stderr, out.stdout + out.stderr
    page.write_text(page.read_text().replace("(concepts/no-such-page.md)", "(../benchmarks/results/no-such.json#a)"))
    out = build(copy / "mkdocs.yml", tmp_path / "site")
    assert out.returncode != 0 and "no-such.json" in out.stdout + out.stderr, out.stdout + out.stderr

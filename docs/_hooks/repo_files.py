"""mkdocs hook: a page may link to a committed file outside docs/ (a results file, a figure's PNG).

Every figure in these pages is a link to a key in ``benchmarks/results/*.json`` (``integration/
test_readme_figures.py`` checks the value), written as the path from the page to the file in the
repository, so that it resolves on disk, on GitHub and in the checker alike. mkdocs only knows files
under ``docs/``; this hook adds each such target that exists, as a static file of the site under its
repository path, before the pages are read. A target that does not exist is not added: mkdocs then
reports the link as broken, which ``mkdocs build --strict`` turns into a failed build. Markdown
pages outside docs/ are never added (they would render without their own links checked): name them
as code, not as links.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


def on_files(files: Files, config) -> Files:
    docs = Path(config["docs_dir"]).resolve()
    root = docs.parent
    for page in [f for f in files if f.is_documentation_page()]:
        for target in LINK.findall(Path(page.abs_src_path).read_text(encoding="utf-8")):
            if "://" in target or target.startswith(("/", "mailto:")):
                continue
            uri = posixpath.normpath(posixpath.join(posixpath.dirname(page.src_uri), target))
            real = (docs / uri).resolve()
            if (not uri.startswith("../") or files.get_file_from_path(uri) is not None
                    or real.suffix == ".md" or not real.is_file() or not real.is_relative_to(root)):
                continue
            files.append(File(uri, str(docs), config["site_dir"], config["use_directory_urls"],
                              dest_uri=real.relative_to(root).as_posix(), inclusion=InclusionLevel.INCLUDED))
    return files

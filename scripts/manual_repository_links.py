"""MkDocs hook: a manual page's link to a repository file outside ``docs/`` resolves in the built site too.

The pages link to repository files relative to ``docs/``, as a reader of the repository sees them
(``../validation/tiny-cpu-tp1/summary.md`` from the accuracy page). The built site holds only ``docs/``, so this hook
copies each linked repository file into the site under ``repository/`` and points the link there. A link to a
repository file that does not exist is left as it is, so ``mkdocs build --strict`` fails on it as on any broken
link. A linked Markdown file is built as a page outside the nav, so its own links must resolve too.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

LINK = re.compile(r"\]\((\.\./[^)\s#]+)(#[^)\s]*)?\)")
SITE_FOLDER = "repository"


def _repository_file(config: MkDocsConfig, page_uri: str, target: str) -> str | None:
    """The repository path (``validation/x/summary.md``) a page's relative link names, if it is a file outside docs."""
    docs = Path(config.docs_dir).resolve()
    root = docs.parent
    path = (docs / page_uri).parent.joinpath(target).resolve()
    if path.is_file() and path.is_relative_to(root) and not path.is_relative_to(docs):
        return path.relative_to(root).as_posix()
    return None


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add every repository file a page links to as a file of the site, under ``repository/``."""
    root = Path(config.docs_dir).resolve().parent
    for page in list(files.documentation_pages()):
        if page.abs_src_path is None:
            continue
        for match in LINK.finditer(Path(page.abs_src_path).read_text(encoding="utf-8")):
            found = _repository_file(config, page.src_uri, match.group(1))
            uri = f"{SITE_FOLDER}/{found}"
            if found is not None and files.get_file_from_path(uri) is None:
                copy = File.generated(config, uri, abs_src_path=str(root / found), inclusion=InclusionLevel.NOT_IN_NAV)
                files.append(copy)
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Point each link to a repository file at its copy in the site."""

    def site_link(match: re.Match[str]) -> str:
        found = _repository_file(config, page.file.src_uri, match.group(1))
        if found is None:
            return match.group(0)
        relative = posixpath.relpath(f"{SITE_FOLDER}/{found}", posixpath.dirname(page.file.src_uri) or ".")
        return f"]({relative}{match.group(2) or ''})"

    return LINK.sub(site_link, markdown)

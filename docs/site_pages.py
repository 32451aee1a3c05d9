"""mkdocs hooks (mkdocs.yml `hooks:`): the pages the documentation site generates when it is
built, and the links of the repository's pages rewritten for the site.

Generated (nothing generated is committed, so it cannot drift from the code): the home page from
README.md, the changelog from CHANGELOG.md, and the reference pages: configuration (the config
models), commands (the argument parser's --help), the metrics catalogue (megarl/metrics.py) and
the benchmark results (bench/results/*.md). Each reference page is committed in docs/reference/
as a short stub that says where its content comes from, so that the links to it resolve on
GitHub as well; the site replaces the stub's text with the generated page. Every page is written for GitHub too, where a link
such as ``../bench/results/moe.md`` is a repository file; on the site that file is a section of
the benchmarks page, and a repository file the site does not hold (a config, a script) reads as
its path in code.
"""

from __future__ import annotations

import posixpath
import re
import sys
from collections.abc import Callable
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
LIST_ITEM = re.compile(r"^(?:[-*+]|\d+\.) ")
NESTED_ITEM = re.compile(r"^  (?:[-*+]|\d+\.) ")
# tests/unit/test_doc_commands.py's marks of a command block, shown on the site as a note above it
MARK = re.compile(r"^(\s*)<!-- (?:illustrative: (.+)|run by (tests/\S+)) -->\s*$")


def on_files(files: Files, config) -> Files:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # megarl from this checkout, installed or not
    for uri, text in _pages_outside_docs().items():
        files.append(File.generated(config, uri, content=text()))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if (generate := _reference_pages().get(page.file.src_uri)) is not None:
        return generate()  # the committed stub's text, replaced (generated pages are written for the site)
    if page.file.generated_by is None:  # a page of docs/
        return site_links(markdown, "docs", page.file.src_uri)
    return markdown


def _pages_outside_docs() -> dict[str, Callable[[], str]]:
    """The site's pages made from repository files outside docs/, by their path in the site."""
    return {
        "index.md": lambda: site_links((ROOT / "README.md").read_text(), "", "index.md"),
        "changelog.md": lambda: site_links((ROOT / "CHANGELOG.md").read_text(), "", "changelog.md"),
    }


def _reference_pages() -> dict[str, Callable[[], str]]:
    """The generated reference pages, by the path in docs/ of the stub each replaces."""
    from megarl.cli import commands_markdown
    from megarl.config.documentation import reference_markdown
    from megarl.metrics import catalogue_markdown

    return {
        "reference/configuration.md": reference_markdown,
        "reference/commands.md": commands_markdown,
        "reference/metrics.md": catalogue_markdown,
        "reference/benchmarks.md": benchmarks_markdown,
    }


def site_links(markdown: str, base: str, page_uri: str) -> str:
    """``markdown`` of a repository page in folder ``base`` (``""``: the root), its relative links
    pointed at the site's pages as seen from ``page_uri`` (a path in the site), and its lists made
    what GitHub shows: a blank line before a list that follows a paragraph line, and an item nested
    by 2 spaces nested by 4 (Python-Markdown would read either as the text above it)."""
    out: list[str] = []
    fenced = False
    for line in markdown.splitlines(keepends=True):
        fenced ^= bool(FENCE.match(line.lstrip()))
        if fenced:
            out.append(line)
            continue
        previous = out[-1] if out else "\n"
        if LIST_ITEM.match(line) and previous.strip() and not LIST_ITEM.match(previous) and not previous[0].isspace():
            out.append("\n")
        line = "  " + line if NESTED_ITEM.match(line) else line
        if mark := MARK.match(line):
            indent, why, test = mark.groups()
            note = f"Illustrative, not run by the tests: {why}." if why else f"Run by `{test}`, which checks this output."
            line = f"{indent}*{note}*\n\n"
        out.append(LINK.sub(lambda m: _site_link(m, base, page_uri), line))
    return "".join(out)


def _site_link(match: re.Match[str], base: str, page_uri: str) -> str:
    bang, text, target = match.groups()
    if re.match(r"[a-z]+:|#", target):  # https:, mailto:, an anchor of this page
        return match.group(0)
    path, _, anchor = target.partition("#")
    repo_path = posixpath.normpath(posixpath.join(base, path))
    site_path = _site_path(repo_path, anchor)
    if site_path is None:
        return f"{text} (`{repo_path}`)" if text.strip("`") != repo_path else f"`{repo_path}`"
    relative = posixpath.relpath(site_path.partition("#")[0], posixpath.dirname(page_uri) or ".")
    fragment = site_path.partition("#")[2]
    return f"{bang}[{text}]({relative}{'#' + fragment if fragment else ''})"


def _site_path(repo_path: str, anchor: str) -> str | None:
    """Where a repository file is on the site (with its anchor), or None when the site lacks it."""
    suffix = f"#{anchor}" if anchor else ""
    if repo_path.startswith("docs/"):
        return repo_path.removeprefix("docs/") + suffix
    if repo_path == "README.md":
        return "index.md" + suffix
    if repo_path == "CHANGELOG.md":
        return "changelog.md" + suffix
    if repo_path.startswith("bench/results/") and repo_path.endswith(".md"):
        return f"reference/benchmarks.md#{Path(repo_path).stem}"
    return None


def benchmarks_markdown() -> str:
    """Every bench/results/*.md as a section (anchored by its file name), its headings one level down."""
    results = sorted((ROOT / "bench" / "results").glob("*.md"))
    out = ["# Benchmark results", "",
           "Generated from `bench/results/` when the site is built: each results file of the benchmark scripts in "
           "`bench/`, with its machine and date. [Benchmarks](../benchmarks.md) sums them up in one table.", ""]  # fmt: skip
    out += [f"- [{_title(p)}](#{p.stem}) (`bench/results/{p.name}`)" for p in results] + [""]
    for path in results:
        out += [f"## {_title(path)} {{#{path.stem}}}", ""]
        out += _demoted(path.read_text().split("\n", 1)[1] if path.read_text().startswith("# ") else path.read_text())
    return "\n".join(out)


def _title(path: Path) -> str:
    first = path.read_text().split("\n", 1)[0]
    return first[2:].strip() if first.startswith("# ") else path.stem


def _demoted(text: str) -> list[str]:
    out, fenced = [], False
    for line in text.splitlines():
        fenced ^= bool(FENCE.match(line.lstrip()))
        out.append("#" + line if not fenced and re.match(r"#{1,5} ", line) else line)
    return [*out, ""]

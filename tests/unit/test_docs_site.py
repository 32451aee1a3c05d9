"""The documentation site builds in strict mode (mkdocs.yml, docs/), its reference pages are
generated in place of their committed stubs (docs/reference/) and hold what the code declares (every config key with its default, every catalogued metric with its
reduction), its links to repository files outside docs/ point at the site's pages, its lists are
lists as on GitHub, and the built
home page renders in a real browser (headless Chromium) with the navigation and the generated
configuration page there."""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config.documentation import describe
from megarl.metrics import CATALOGUE

pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra (pip install -e '.[dev]')")
pytest.importorskip("material", reason="mkdocs-material is in the dev extra (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                            "--site-dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    return out


def _rows(page: Path) -> list[list[str]]:
    """The text of each table row's cells."""
    rows = []
    for row in re.findall(r"<tr>(.*?)</tr>", page.read_text(), flags=re.S):
        rows.append([html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in re.findall(r"<td>(.*?)</td>", row, flags=re.S)])
    return [r for r in rows if r]


def test_configuration_page_lists_every_key_with_its_default(site: Path):
    rows = {r[0]: r for r in _rows(site / "reference" / "configuration.html")}
    keys = [line.split(" = ", 1) for line in describe().splitlines() if " = " in line.split("  ", 1)[0]]
    assert len(keys) > 200
    for key, rest in keys:
        default = rest.split("  (", 1)[0]
        assert key in rows, f"the configuration page lacks {key}"
        assert rows[key][2] == default, f"{key}: the page says {rows[key][2]}, the config {default}"
        assert rows[key][3], f"{key} has no meaning on the page"


def test_metrics_page_lists_the_catalogue_with_its_reductions(site: Path):
    rows = {r[0]: r[1] for r in _rows(site / "reference" / "metrics.html")}
    assert rows == {m.name: m.reduction for m in CATALOGUE}


def _text(page: Path) -> str:
    """The page's text as a reader sees it: tags dropped, entities decoded, spaces collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page.read_text())).split())


# Each reference page the site generates, and what only the generated page holds: a key's row, a
# (sub)command's --help, a metric's row, each results file's section
GENERATED_CONTENT = {
    "configuration": ["<td><code>actor.optimizer.lr</code></td>"],
    "commands": ["usage: megarl convert hf-to-megatron"],
    "metrics": [f"<td><code>{CATALOGUE[-1].name}</code></td>"],
    "benchmarks": [f'id="{p.stem}"' for p in (ROOT / "bench" / "results").glob("*.md")],
}


@pytest.mark.parametrize("page", GENERATED_CONTENT)
def test_reference_pages_are_generated_not_their_committed_stubs(site: Path, page: str):
    # docs/reference/*.md are committed so that the links to them work on GitHub; the hook replaces each
    stub = (ROOT / "docs" / "reference" / f"{page}.md").read_text()
    built = site / "reference" / f"{page}.html"
    opening = " ".join(stub.split("\n\n")[1].split()[:5])  # "This page is generated from": plain words
    assert opening not in _text(built), f"{built.name} shows its stub"
    lacking = [c for c in GENERATED_CONTENT[page] if c not in built.read_text()]
    assert not lacking, f"{built.name} lacks the generated {lacking}"
    assert sorted(p.stem for p in (ROOT / "docs" / "reference").glob("*.md")) == sorted(GENERATED_CONTENT)


def test_links_outside_docs_point_at_the_sites_pages(site: Path):
    # docs/docker.md links ../README.md#make-test; docs/moe.md links ../bench/results/moe.md
    assert 'href="index.html#make-test"' in (site / "docker.html").read_text()
    assert 'href="reference/benchmarks.html#moe"' in (site / "moe.html").read_text()
    assert 'id="moe"' in (site / "reference" / "benchmarks.html").read_text()
    home = (site / "index.html").read_text()  # README.md: docs/x.md -> x.md, a config -> its path in code
    assert 'href="failures.html"' in home and 'src="demo_curves.png"' in home
    assert "<li>embedded Ray;</li>" in home  # a list right after a paragraph line is a list, as on GitHub
    planning = (site / "planning.html").read_text()
    assert "<strong>Memory per GPU, phase by phase:</strong><ul>" in planning  # nested by 2 spaces
    assert "<em>Run by <code>tests/unit/test_doc_commands.py</code>" in planning  # a command block's mark, as a note
    assert not [h for h in re.findall(r'(?:href|src)="([^"]+)"', home) if h.startswith(("docs/", "bench/", "configs/"))]


def _dom(page: Path, profile: Path) -> str:
    """The page's DOM after Chromium loaded it (its scripts ran)."""
    run = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                          "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0 and "</html>" in run.stdout, run.stderr[-2000:]
    return run.stdout


@pytest.mark.skipif(shutil.which("chromium") is None, reason="no chromium here (Debian: apt-get install chromium, as ci/chromium/install.sh does)")
def test_the_built_site_renders_in_chromium(site: Path, tmp_path: Path):
    home = _dom(site / "index.html", tmp_path)
    nav = set(re.findall(r'class="md-nav__link[^"]*"[^>]*href="([^"#]+)"|href="([^"#]+)"[^>]*class="md-nav__link', home))
    linked = {a or b for a, b in nav}
    pages = re.findall(r":\s+([\w/.-]+)\.md\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert len(pages) >= 30 and not {f"{p}.html" for p in pages if p != "index"} - linked, sorted(linked)
    assert "<h1" in home and "Quickstart: two commands" in home
    reference = _dom(site / "reference" / "configuration.html", tmp_path)
    assert re.search(r"<td><code>actor\.optimizer\.lr</code></td>", reference) and "Configuration reference" in reference

"""The manual (README.md, docs/*.md, CHANGELOG.md, every --help) stays true to the code: its
links resolve to committed files (as on GitHub; a reference page the documentation site generates
is committed as a stub, docs/reference/), the config
keys, metrics, repository files (and the functions it names in them), Python names and flags it
names exist, the defaults it states are the config's, docs/configuration.md's overview names every
key, the site's commands page shows `megarl --help` as it is, and the examples in --help pass
`megarl plan`."""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from megarl.cli import build_parser, commands_markdown, main
from megarl.config.documentation import describe
from megarl.config.loading import ConfigError, _section_type
from megarl.config.sections import MegaRLConfig
from megarl.config.verl_keys import is_verl_key
from megarl.metrics import CATALOGUE, UnknownMetricError, lookup

ROOT = Path(__file__).resolve().parents[2]
# docs/reference/: the committed stubs of the reference pages the site generates (docs/site_pages.py)
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "docs" / "reference").glob("*.md"))]  # fmt: skip
SECTIONS = tuple(MegaRLConfig.model_fields)

# Dotted words in the manual that look like config keys but are not meant as ones: misspelt keys
# shown with their error, a directory name and a transformers method.
NOT_KEYS = {"rollout.smapling", "rollout.smapling.temperature", "rollout.temperature", "actor.lr", "reward.KEY",
            "model.unverified", "model.generate", "model.layers"}  # fmt: skip (model.layers: HF tensor names)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as dashes, -1, -2 for repeats."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    anchors: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        anchors.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
    return anchors


def _page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()  # docs/configuration.md and docs/reference/configuration.md


@functools.cache
def _committed() -> set[Path] | None:
    """The files git tracks in this checkout and their folders (what GitHub shows), or None
    outside a git checkout (an unpacked sdist), where a link's file only has to exist."""
    try:
        run = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        return None
    if run.returncode != 0:
        return None
    files = [ROOT / f for f in run.stdout.split("\0") if f]
    return {*files, *(parent for f in files for parent in f.parents)}


def _is_committed(target: Path) -> bool:
    committed = _committed()
    return target.exists() and (committed is None or target.resolve() in committed)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_relative_links_and_anchors_resolve(page: Path):
    """As GitHub renders the page: each relative link is a committed file of the repository (a
    folder: its listing), each anchor a heading of the page it names. A page the site generates
    has a committed stub, so that its links work on GitHub too."""
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = page.parent / path if path else page
        if not _is_committed(target):
            broken.append(f"{link} (no such file committed)")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link} (no such heading in {target.name})")
    assert not broken, f"{page.name}: {broken}"


def _is_key(dotted: str) -> bool:
    try:
        describe(dotted)
        return True
    except ConfigError:
        # one entry of a mapping field (reward.functions.my_source, rollout.agent.loops.mine)
        parent = dotted.rsplit(".", 1)[0]
        return "." in dotted and _is_key(parent) and "(dict[" in describe(parent)


# Pages that name verl's keys beside megarl's: verl's data.*, critic.*, algorithm.* and trainer.*
# keys there are verl's (megarl/config/verl_keys.py knows each).
VERL_PAGES = {"migrating-from-verl.md"}


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_config_key_the_manual_names_exists(page: Path):
    sections = "|".join(SECTIONS)
    word = re.compile(rf"(?<![\w./~-])((?:{sections})(?:\.[A-Za-z_]\w*)+)")
    verl = is_verl_key if page.name in VERL_PAGES else lambda k: False
    unknown = sorted({k for k in word.findall(page.read_text()) if k not in NOT_KEYS and not _is_key(k) and not verl(k)})
    assert not unknown, f"{page.name} names config keys that do not exist: {unknown}"


def _current(page: Path) -> str:
    """What the page says of this version: CHANGELOG.md's Unreleased section, the whole of any other page
    (released entries record the defaults of their release)."""
    text = page.read_text()
    if page.name != "CHANGELOG.md":
        return text
    start = text.index("## [Unreleased]")
    end = text.find("\n## [", start + 1)
    return text[start : end if end >= 0 else len(text)]


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_default_the_manual_states_is_the_config_default(page: Path):
    """`trainer.hang_timeout_s` (default 3600 s), `actor.packed_attention` (`auto` | `flex`, default `auto`)."""
    sections = "|".join(SECTIONS)
    stated = re.finditer(rf"`((?:{sections})(?:\.\w+)+)(?::[^`]*)?`,? \([^()]*?\bdefault:? `?([\w.+-]+)`?", _current(page))
    wrong = []
    for key, value in (m.groups() for m in stated):
        default = ast.literal_eval(describe(key).splitlines()[0].split(" = ", 1)[1].split("  (", 1)[0])
        if yaml.safe_load(value) != default:
            wrong.append(f"{key}: the page says {value}, megarl config says {default!r}")
    assert not wrong, f"{page.name}: {wrong}"


# Metric-like words that are not metrics of this version: the name a metric had before its rename.
NOT_METRICS = {"actor/pg_clipfrac"}
# Repository paths the manual names that a command creates (ci/gpu/run.sh's output folder).
NOT_IN_CHECKOUT = {"ci/gpu/out"}


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_metric_the_manual_names_is_in_the_catalogue(page: Path):
    families = "|".join(sorted({m.family for m in CATALOGUE}))
    # `val/<data_source>/pass@<k>`, `actor/clip_frac`; not a path (outputs/demo/data/val.parquet)
    word = re.compile(rf"(?<![\w./<-])((?:{families})/[\w<>@/.-]*[\w>](?:/\*)?)(?!\.\w)")
    unknown = []
    for name in sorted(set(word.findall(page.read_text())) - NOT_METRICS):
        if re.search(r"\.(py|parquet|jsonl?|ya?ml|md)$", name):
            continue  # a file: srt/weight_sync/tensor_bucket.py, data/train.parquet
        if name.endswith("/*"):  # `val/response_length/*`: a family of several names
            unknown += [] if any(m.name.startswith(name[:-1]) for m in CATALOGUE) else [name]
            continue
        try:
            lookup(name)
        except UnknownMetricError:
            unknown.append(name)
    assert not unknown, f"{page.name} names metrics that megarl/metrics.py does not declare: {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_repository_file_and_function_the_manual_names_exists(page: Path):
    """`megarl/x.py`, `tests/e2e/test_y.py` exist; `Name.attr` in `megarl/x.py` (or
    `megarl/x.py`'s `Name`, `megarl/x.py` (`Name`), megarl/x.py:name) is defined or assigned there."""
    text = page.read_text()
    path = r"(?:megarl|tests|bench|ci|configs|docs|launch|docker)/[\w./-]*\w"
    missing = sorted({p for p in re.findall(rf"(?<![\w./~-])({path})", text)
                      if p not in NOT_IN_CHECKOUT and not (ROOT / p).exists()})  # fmt: skip
    named = [m.group(1, 2) for m in re.finditer(rf"`(\w[\w.]*)(?:\(\))?` (?:in|of|from) `({path}\.py)`", text)]
    named += [m.group(2, 1) for m in re.finditer(rf"`({path}\.py)`(?:'s|,| \(|:)? ?`(\w[\w.]*)(?:\(\))?`", text)]
    named += [m.group(2, 1) for m in re.finditer(rf"(?<![\w./~-])({path}\.py):(\w[\w.]*)", text)]
    undefined = []
    for name, file in named:
        source = (ROOT / file).read_text() if (ROOT / file).exists() else ""
        head = name.split(".")[0]
        if not re.search(rf"^\s*(?:async def|def|class) {head}\b|^{head}\b[^=\n]*=", source, flags=re.M):
            undefined.append(f"{name} ({file})")
        elif "." in name and not re.search(rf"\b(?:def |self\.)?{re.escape(name.split('.')[-1])}\b", source):
            undefined.append(f"{name} ({file})")
    undefined = sorted(set(undefined))
    assert not missing and not undefined, f"{page.name}: no such file {missing}; not defined where named {undefined}"


def _resolves(dotted: str) -> bool:
    """``megarl.models.norm.RMSNorm``: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_python_name_the_manual_gives_resolves(page: Path):
    """`megarl.rollout.agents.tools.Tool`, `megarl.rewards.compute_score(...)` can be imported as written."""
    names = set(re.findall(r"`(megarl(?:\.\w+)+)", page.read_text()))
    assert not (wrong := sorted(n for n in names if not _resolves(n))), f"{page.name} names what megarl lacks: {wrong}"


def _names(model: type[BaseModel]) -> set[str]:
    """Every field name of a section, its subsections' too."""
    out: set[str] = set()
    for name, field in model.model_fields.items():
        out.add(name)
        sub = _section_type(field.annotation)
        out |= _names(sub) if sub is not None else set()
    return out


def test_configuration_page_overview_names_every_key():
    text = (ROOT / "docs" / "configuration.md").read_text()
    block = text[text.index("```\n") + 4 :]
    block = block[: block.index("```")]
    listed = {m.group(1): m.group(2) for m in re.finditer(r"^(\w+):\s+(.*(?:\n {3,}.*)*)", block, flags=re.M)}
    assert set(listed) == set(SECTIONS), f"docs/configuration.md's overview lists sections {sorted(listed)}"
    words = {name: set(re.findall(r"\w+", line)) for name, line in listed.items()}
    words["critic"] |= words["actor"] if "same as actor" in listed["critic"] else set()
    missing = {name: sorted(_names(_section_type(MegaRLConfig.model_fields[name].annotation)) - words[name])
               for name in SECTIONS}  # fmt: skip
    assert not {k: v for k, v in missing.items() if v}, f"docs/configuration.md's overview leaves out {missing}"


def _help_texts(parser: argparse.ArgumentParser) -> list[str]:
    texts = [parser.description or "", parser.epilog or ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                texts += _help_texts(sub)
    return texts


def test_help_examples_pass_the_planner(capsys):
    pattern = re.compile(r"megarl (?:plan|launch|sbatch|sft|generate) (configs/\S+\.yaml)((?: \S+=\S+| --[\w-]+(?: [^-\s]\S*)?)*)")
    examples = [m.groups() for text in _help_texts(build_parser()) for m in pattern.finditer(text)]
    assert len(examples) >= 3  # megarl --help, convert --help, sbatch --help
    for config, rest in examples:
        overrides = [t for t in rest.split() if "=" in t and not t.startswith("-")]
        capsys.readouterr()  # this example's output only
        code = main(["plan", str(ROOT / config), *overrides])
        assert code == 0, f"the --help example `{config} {rest.strip()}` is refused: {capsys.readouterr().out[-600:]}"


def _flags(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> dict[tuple[str, ...], set[str]]:
    """(subcommand words) -> the options it takes, e.g. ("convert", "hf-to-megatron") -> {"--hf", ...}."""
    out = {words: {o for a in parser._actions for o in a.option_strings}}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out |= _flags(sub, (*words, name))
    return out


def _unknown_flags(text: str) -> list[str]:
    """`megarl COMMAND ... --flag` in ``text`` where COMMAND takes no such flag."""
    table = _flags(build_parser())
    table[("convert",)] |= table[("convert", "megatron-to-hf")]  # `megarl convert CKPT OUT` is its short form
    wrong = []
    for command in re.finditer(r"megarl ([a-z][\w-]*)(?: ([a-z][\w-]*))?([^`|\n]*)", text):
        words = (command.group(1),) if (command.group(1), command.group(2)) not in table else command.group(1, 2)
        if words not in table:
            continue  # prose: "megarl scores every response"
        shown = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", command.group(3)))
        wrong += [f"megarl {' '.join(words)} {flag}" for flag in sorted(shown - table[words] - table[()])]
    return wrong


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_flag_the_manual_shows_exists(page: Path):
    assert not (wrong := _unknown_flags(page.read_text())), f"{page.name} shows flags that do not exist: {wrong}"


def test_every_flag_the_help_shows_exists():
    assert not (wrong := _unknown_flags("\n".join(_help_texts(build_parser())))), f"--help shows flags that do not exist: {wrong}"


def test_commands_page_shows_every_help_as_it_is(monkeypatch):
    """The site's commands page (generated when it is built) is `megarl --help` and each
    (sub)command's --help as argparse prints them at the page's width."""
    monkeypatch.setenv("COLUMNS", "100")
    parser = build_parser()
    page = commands_markdown(width=100)
    helps = [parser.format_help()]
    helps += [c.format_help() for a in parser._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices.values()]
    assert all(f"```text\n{h.rstrip()}\n```" in page for h in helps) and len(helps) == 13
    assert "## `megarl convert hf-to-megatron`" in page and "## `megarl data gsm8k`" in page
    assert "exactly as a 100-column terminal prints it" in page  # argparse wraps to the terminal's width

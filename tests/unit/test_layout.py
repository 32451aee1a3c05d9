"""The package layout stays navigable: the README names every package, and dependencies run
downwards only (checkpoints do not import the trainer; the Megatron runtime does not import Ray)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megarl"


def _packages() -> list[str]:
    return sorted(str(p.parent.relative_to(ROOT)) for p in PACKAGE.rglob("*/__init__.py"))


def _imports(folder: Path) -> dict[str, set[str]]:
    """Module file -> every module it imports (also lazily, inside functions)."""
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def test_readme_layout_lists_every_package():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout") :]
    block = section[section.index("```") + 3 :]
    listed = set(re.findall(r"^(megarl[\w/]*)", block[: block.index("```")], flags=re.M))
    missing = [p for p in _packages() if p not in listed]
    assert not missing, f"README's Layout section does not list {missing}"


def _offenders(folder: str, forbidden: str) -> list[str]:
    return sorted(
        f"{module} imports {name}"
        for module, names in _imports(PACKAGE / folder).items()
        for name in names
        if name == forbidden or name.startswith(forbidden + ".")
    )


def test_checkpoint_imports_nothing_from_the_trainer():
    assert _offenders("checkpoint", "megarl.trainer") == []


def test_megatron_runtime_knows_nothing_of_ray():
    assert _offenders("actors/megatron_runtime", "ray") == []
    assert _offenders("actors/megatron_runtime", "megarl.ray_cluster") == []


def test_algos_stay_pure_torch():
    for forbidden in ("ray", "torch.distributed", "megatron"):
        assert _offenders("algos", forbidden) == []

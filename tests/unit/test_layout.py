"""The package layout stays navigable: the README names every package, no file imports another
that imports it back (directly or around a circle), an ``__init__.py`` re-exports only from its
own package, module paths written as strings resolve, and the light commands stay light.

Which package may import which (the layers, Ray out of weight sync, ...) are import-linter's
contracts in pyproject.toml, checked by `make lint`; what import-linter cannot express is here.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megarl"


def _packages() -> list[str]:
    return sorted(str(p.parent.relative_to(ROOT)) for p in PACKAGE.rglob("*/__init__.py"))


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of megarl (a package by its __init__.py)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The megarl modules ``module`` imports anywhere in its file (inside functions and under
    ``if TYPE_CHECKING:`` too): ``import a.b`` names a.b; ``from a import b`` names a (its
    __init__.py runs) and a.b when b is a module; a name that is no module counts as the module
    that holds it."""

    def nearest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {nearest(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".") if node.level else node.module
            found.add(nearest(base or ""))
            found |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
    return {m for m in found if m and m.startswith("megarl.") and m != module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next((w for w in edges if w not in index or w in on_stack), None)
            if nxt is not None and nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                continue
            if nxt is not None:
                low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_readme_layout_lists_every_package():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout") :]
    block = section[section.index("```") + 3 :]
    listed = set(re.findall(r"^(megarl[\w/]*)", block[: block.index("```")], flags=re.M))
    missing = [p for p in _packages() if p not in listed]
    assert not missing, f"README's Layout section does not list {missing}"


def test_no_import_cycle_between_files():
    modules = _modules()
    graph = {m: _imported(m, p, modules) for m, p in modules.items()}
    assert not (cycles := _cycles(graph)), f"modules that import each other (around a circle): {cycles}"


def test_the_cycle_check_sees_function_level_and_package_imports(tmp_path):
    """The check itself: a function-level import closing a circle, and a sibling imported through
    its package's re-exporting __init__.py, are both cycles."""
    graph = {"megarl.a": {"megarl.b"}, "megarl.b": {"megarl.a"}, "megarl.c": set()}
    assert _cycles(graph) == [["megarl.a", "megarl.b"]]
    modules = {"megarl.p": Path("p/__init__.py"), "megarl.p.x": Path("p/x.py")}
    source = tmp_path / "y.py"
    source.write_text("def f():\n    from megarl.p import x\n")
    assert _imported("megarl.p.y", source, modules) == {"megarl.p", "megarl.p.x"}


def test_an_init_re_exports_only_from_its_own_package():
    wrong = []
    for init in PACKAGE.rglob("__init__.py"):
        package = ".".join(init.parent.relative_to(ROOT).parts)
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if not node.module.startswith(package + ".") and node.module != "__future__":
                    wrong.append(f"{init.relative_to(ROOT)} imports from {node.module}")
            elif isinstance(node, ast.Import):
                wrong += [f"{init.relative_to(ROOT)} imports {a.name}" for a in node.names if not a.name.startswith(package + ".")]
    assert not wrong, wrong


def test_algos_stay_pure_torch():
    """import-linter's contract covers ray and megatron; a subpackage of torch it cannot name."""
    modules = _modules()
    offenders = []
    for module, path in modules.items():
        if module.startswith("megarl.algos"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                offenders += [f"{module} imports {n}" for n in names if n == "torch.distributed" or n.startswith("torch.distributed.")]
    assert not offenders, offenders


def _string_module_paths() -> list[tuple[str, str]]:
    """Every string constant in megarl/ that is a dotted megarl module path (``megarl.x.y``, or
    ``megarl.x.y:attr``), except logger names and the names of the repository's files
    (launch/megarl.sbatch), with the file it is in."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        loggers = {id(n.args[0]) for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args
                   and getattr(n.func, "attr", getattr(n.func, "id", "")) == "getLogger"}  # fmt: skip
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in loggers:
                if re.fullmatch(r"megarl(\.\w+)+(:\w+)?", node.value) and not any(ROOT.glob(f"*/{node.value}")):
                    found.append((str(path.relative_to(ROOT)), node.value))
    return found


def test_module_paths_written_as_strings_resolve():
    """The CLI's table of user errors, the registries of extension points, the reward workers'
    preload, ...: a module that moved must take its strings with it."""
    strings = _string_module_paths()
    assert ("megarl/cli.py", "megarl.ray_cluster.worker_error") in strings  # the walk finds them
    wrong = []
    for where, value in strings:
        module, _, attr = value.partition(":")
        if importlib.util.find_spec(module) is None:
            # a "module.Name" string: the module, then the attribute
            module, _, attr = module.rpartition(".")
            if not module or importlib.util.find_spec(module) is None:
                wrong.append(f"{where}: {value}")
                continue
        if attr and not hasattr(importlib.import_module(module), attr):
            wrong.append(f"{where}: {value}")
    assert not wrong, f"module paths that do not resolve: {wrong}"


@pytest.mark.parametrize("argv", [["--help"], ["config"], ["plan", "configs/qwen72b_grpo.yaml"]])
def test_light_commands_import_no_torch_ray_or_megatron(argv):
    """`megarl --help`, `megarl config` and `megarl plan` answer in a fraction of a second."""
    code = ("import contextlib, io, sys\nfrom megarl.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    try:\n        main({argv!r})\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('torch', 'ray', 'megatron', 'transformers') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout

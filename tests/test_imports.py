"""The layout's rules, read from the code with ``ast`` (nothing is imported or run):

- a node never imports another node: ``nodes/X`` (a module or a package) imports nothing of
  ``nodes/Y``; a node package may import its own submodules (``nodes.gateway.*`` from ``nodes.gateway``);
- ``areal_bus/`` never imports ``nodes/``: the library knows no node (the CLI dispatches by name);
- no node imports the launcher (``areal_bus.launch``): nodes run under it, they do not drive it;
- no import cycle among the project's modules, counting imports inside functions too;
- an import of a project module inside a function says why it is lazy, in a comment on its line or
  right above its group of imports (e.g. torch kept out of a light process);
- ``areal_bus/`` keeps at most 15 modules at its root, and no module of ``areal_bus/`` or ``nodes/``
  passes 600 lines;
- docs/internals.md's "The pieces" table names every module of ``areal_bus/`` and ``nodes/``.

Every ``import``, ``from ... import`` (relative ones resolved, those inside functions included) and
``importlib.import_module`` / ``__import__`` call with a literal string counts. A module named by a
computed string (``import_module(f"nodes.{kind}")``) is dispatch by name, which the rules allow.

Run: .venv/bin/python -m pytest -q tests/test_imports.py
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("areal_bus", "nodes")


# -- the checker ----------------------------------------------------------------------------------

def module_name(path: Path, root: Path) -> str:
    """``nodes/gateway/app.py`` -> ``nodes.gateway.app``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool = False) -> list[tuple[tuple[str, ...], int]]:
    """``(candidates, line)`` for every import in ``source``, the source of ``module``: the module
    an ``import a.b`` names, or for ``from a import b, c`` the module ``a`` and then ``a.b``, ``a.c``
    (each of which may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [((alias.name,), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.append(((base, *(f"{base}.{a.name}" for a in node.names if a.name != "*")), node.lineno))
        elif isinstance(node, ast.Call) and _is_import_call(node.func) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append(((arg.value,), node.lineno))
    return found


def _is_import_call(func: ast.expr) -> bool:
    if isinstance(func, ast.Attribute):  # importlib.import_module(...)
        return func.attr == "import_module"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def _node_of(module: str) -> str | None:
    """The node a module belongs to (``nodes.gateway.app`` -> ``gateway``); None outside a node."""
    parts = module.split(".")
    return parts[1] if parts[0] == "nodes" and len(parts) > 1 else None


def breaks_rule(importer: str, imported: str) -> bool:
    if importer.split(".")[0] == "nodes" and (imported == "areal_bus.launch" or imported.startswith("areal_bus.launch.")):
        return True  # a node never drives the launcher
    if imported.split(".")[0] != "nodes" or imported == "nodes":
        return False  # outside nodes/, or the bare namespace package (it holds no node)
    if importer.split(".")[0] == "areal_bus":
        return True
    return importer.split(".")[0] == "nodes" and _node_of(importer) != _node_of(imported)


def violations_in(source: str, module: str, is_package: bool = False) -> list[str]:
    """One line per import statement that breaks a rule, naming both modules."""
    out = []
    for candidates, line in imports_of(source, module, is_package):
        broken = next((c for c in candidates if breaks_rule(module, c)), None)
        if broken is not None:
            out.append(f"{module} imports {broken} (line {line})")
    return out


def module_files(root: Path) -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def violations(root: Path = ROOT) -> list[str]:
    out = []
    for path in module_files(root):
        out += violations_in(path.read_text(), module_name(path, root), path.name == "__init__.py")
    return out


# -- the rules hold -------------------------------------------------------------------------------

def test_no_node_imports_another_node_and_the_library_imports_no_node():
    found = violations()
    assert not found, "import rules broken:\n  " + "\n  ".join(found)


def test_the_checker_finds_each_kind_of_violation():
    assert violations_in("from areal_bus.launch.runend import write_outcome\n", "nodes.trainer") == [
        "nodes.trainer imports areal_bus.launch.runend (line 1)"]
    assert violations_in("from areal_bus.runtime.outcome import write_outcome\n", "nodes.trainer") == []
    planted = '''
import nodes.weights
from nodes.gateway import bus_backend
from ..probe import view
from . import core            # its own package: allowed
import areal_bus.wire.codec        # the library: allowed

def later():
    import nodes.reward
    importlib.import_module("nodes.trainer.core")
    importlib.import_module(f"nodes.{kind}")  # computed: dispatch by name, allowed
'''
    found = violations_in(planted, "nodes.agent.node")
    imported = sorted(v.split()[2] for v in found)
    assert imported == ["nodes.gateway", "nodes.probe", "nodes.reward", "nodes.trainer.core", "nodes.weights"], found
    assert all(v.startswith("nodes.agent.node imports ") for v in found)
    assert violations_in("from nodes.gateway.backend import SamplingParams\nfrom .sessions import x\n",
                         "nodes.gateway.app") == []
    assert violations_in("def main():\n    from nodes import probe\n", "areal_bus.launch.cli") == [
        "areal_bus.launch.cli imports nodes.probe (line 2)"]


def test_a_violation_planted_in_a_copy_of_the_tree_fails_naming_both_modules(tmp_path):
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    before = set(violations(tmp_path))
    with open(tmp_path / "nodes" / "weights.py", "a") as f:
        f.write("\n\ndef _planted():\n    from nodes.gateway.bus_backend import BusBackend\n")
    (tmp_path / "areal_bus" / "planted.py").write_text("import importlib\nimportlib.import_module('nodes.bus')\n")
    new = sorted(set(violations(tmp_path)) - before)
    assert len(new) == 2, new
    assert any(v.startswith("nodes.weights imports nodes.gateway.bus_backend (line ") for v in new)
    assert "areal_bus.planted imports nodes.bus (line 2)" in new


# -- no cycle, lazy imports explained, sizes ------------------------------------------------------

def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each project module -> the project modules it imports (at the top or inside functions). ``from a
    import b`` counts as importing ``a.b`` where that is a module, else ``a``."""
    files = module_files(root)
    modules = {module_name(p, root) for p in files}
    graph = {}
    for path in files:
        name = module_name(path, root)
        edges = set()
        for candidates, _ in imports_of(path.read_text(), name, path.name == "__init__.py"):
            named = [c for c in candidates[1:] if c in modules] or [c for c in candidates[:1] if c in modules]
            edges.update(c for c in named if c != name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def unexplained_lazy_imports(source: str, module: str) -> list[str]:
    """Imports of a project module inside a function with no comment on their line, nor on the line
    right above their group of import lines."""
    lines = source.splitlines()
    out = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if not (getattr(node, "level", 0) or any(n.split(".")[0] in PACKAGES for n in names)):
                continue
            i = node.lineno - 1
            explained = "#" in lines[i]
            while not explained and i > 0:
                above = lines[i - 1].strip()
                if above.startswith("#"):
                    explained = True
                elif above.startswith(("import ", "from ")) or (above == "" and i > 1 and
                                                                 lines[i - 2].strip().startswith(("import ", "from "))):
                    explained = "#" in above  # a comment on a line of the same group explains it too
                    i -= 1
                else:
                    break
            if not explained:
                out.append(f"{module} line {node.lineno}: {lines[node.lineno - 1].strip()}")
    return out


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles:\n  " + "\n  ".join(" <-> ".join(c) for c in found)


def test_a_planted_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_lazy_project_import_says_why():
    found = []
    for path in module_files(ROOT):
        found += unexplained_lazy_imports(path.read_text(), module_name(path, ROOT))
    assert not found, "imports inside functions without a comment saying why:\n  " + "\n  ".join(found)


def test_the_lazy_import_check_finds_an_unexplained_one():
    source = (
        "def f():\n    from areal_bus.wire import codec\n\n"
        "def g():\n    # lazy: torch\n    import torch\n    from areal_bus.weights import shm\n"
        "    from areal_bus.weights import cuda\n\n"
        "def h():\n    import json\n"
    )
    assert unexplained_lazy_imports(source, "m") == ["m line 2: from areal_bus.wire import codec"]


def test_the_library_root_stays_small_and_no_module_is_long():
    root_modules = sorted(p.name for p in (ROOT / "areal_bus").glob("*.py"))
    assert len(root_modules) <= 15, f"areal_bus/ holds {len(root_modules)} modules at its root: {root_modules}"
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in module_files(ROOT)
            if (n := len(p.read_text().splitlines())) > 600]
    assert not long, "modules over 600 lines: " + ", ".join(long)


# -- docs/internals.md's pieces table names every module -------------------------------------------

def pieces_table(readme: str) -> list[tuple[str, str]]:
    """``(where, what)`` of each row of the table under "## The pieces"."""
    found = re.search(r"^## The pieces\s*$(.*?)(?=^## |\Z)", readme, re.M | re.S)
    assert found, 'docs/internals.md has no "## The pieces" section'
    section = found.group(1)
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and cells[0] not in ("where", "---"):
            rows.append((cells[0], "|".join(cells[1:])))
    return rows


def unnamed_modules(root: Path, readme: str) -> list[str]:
    """Module files the table does not name. A module is named by its path in a row's first cell
    (``areal_bus/wire/codec.py``), or, in the row of its folder (``nodes/gateway/``), by its name in
    backticks in the second (``app``); a package's ``__init__.py`` by its folder's row."""
    named_paths, folder_rows = set(), {}
    for where, what in pieces_table(readme):
        for path in re.findall(r"`([^`]+)`", where):
            named_paths.add(path)
            if path.endswith("/"):
                folder_rows[path] = set(re.findall(r"`([^`/]+)`", what))
    missing = []
    for path in module_files(root):
        rel = path.relative_to(root).as_posix()
        folder = rel.rpartition("/")[0] + "/"
        if rel in named_paths:
            continue
        if path.name == "__init__.py" and folder in named_paths:
            continue
        if path.stem in folder_rows.get(folder, ()):
            continue
        missing.append(rel)
    return missing


def test_the_readme_pieces_table_names_every_module():
    missing = unnamed_modules(ROOT, (ROOT / "docs" / "internals.md").read_text())
    assert not missing, "docs/internals.md 'The pieces' does not name: " + ", ".join(missing)


def test_a_module_missing_from_the_pieces_table_is_found(tmp_path):
    (tmp_path / "areal_bus" / "engines").mkdir(parents=True)
    (tmp_path / "areal_bus" / "wire").mkdir()
    (tmp_path / "nodes").mkdir()
    for rel in ("areal_bus/__init__.py", "areal_bus/wire/codec.py", "areal_bus/engines/__init__.py",
                "areal_bus/engines/sim.py", "areal_bus/engines/base.py", "nodes/bus.py"):
        (tmp_path / rel).write_text("")
    readme = ("## The pieces\n\n| where | what |\n| --- | --- |\n| `areal_bus/wire/codec.py` | the codec |\n"
              "| `areal_bus/engines/` | `sim` simulated engines |\n\n## Next\n| `nodes/bus.py` | not this table |\n")
    assert unnamed_modules(tmp_path, readme) == ["areal_bus/__init__.py", "areal_bus/engines/base.py", "nodes/bus.py"]

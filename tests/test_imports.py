"""anyrec's modules import on their own, in a fresh interpreter, and their imports form a DAG.

The graph is read from the source (module-level `import`/`from` statements of anyrec modules, not
those under `if TYPE_CHECKING:`); a cycle is reported with its path.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import anyrec

from .conftest import ROOT


def module_names(root: Path = ROOT) -> list[str]:
    """Every module of the anyrec package under `root`, dotted (read from the files, nothing imported)."""
    names = []
    for path in (root / "anyrec").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if all((root.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts))):
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


def _module_path(root: Path, name: str) -> Path | None:
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module is imported (module level, not TYPE_CHECKING)."""
    out: list[ast.Import | ast.ImportFrom] = []

    def visit(stmts: list[ast.stmt]) -> None:
        for node in stmts:
            if isinstance(node, ast.Import | ast.ImportFrom):
                out.append(node)
            elif isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if test not in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    visit(block)

    visit(tree.body)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """anyrec module -> the anyrec modules it imports at import time (submodules resolved)."""
    graph: dict[str, set[str]] = {}
    for name in module_names(root):
        path = _module_path(root, name)
        if path is None:
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                # `from pkg import sub` imports the submodule when there is one.
                targets = [f"{base}.{a.name}" if _module_path(root, f"{base}.{a.name}") else base
                           for a in node.names]
            deps.update(t for t in targets if t == "anyrec" or t.startswith("anyrec."))
        deps.discard(name)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = dfs(dep)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = dfs(node)
            if found:
                return found
    return None


def test_every_module_imports_in_a_fresh_interpreter():
    names = module_names()
    assert len(names) > 50 and "anyrec.planner.report" in names and "anyrec.schema" in names
    code = ("import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n"
            "print('imported', len(sys.argv) - 1)\n")
    proc = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == f"imported {len(names)}"
    assert Path(anyrec.__file__).resolve().parent == ROOT / "anyrec"  # the checkout's modules, not another


def test_anyrec_imports_form_a_dag():
    graph = import_graph()
    assert graph["anyrec.planner.report"] >= {"anyrec.planner.advice", "anyrec.planner.types"}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_lower_layers_do_not_import_upper_ones():
    """data/ and planner/ name features and tables through anyrec.schema, never through models/."""
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith(("anyrec.data", "anyrec.planner", "anyrec.backends", "anyrec.kernels")):
            upper = {d for d in deps if d.startswith(("anyrec.models", "anyrec.trainer"))}
            assert not upper, f"{name} imports {sorted(upper)}"


def test_the_cycle_check_finds_a_cycle(tmp_path):
    pkg = tmp_path / "anyrec"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from anyrec.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from anyrec import a\nfrom . import c\n")
    (pkg / "sub" / "c.py").write_text("import os\n\ndef f():\n    from anyrec import a\n")
    graph = import_graph(tmp_path)
    assert graph["anyrec.a"] == {"anyrec.sub.b"} and graph["anyrec.sub.b"] == {"anyrec.sub.c"}
    assert find_cycle(graph) is None  # TYPE_CHECKING and function-level imports do not count
    (pkg / "sub" / "c.py").write_text("import anyrec.a\n")
    assert find_cycle(import_graph(tmp_path)) == ["anyrec.a", "anyrec.sub.b", "anyrec.sub.c", "anyrec.a"]

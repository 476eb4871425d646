"""anyrec's modules import on their own, in a fresh interpreter; their imports form a DAG and respect
the layers.

The graph is read from the source: every `import`/`from` of an anyrec module, at module level or inside
a function (a function-level import hides a cycle, it does not remove it), except those under
`if TYPE_CHECKING:`; a cycle is reported with its path.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of the module, at any depth, except those under `if TYPE_CHECKING:`."""
    out: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                out.append(child)
            elif isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING",
                                                                           "typing.TYPE_CHECKING"):
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]))
                continue
            visit(child)

    visit(tree)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """anyrec module -> the anyrec modules it imports anywhere in its source (submodules resolved)."""
    graph: dict[str, set[str]] = {}
    for name in module_names(root):
        path = _module_path(root, name)
        if path is None:
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text())):
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


@pytest.mark.integration
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


# The layers, lowest first: a module may import its own layer's modules (within its own package for
# the side-by-side packages) and any lower layer, never a higher one. docs/architecture.md draws these
# rows, top layer first (test_the_architecture_diagram_draws_the_layers).
LAYERS: list[tuple[str, ...]] = [
    ("anyrec", "anyrec.kernels", "anyrec.safe_load", "anyrec.internals", "anyrec.choices"),  # leaves
    ("anyrec.backends",),  # the device
    ("anyrec.config", "anyrec.schema", "anyrec.sequence_schema", "anyrec.io_checks", "anyrec.proc",
     "anyrec.signing", "anyrec.console"),  # values and files
    ("anyrec.runtime",),  # the process: rendezvous, world, binding, agreement, shutdown, errors
    ("anyrec.history",),  # what the machine remembers
    ("anyrec._hydra",),  # a job's config from the command line
    ("anyrec.planner", "anyrec.models", "anyrec.data"),
    ("anyrec.trainer",),
    ("anyrec.serving",),
    ("anyrec.calibration",),  # measures, training with the trainer
    ("anyrec.train", "anyrec.plan", "anyrec.calibrate", "anyrec.parity", "anyrec.export",
     "anyrec.predict"),  # entry points
]
SIDE_BY_SIDE = {"anyrec.planner", "anyrec.models", "anyrec.data"}


def _unit(name: str) -> str:
    """The layer unit a module belongs to: its top-level package or module under anyrec."""
    return ".".join(name.split(".")[:2])


def layer_violations(graph: dict[str, set[str]],
                     allowed: set[tuple[str, str]] = frozenset()) -> list[str]:
    """`a imports b` for every import that goes up a layer, across side-by-side packages, or out of
    kernels into the rest of anyrec (except the `allowed` (a, b) arrows)."""
    rank = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    found = []
    for name, deps in graph.items():
        for dep in deps:
            a, b = _unit(name), _unit(dep)
            if a == b or (name, dep) in allowed:
                continue
            assert a in rank and b in rank, f"{name} or {dep} is in no layer: add it to LAYERS"
            upward = rank[b] > rank[a]
            sideways = a in SIDE_BY_SIDE and b in SIDE_BY_SIDE
            kernels_out = a == "anyrec.kernels" and b != "anyrec.kernels"
            if upward or sideways or kernels_out:
                found.append(f"{name} imports {dep}")
    return sorted(found)


def test_imports_respect_the_layers():
    """Every arrow points down (LAYERS), with no exception."""
    assert layer_violations(import_graph()) == []


def test_every_package_and_module_is_in_a_layer():
    units = {_unit(name) for name in module_names()}
    placed = {unit for units in LAYERS for unit in units}
    assert "anyrec.runtime" in units and "anyrec.history" in units
    assert units == placed, f"not in LAYERS: {sorted(units - placed)}; gone: {sorted(placed - units)}"


def diagram_rows(text: str) -> list[set[str]]:
    """The units each row of the Layers diagram names (`trainer/`, `train.py`), top row first: the first
    code block under `## Layers`, rows separated by lines holding only `|`."""
    section = text.split("\n## Layers\n", 1)[1]
    block = section.split("```", 2)[1]
    rows: list[set[str]] = [set()]
    for line in block.splitlines():
        if line.strip() == "|":
            rows.append(set())
            continue
        for word in line.split():
            if re.fullmatch(r"[a-z_]+/", word):
                rows[-1].add(f"anyrec.{word[:-1]}")
            elif re.fullmatch(r"[a-z_]+\.py", word):
                rows[-1].add(f"anyrec.{word[:-3]}")
    return [r for r in rows if r]


def test_the_architecture_diagram_draws_the_layers():
    """docs/architecture.md names every package and top-level module, one row per layer, in LAYERS'
    order (top first): a package missing from it, or drawn in the wrong layer, fails here."""
    rows = diagram_rows((ROOT / "docs" / "architecture.md").read_text())
    expected = [set(units) - {"anyrec"} for units in reversed(LAYERS)]
    drawn = set().union(*rows)
    missing = set().union(*expected) - drawn
    assert not missing, f"docs/architecture.md does not draw {sorted(missing)}"
    assert rows == expected


def test_the_diagram_reader_finds_a_missing_package():
    text = ("# A\n\n## Layers\n\n```\ntrain.py  plan.py   entry points\n     |\ntrainer/   the loop, runtime"
            "\n     |\nkernels/  safe_load.py\n```\n")
    assert diagram_rows(text) == [{"anyrec.train", "anyrec.plan"}, {"anyrec.trainer"},
                                  {"anyrec.kernels", "anyrec.safe_load"}]


def test_the_layer_check_finds_violations():
    graph = {"anyrec.kernels.tbe": {"anyrec.backends.dispatch"},
             "anyrec.planner.types": {"anyrec.models.dlrm"},
             "anyrec.backends.cpu": {"anyrec.trainer.trainer", "anyrec.kernels.tbe"},
             "anyrec.trainer.trainer": {"anyrec.planner.types", "anyrec.backends", "anyrec.runtime.shutdown"},
             "anyrec.runtime.distributed": {"anyrec.trainer.inputs", "anyrec.backends.cpu"},
             "anyrec.history.cache": {"anyrec.calibration.measure", "anyrec.runtime.distributed"}}
    assert layer_violations(graph) == ["anyrec.backends.cpu imports anyrec.trainer.trainer",
                                       "anyrec.history.cache imports anyrec.calibration.measure",
                                       "anyrec.kernels.tbe imports anyrec.backends.dispatch",
                                       "anyrec.planner.types imports anyrec.models.dlrm",
                                       "anyrec.runtime.distributed imports anyrec.trainer.inputs"]
    allowed = {("anyrec.history.cache", "anyrec.calibration.measure")}
    assert "anyrec.history.cache imports anyrec.calibration.measure" not in layer_violations(graph, allowed)


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
    assert graph["anyrec.sub.c"] == {"anyrec.a"}  # a function-level import counts
    assert find_cycle(graph) == ["anyrec.a", "anyrec.sub.b", "anyrec.sub.c", "anyrec.a"]
    (pkg / "sub" / "c.py").write_text("import os\n")
    assert find_cycle(import_graph(tmp_path)) is None  # TYPE_CHECKING imports do not count

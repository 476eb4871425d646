"""Guards on the source: only anyrec/backends/ may name the vendor runtimes (everything else asks its
Backend), and anyrec modules are imported at the top of a file (a function-level import needs a
comment on its line saying why, e.g. an optional dependency).

Scope of the vendor guard: every .py file of the `anyrec` package outside `anyrec/backends/`,
`benchmarks/` and `scripts/`. Tests are exempt: they may name `torch.cuda` in skip markers for GPU-only
tests.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize

from .conftest import ROOT

FORBIDDEN = re.compile(r"torch\.cuda\b|torch\.version\.hip\b|torch\.version\.cuda\b")
SCANNED = ("anyrec", "benchmarks", "scripts")


def offending_lines(root=ROOT) -> list[str]:
    """`path:line: text` for each forbidden name outside anyrec/backends/."""
    hits = []
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            if rel.parts[:2] == ("anyrec", "backends"):
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if FORBIDDEN.search(line):
                    hits.append(f"{rel}:{n}: {line.strip()}")
    return hits


def test_no_vendor_runtime_names_outside_backends():
    hits = offending_lines()
    assert not hits, "ask the Backend instead of naming the runtime:\n" + "\n".join(hits)


def test_the_guard_catches_a_violation(tmp_path):
    (tmp_path / "anyrec" / "backends").mkdir(parents=True)
    (tmp_path / "anyrec" / "backends" / "ok.py").write_text("import torch\ntorch.cuda.synchronize()\n")
    (tmp_path / "anyrec" / "bad.py").write_text("import torch\nif torch.version.hip:\n    pass\n")
    assert offending_lines(tmp_path) == ["anyrec/bad.py:2: if torch.version.hip:"]


def function_level_imports(root=ROOT) -> list[str]:
    """`path:line: text` for each import of an anyrec module inside a function of anyrec/ that has no
    comment on its lines."""
    hits = []
    for path in sorted((root / "anyrec").rglob("*.py")):
        src = path.read_text()
        commented = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(src).readline)
                     if tok.type == tokenize.COMMENT}
        lines = src.splitlines()
        for fn in ast.walk(ast.parse(src)):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    ours = any(a.name == "anyrec" or a.name.startswith("anyrec.") for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    ours = bool(node.level) or (node.module or "").split(".")[0] == "anyrec"
                else:
                    continue
                if ours and not commented & set(range(node.lineno, node.end_lineno + 1)):
                    hits.append(f"{path.relative_to(root)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return sorted(set(hits))


def test_anyrec_modules_are_imported_at_the_top():
    hits = function_level_imports()
    assert not hits, ("import at the top of the file, or say on the line why not:\n" + "\n".join(hits))


def test_the_import_guard_catches_a_violation(tmp_path):
    (tmp_path / "anyrec").mkdir()
    (tmp_path / "anyrec" / "m.py").write_text(
        "import os\nfrom anyrec import x\n\n"
        "def f():\n    from anyrec.kernels import dcn  # optional: needs triton\n    import json\n\n"
        "def g():\n    from anyrec.planner import (\n        report,\n    )\n"
        "    def h():\n        from . import y\n")
    assert function_level_imports(tmp_path) == [
        "anyrec/m.py:13: from . import y", "anyrec/m.py:9: from anyrec.planner import ("]

"""Only anyrec/backends/ may name the vendor runtimes: everything else asks its Backend.

Scope: every .py file of the `anyrec` package outside `anyrec/backends/`, `benchmarks/` and
`scripts/`. Tests are exempt: they may name `torch.cuda` in skip markers for GPU-only tests.
"""

from __future__ import annotations

import re

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

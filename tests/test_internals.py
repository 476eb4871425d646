"""The library internals anyrec relies on are listed once (anyrec.internals), pinned by the hash of their
source, and the list is whole: a private library name anyrec's code uses must be in it."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
from pathlib import Path

import pytest

from anyrec import internals
from anyrec.internals import PINS, Pin, problem, problems

from .conftest import ROOT

LIBRARIES = ("torch", "torchrec", "fbgemm_gpu", "omegaconf", "hydra", "triton")
STDLIB = frozenset({"_exit"})  # os._exit: the standard library's, documented


def test_every_pin_matches_the_installed_libraries():
    """After an upgrade, each internal whose source changed is named with the files relying on it."""
    found = problems()
    assert found == [], "\n".join(found)
    assert len(PINS) > 40


def test_every_pin_is_used_where_it_says():
    """The list stays honest: each pin's files exist and use the names it covers."""
    for pin in PINS:
        texts = [(ROOT / f).read_text() for f in pin.used_in]
        for name in pin.names:
            assert any(name in t for t in texts), f"{pin.target}: {name} is used in none of {pin.used_in}"


def test_a_changed_source_names_the_internal_and_the_file():
    pin = next(p for p in PINS if p.target.endswith("DMPCollection._sync"))
    message = problem(dataclasses.replace(pin, sha256="0" * 64))
    assert message is not None and "\n" not in message
    assert "torchrec.distributed.model_parallel:DMPCollection._sync" in message
    assert "anyrec/trainer/twod.py" in message and "pinned 0000" in message
    c_function = next(p for p in PINS if p.sha256 is None)
    assert problem(c_function) is None
    assert "not torch" in problem(dataclasses.replace(c_function, version="torch 0.1"))
    gone = problem(dataclasses.replace(pin, target="torchrec.distributed.model_parallel:DMPCollection._gone"))
    assert "is gone in torchrec" in gone and "anyrec/trainer/twod.py" in gone
    assert problems((pin, dataclasses.replace(pin, sha256="1" * 64))) == [problem(
        dataclasses.replace(pin, sha256="1" * 64))]


def _owned_attributes(trees: dict[str, ast.Module]) -> set[str]:
    """Attribute names anyrec itself defines: assigned on an object, or in a class body, or registered."""
    owned: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                owned.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        owned.add(item.name)
                    elif isinstance(item, ast.Assign):
                        owned.update(t.id for t in item.targets if isinstance(t, ast.Name))
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        owned.add(item.target.id)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("register_buffer", "register_parameter", "register_module") \
                    and node.args and isinstance(node.args[0], ast.Constant):
                owned.add(str(node.args[0].value))
    return owned


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _library_imports(tree: ast.Module) -> dict[str, str]:
    """Module-level names bound to library objects or modules: name -> "module:attr" or "module"."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            for alias in node.names:
                out[alias.asname or alias.name] = f"{node.module}:{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in LIBRARIES:  # `import torch.distributed as dist` binds the submodule, else the top
                    out[alias.asname or top] = alias.name if alias.asname else top
    return out


def _overrides(tree: ast.Module) -> list[str]:
    """Private methods a class defines that a library base class (imported, or an anyrec class of the same
    module built on one) defines too: overriding them relies on when the library calls them."""
    imported = _library_imports(tree)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def library_bases(cls: ast.ClassDef) -> list[type]:
        out = []
        for base in cls.bases:
            head, *rest = ast.unparse(base).split(".")
            if head in imported:  # `Module`, `nn.Module`, `torch.nn.Module`
                out.append(functools.reduce(getattr, rest, internals.resolve(imported[head])))
            elif head in classes and not rest:
                out += library_bases(classes[head])
        return out

    found = []
    for cls in classes.values():
        bases = [b for b in library_bases(cls) if isinstance(b, type)]
        for item in cls.body:
            if isinstance(item, ast.FunctionDef) and _private(item.name) and \
                    any(item.name in vars(k) for b in bases for k in b.__mro__):
                found.append(item.name)
    return found


def private_library_names(root: Path) -> set[tuple[str, str]]:
    """(name, file) for every private library name anyrec's code under `root` uses: imported from a private
    module or by a private name, read as an attribute anyrec does not define itself (also through
    getattr/hasattr/setattr), or a library class's private method overridden."""
    files = sorted((root / "anyrec").rglob("*.py"))
    trees = {str(p.relative_to(root)): ast.parse(p.read_text()) for p in files}
    owned = _owned_attributes(trees)
    found: set[tuple[str, str]] = set()
    for path, tree in trees.items():
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
                names += [p for p in node.module.split(".") if _private(p)]
                names += [a.name for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Import):
                names += [p for a in node.names if a.name.split(".")[0] in LIBRARIES
                          for p in a.name.split(".") if _private(p)]
            elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in owned:
                names.append(node.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1 \
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                    and _private(node.args[1].value) and node.args[1].value not in owned:
                names.append(node.args[1].value)
            found.update((n, path) for n in names if n not in STDLIB)
        found.update((n, path) for n in _overrides(tree))
    return found


def _listed(pins: tuple[Pin, ...]) -> set[tuple[str, str]]:
    return {(name, f) for pin in pins for name in pin.names for f in pin.used_in}


def test_anyrec_uses_no_private_library_name_the_list_lacks():
    """A new reliance on a library internal must be listed (and pinned) in anyrec/internals.py."""
    used = private_library_names(ROOT)
    assert len(used) > 30
    missing = sorted(used - _listed(PINS))
    assert missing == [], "private library names used but not in anyrec/internals.py: " + ", ".join(
        f"{name} in {path}" for name, path in missing)


def test_the_scan_finds_each_kind_of_reliance(tmp_path):
    pkg = tmp_path / "anyrec"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "import torch._dynamo\n"
        "from torch.distributed import _functional_collectives\n"
        "from torch._higher_order_ops import cond\n"
        "from torch.nn import Module\n"
        "from torch import nn\n"
        "def f(x):\n"
        "    return x._version + getattr(x, '_backward_hooks', None) + x._ours\n"
        "class Ours:\n"
        "    _ours = 1\n"
        "class M(Module):\n"
        "    def _apply(self, fn, recurse=True):\n"
        "        return super()._apply(fn, recurse)\n"
        "    def _helper(self):\n"
        "        return self._parameters\n"
        "class N(nn.Module):\n"
        "    def _load_from_state_dict(self, *args):\n"
        "        pass\n")
    assert private_library_names(tmp_path) == {
        (n, "anyrec/a.py") for n in ("_dynamo", "_functional_collectives", "_higher_order_ops", "_version",
                                     "_backward_hooks", "_apply", "_parameters",
                                     "_load_from_state_dict")}


@pytest.mark.parametrize("library", sorted(internals.DISTRIBUTIONS))
def test_every_library_of_the_list_is_installed(library):
    assert importlib.util.find_spec(library) is not None and internals.installed_version(library) != "none"

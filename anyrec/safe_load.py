"""Bounded parsing of the JSON and YAML files anyrec reads (checkpoint manifests, calibration cache
entries, hardware files, parity records): refused in one line when too big, too deeply nested, or (YAML)
expanding past a bound through aliases, before anything walks what was parsed.

A few hundred bytes of YAML aliases expand to billions of values, and a few hundred kilobytes of
brackets overflow the parser's stack. JSON's nesting is measured on the text; YAML's nesting and
expanded size are counted while its nodes are composed (an alias adds its anchor's whole subtree), so
the work is linear in the file's size. Aliases themselves are accepted: PyYAML's dumper writes one
where a list repeats (calibration files do).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import yaml

MAX_DEPTH = 64  # nesting of mappings and lists; anyrec's own files nest at most 8 deep
MAX_BYTES = 8 * 2**20  # JSON (a checkpoint's meta.json is a few KB to a few hundred KB)
# YAML (hardware files and cache entries, about 10 KB and 2,000 values): PyYAML parses in pure Python,
# about 0.1 MB/s on a loaded host, so its bounds are tighter.
MAX_YAML_BYTES = 2**20
MAX_NODES = 100_000  # YAML values with every alias expanded


class UnsafeFileError(ValueError):
    """A file anyrec refuses to parse (too big, too deep, aliases, not valid JSON or YAML)."""


def read_text(path: str | os.PathLike, what: str, max_bytes: int = MAX_BYTES) -> str:
    """The text of `path`, refused in one line (naming `what`) when over `max_bytes` or unreadable."""
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise UnsafeFileError(f"{what}: cannot read it ({e.strerror or type(e).__name__})") from None
    if len(raw) > max_bytes:
        raise UnsafeFileError(f"{what}: larger than {max_bytes} bytes, refused unread")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UnsafeFileError(f"{what}: not a UTF-8 text file") from None


# A string (closed, or running to the end: then the text is not JSON anyway) or a bracket. Every match
# starts where the last ended and cannot fail once begun, so one pass is linear in the text's length.
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\[\s\S]?)*+(?:"|\Z)|[\[\]{}]')


def _nests_deeper(text: str, max_depth: int) -> bool:
    """Whether JSON `text` nests brackets (those in strings aside) deeper than `max_depth`."""
    depth = 0
    for m in _JSON_TOKEN.finditer(text):
        token = m.group()
        if token in ("[", "{"):
            depth += 1
            if depth > max_depth:
                return True
        elif token in ("]", "}"):
            depth -= 1
    return False


def load_json(source: str | os.PathLike, what: str, max_bytes: int = MAX_BYTES,
              max_depth: int = MAX_DEPTH, text: str | None = None) -> Any:
    """JSON from file `source` (or `text`, if given), bounded in size and depth; UnsafeFileError in one
    line naming `what` otherwise."""
    if text is None:
        text = read_text(source, what, max_bytes)
    elif len(text) > max_bytes:
        raise UnsafeFileError(f"{what}: larger than {max_bytes} bytes, refused unread")
    if _nests_deeper(text, max_depth):
        raise UnsafeFileError(f"{what}: nests deeper than {max_depth} levels, refused")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UnsafeFileError(f"{what}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}; "
                              "cut short?)") from None
    except (ValueError, RecursionError) as e:  # e.g. an integer too long to convert
        raise UnsafeFileError(f"{what}: not valid JSON ({str(e).splitlines()[0][:200]})") from None


class _Refused(yaml.YAMLError):
    """A YAML construct anyrec refuses (not a syntax error)."""


class BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with bounds on nesting and on the document's size with every alias
    expanded, checked while composing (before anything walks it); also reads `4.8e12` as a number
    (YAML 1.1 wants `4.8e+12`)."""

    max_depth = MAX_DEPTH
    max_nodes = MAX_NODES

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = self._nodes = self._deepest = 0
        self._anchored: dict[str, tuple[int, int]] = {}  # anchor -> (nodes, height) of its subtree

    def _grow(self, nodes: int, deepest: int) -> None:
        self._nodes += nodes
        self._deepest = max(self._deepest, deepest)
        if self._deepest > self.max_depth:
            raise _Refused(f"nests deeper than {self.max_depth} levels")
        if self._nodes > self.max_nodes:
            raise _Refused(f"expands to more than {self.max_nodes} values (YAML aliases?)")

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):  # the anchored subtree again, counted again
            nodes, height = self._anchored.get(event.anchor, (0, 0))
            self._grow(nodes, self._depth + height)
            return super().compose_node(parent, index)
        self._depth += 1
        outer, self._deepest = self._deepest, 0
        before = self._nodes
        try:
            self._grow(1, self._depth)
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if event.anchor:
            self._anchored[event.anchor] = (self._nodes - before, self._deepest - self._depth)
        self._deepest = max(outer, self._deepest)
        return node


BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$"),
    list("-+0123456789"))


def load_yaml(source: str | os.PathLike, what: str, max_bytes: int = MAX_YAML_BYTES,
              max_depth: int = MAX_DEPTH, text: str | None = None) -> Any:
    """YAML from file `source` (or `text`, if given) with the safe loader, no anchors or aliases, bounded
    in size and depth; UnsafeFileError in one line naming `what` otherwise."""
    if text is None:
        text = read_text(Path(source), what, max_bytes)
    elif len(text) > max_bytes:
        raise UnsafeFileError(f"{what}: larger than {max_bytes} bytes, refused unread")
    loader = type("Loader", (BoundedLoader,), {"max_depth": max_depth})(text)
    try:
        return loader.get_single_data()
    except _Refused as e:
        raise UnsafeFileError(f"{what}: {e}, refused") from None
    except yaml.YAMLError as e:
        raise UnsafeFileError(f"{what}: not valid YAML ({str(e).splitlines()[0][:200]})") from None
    except RecursionError:
        raise UnsafeFileError(f"{what}: not valid YAML (nests too deep)") from None
    finally:
        loader.dispose()

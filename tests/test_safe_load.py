"""Bounded parsing (anyrec.safe_load): alias bombs, deep nesting and oversize files refused in one line,
before any expansion; what anyrec writes parses as before."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from anyrec.safe_load import MAX_DEPTH, MAX_NODES, UnsafeFileError, load_json, load_yaml

CAL = Path(__file__).parent / "data" / "calibration_cpu_2rank.yaml"
# 572 bytes that expand to 9^9 strings under a plain safe loader
ALIAS_BOMB = "a: &a [" + ",".join(['"lol"'] * 9) + "]\n" + "".join(
    f"{c}: &{c} [{','.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))


def _refused(load, text: str, match: str) -> None:
    start = time.perf_counter()
    with pytest.raises(UnsafeFileError, match=match) as e:
        load("f", "the file", text=text)
    assert "\n" not in str(e.value) and str(e.value).startswith("the file: ")
    assert time.perf_counter() - start < 5


def test_an_alias_bomb_is_refused_before_it_expands():
    assert len(ALIAS_BOMB) < 600
    _refused(load_yaml, ALIAS_BOMB, f"expands to more than {MAX_NODES} values")


def test_an_alias_to_a_deep_subtree_counts_its_depth():
    deep = "a: &x " + "[" * 40 + "]" * 40 + "\nb: " + "[" * 30 + "*x" + "]" * 30 + "\n"
    _refused(load_yaml, deep, "nests deeper")


def test_a_repeated_list_as_pyyaml_writes_it_is_read():
    """PyYAML's dumper writes an anchor where one list object repeats: calibration files have them."""
    assert load_yaml("f", "x", text="a: &id001 [1, 2]\nb: *id001\n") == {"a": [1, 2], "b": [1, 2]}


@pytest.mark.parametrize("load", [load_yaml, load_json])
def test_deep_nesting_is_refused(load):
    _refused(load, "[" * 100_000 + "]" * 100_000, f"nests deeper than {MAX_DEPTH}")
    load("f", "the file", text="[" * MAX_DEPTH + "]" * MAX_DEPTH)  # the bound itself is fine


def test_deep_block_yaml_is_refused():
    _refused(load_yaml, "".join("  " * i + f"k{i}:\n" for i in range(200)) + "  " * 200 + "v: 1\n",
             "nests deeper")


@pytest.mark.parametrize("load", [load_yaml, load_json])
def test_an_oversize_file_is_refused_unread(load, tmp_path):
    f = tmp_path / "big"
    f.write_text('"' + "a" * 2000 + '"')
    with pytest.raises(UnsafeFileError, match="larger than 1000 bytes"):
        load(f, "the file", max_bytes=1000)


def test_brackets_inside_json_strings_do_not_count():
    assert load_json("f", "x", text='{"a": "' + "[" * 1000 + '"}') == {"a": "[" * 1000}


@pytest.mark.parametrize(("load", "text", "match"), [
    (load_json, '{"a": 1', "not valid JSON"), (load_yaml, "a: [1, 2\n", "not valid YAML"),
    (load_json, "1" * 5000, "not valid JSON")])
def test_a_syntax_error_is_one_line(load, text, match):
    _refused(load, text, match)


def test_what_anyrec_writes_parses_as_before():
    assert load_yaml(CAL, "cal") == yaml.safe_load(CAL.read_text())
    assert load_yaml("f", "x", text="x: 4.8e12\n") == {"x": 4.8e12}  # YAML 1.1 would give a string


def test_measuring_the_nesting_is_linear_in_the_text():
    """200 KB of escaped quotes with no closing one: a scan restarting at every quote takes minutes."""
    _refused(load_json, '"' + '\\"' * 100_000 + "\\", "not valid JSON")

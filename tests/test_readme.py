"""Every config key and override the README and the guides it links name exists: each documented
command's Hydra overrides compose, and each key named in the prose is in the composed config."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from omegaconf import OmegaConf

from anyrec.backends.hardware import is_hardware_path
from anyrec.models.family import FAMILIES, resolve_family
from anyrec.parity import choose_check

from .conftest import ROOT, compose_config

README = (ROOT / "README.md").read_text()
# The guides the README sends a user to, read with it (the config-group table and summary are the README's).
GUIDES = "\n".join((ROOT / "docs" / f"{name}.md").read_text()
                   for name in ("training", "planning", "numerics"))
DOCS = README + "\n" + GUIDES
_FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
# a Hydra entry point in a command line: its `key=value` words are overrides
_HYDRA_COMMAND = re.compile(r"-m anyrec\.(train|plan|calibrate)\b|anyrec-(train|plan|calibrate)\b|"
                            r"dev\.sh train\b")
_OVERRIDE = re.compile(r"^\+?[a-z_][a-z0-9_]*(\.[a-z0-9_]+)*=(?!=)")
_KEY = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z0-9_]+)+$")
_MISSING = object()


def _commands() -> list[list[str]]:
    """Override words of every README command line (code blocks) and inline override span."""
    lines = [ln for block in _FENCE.findall(DOCS) for ln in block.replace("\\\n", " ").splitlines()]
    lines = [ln.split(" #")[0] for ln in lines if _HYDRA_COMMAND.search(ln)]
    spans = re.findall(r"`([^`\n]+)`", _FENCE.sub("", DOCS))
    lines += [s for s in spans if _HYDRA_COMMAND.search(s) or _OVERRIDE.match(s.split()[0])]
    commands = [[w for w in ln.split() if _OVERRIDE.match(w)] for ln in lines]
    return [c for c in commands if c]


def _prose_keys(top_level: set[str]) -> list[str]:
    """Dotted config keys named alone in inline code (`data.zipf_exponent`)."""
    spans = re.findall(r"`([^`\n]+)`", _FENCE.sub("", DOCS))
    return sorted({s for s in spans if _KEY.match(s) and s.split(".")[0] in top_level})


def _is_placeholder(value: str) -> bool:
    """`N`, `DIR`, `<plugin>`, a path or an empty value: the key is documented, not a value."""
    return value == "" or bool(re.fullmatch(r"[A-Z_]+|<[^>]+>", value)) or "/" in value or "..." in value


def _split(command: list[str]) -> tuple[list[str], list[tuple[str, list[str]]], list[str]]:
    """(concrete overrides, (key, alternatives) for `a|b|c` values, keys given a placeholder)."""
    concrete, alternatives, keys = [], [], []
    for word in command:
        key, value = word.split("=", 1)
        if _is_placeholder(value):
            keys.append(key.lstrip("+"))
        elif "|" in value:  # a placeholder among them (`N|auto`) documents the key, not a value
            alternatives.append((key, [v for v in value.split("|") if not _is_placeholder(v)]))
        else:
            concrete.append(word)
    return concrete, alternatives, keys


def _group_options() -> list[str]:
    """`group=option` for every option of the README's "Config groups" table."""
    section = README.split("## Config groups", 1)[1].split("\n\n", 2)[1]
    out = []
    for row in section.splitlines()[2:]:
        group, options = (re.findall(r"`([^`]+)`", cell) for cell in row.split("|")[1:3])
        out += [f"{group[0]}={o}" for o in options if "=" not in o]
    return out


def summary_example() -> dict:
    """The JSON summary the README shows for the default job."""
    return json.loads(README.split("```json\n", 1)[1].split("```", 1)[0])


COMMANDS = list({" ".join(c): c for c in _commands()}.values())
GROUP_OPTIONS = _group_options()


def test_the_readme_documents_commands_and_keys():
    """The parser finds what the README shows (so the tests below cannot pass on nothing)."""
    assert len(COMMANDS) >= 20, COMMANDS
    assert len(GROUP_OPTIONS) >= 25 and "hardware=mi355x" in GROUP_OPTIONS, GROUP_OPTIONS
    assert ["model=dlrm_tiny", "trainer.steps=50", "trainer.seed=7", "trainer.eval_steps=0",
            "trainer.log_every=10"] in COMMANDS


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c) for c in COMMANDS])
def test_documented_overrides_compose(command):
    pairs = [w.split("=", 1) for w in command]
    files = [f"{k}={v}" for k, v in pairs if k.lstrip("+") == "hardware" and is_hardware_path(v)]
    assert not files, f"a hardware file is named with hardware.sku=FILE, not {files}"
    concrete, alternatives, keys = _split(command)
    if not any(w.startswith("model=") for w in concrete):
        concrete = [*_family_of([*concrete, *keys, *(k for k, _ in alternatives)]), *concrete]
    cfg, _ = compose_config(concrete)
    for key in keys:
        assert OmegaConf.select(cfg, key, default=_MISSING) is not _MISSING, f"{key} is not a config key"
    for key, values in alternatives:
        for value in values:
            compose_config([*concrete, f"{key}={value}"])


@pytest.mark.parametrize("option", GROUP_OPTIONS)
def test_config_group_table_options_compose(option):
    compose_config([option])


FAMILY_SECTION = {"model.hstu.": "model=dlrmv4"}  # keys a model family's own config holds


def _family_of(words: list[str]) -> list[str]:
    """The model overrides under which the keys of `words` exist: a family's own section (model.hstu.*)
    needs that family."""
    return sorted({family for w in words for prefix, family in FAMILY_SECTION.items()
                   if w.lstrip("+").startswith(prefix)})


def test_keys_named_in_the_prose_exist():
    cfg, _ = compose_config()
    keys = _prose_keys(set(cfg))
    assert len(keys) >= 15, keys
    configs = {(): cfg, **{(f,): compose_config([f])[0] for f in FAMILY_SECTION.values()}}
    missing = [k for k in keys
               if OmegaConf.select(configs[tuple(_family_of([k]))], k, default=_MISSING) is _MISSING]
    assert not missing, f"README names config keys that do not exist: {missing}"


def _parity_commands() -> list[list[str]]:
    """The words of every documented `anyrec-parity` command line (quotes honoured: variants hold spaces).
    docs/porting.md's, which need the simulated device's plugin, run in tests/test_simdev.py."""
    lines = [ln for block in _FENCE.findall(DOCS)
             for ln in block.replace("\\\n", " ").splitlines() if ln.lstrip().startswith("anyrec-parity ")]
    return [shlex.split(ln)[1:] for ln in lines]


PARITY_COMMANDS = _parity_commands()


def test_documented_parity_commands_compose_with_each_variant():
    """The base overrides of each documented parity command compose with each of its variants on top (as
    the parity workers compose them): its own `parity.variants` or, given none, its model family's default
    check, which the docs show for every family."""
    assert len(PARITY_COMMANDS) >= 1, PARITY_COMMANDS
    jobs, default_checks = set(), set()
    for words in PARITY_COMMANDS:
        _, cfg = compose_config(words)
        family = resolve_family(cfg.model)
        if not cfg.parity.variants:
            default_checks.add(family.name)
        check = choose_check([w for w in words if not w.startswith("parity.")], cfg.parity.variants, family)
        jobs |= {(*check.base, *variant.overrides) for variant in check.variants}
    for job in jobs:  # each distinct job once (variants that differ in ranks only compose alike)
        compose_config(list(job))
    assert len(jobs) >= 4 and default_checks == set(FAMILIES), default_checks

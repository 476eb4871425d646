"""anyrec-parity: argument parsing, the comparison, and real runs across kernels, plans and ranks."""

from __future__ import annotations

import json
import math

import pytest
import torch

from anyrec import parity
from anyrec.config import ParityConfig
from anyrec.models.family import DLRM_FAMILY, DLRMV4_FAMILY, FAMILIES
from anyrec.parity import compare, main, parse_variant
from anyrec.signing import resolve_key


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("run"))  # Hydra's run folder, as for anyrec-train


def _variants(variants: list[str]) -> str:
    """The `parity.variants=[...]` override of these variants."""
    return "parity.variants=[" + ",".join(json.dumps(v) for v in variants) + "]"


def test_variant_tokens_split_into_overrides_ranks_and_environment():
    v = parse_variant("backend.embedding_kernel=triton nproc=2 TRITON_INTERPRET=1 "
                      "'planner.sharding=row_wise'")
    assert v.overrides == ["backend.embedding_kernel=triton", "planner.sharding=row_wise"]
    assert v.nproc == 2 and v.env == {"TRITON_INTERPRET": "1"}


@pytest.mark.parametrize("argv, message", [
    ([_variants(["nproc=0"])], "nproc must be a positive integer"),
    ([_variants(["oops"])], "is not KEY=VALUE"),
    (["parity.tolerance=1"], "parity.tolerance: Key 'tolerance' not in 'ParityConfig'"),
    (["parity.loss_rtol=abc"], "parity.loss_rtol: Value 'abc' of type 'str' could not be converted to Float"),
    (["parity.weight_atol=0"], "parity.weight_atol must be > 0, got 0.0"),
    (["parity.against=/nonexistent/run.json"], "no such file"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert main(["model=dlrm_tiny", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("anyrec-parity: error:") and message in err[0], err


def _seen_runs(monkeypatch) -> list[tuple[list[str], parity.Variant, float]]:
    """The (base, variant, timeout) of every variant `main` runs (each returns the same record)."""
    seen = []

    def run_variant(base, variant, timeout_s):
        seen.append((base, variant, timeout_s))
        return _record([0.5], [0.0, 1.0])

    monkeypatch.setattr(parity, "run_variant", run_variant)
    return seen


def test_no_variants_runs_the_family_default_check_under_the_users_overrides(monkeypatch, capsys):
    """`anyrec-parity model=dlrmv4_small` runs its family's default check: the family's base overrides
    (less trainer.steps, which the command line sets: the user's own come last and win) and variants."""
    seen = _seen_runs(monkeypatch)
    assert main(["model=dlrmv4_small", "trainer.steps=3", "parity.timeout_s=60"]) == 0
    bases = {tuple(base) for base, _, _ in seen}
    assert bases == {("data.global_batch_size=64", "backend.attention_kernel=torch", "model=dlrmv4_small",
                      "trainer.steps=3")}  # parity.* stay here
    simple = "planner.name=simple planner.sharding"
    assert [v.label for _, v, _ in seen] == ["(base)", "nproc=2", f"{simple}=table_wise nproc=2",
                                             f"backend.embedding_kernel=torch {simple}=row_wise nproc=2"]
    assert [v.nproc for _, v, _ in seen] == [1, 2, 2, 2] and {t for _, _, t in seen} == {60.0}
    assert capsys.readouterr().out.startswith("check: default check of dlrmv4: data.global_batch_size=64 ")


def test_given_variants_replace_the_default_check(monkeypatch, capsys):
    seen = _seen_runs(monkeypatch)
    assert main(["model=dlrm_tiny", "trainer.steps=3", _variants(["nproc=2"])]) == 0
    assert [(base, v.label) for base, v, _ in seen] == [(["model=dlrm_tiny", "trainer.steps=3"], "nproc=2")]
    assert capsys.readouterr().out.startswith("check: parity.variants: model=dlrm_tiny trainer.steps=3\n")


def test_a_key_the_user_sets_is_dropped_from_the_default_variants():
    """The user's setting of a key the default variants vary wins there too; each label says what runs."""
    check = parity.choose_check(["model=dlrmv4_small", "+backend.embedding_kernel=fbgemm"], [], DLRMV4_FAMILY)
    assert check.name == "default check of dlrmv4"
    last = check.variants[-1]
    assert last.overrides == ["planner.name=simple", "planner.sharding=row_wise"] and last.nproc == 2
    assert last.label == "planner.name=simple planner.sharding=row_wise nproc=2"
    assert check.variants[1].label == "nproc=2"  # untouched


def test_a_base_setting_is_dropped_whole_where_the_user_sets_any_of_its_keys():
    """The DLRM check's recipe (row-wise Adagrad tables, SGD dense) is one setting: the user's optimizer
    replaces all of it, and the user's steps replace the check's."""
    check = parity.choose_check(["model=dlrm_tiny", "optim=adam", "trainer.steps=2"], [], DLRM_FAMILY)
    assert check.base == ["data.global_batch_size=64", "model=dlrm_tiny", "optim=adam", "trainer.steps=2"]
    assert parity.choose_check(["model=dlrm_tiny"], [], DLRM_FAMILY).base == [
        "trainer.steps=8", "data.global_batch_size=64", "optim=rowwise_adagrad", "optim.dense_name=sgd",
        "model=dlrm_tiny"]


@pytest.mark.parametrize("family", FAMILIES.values(), ids=FAMILIES.keys())
def test_every_family_has_a_default_check_over_kernels_plans_and_world_sizes(family):
    """A short job (a few steps, a global batch every world size splits alike) under variants that vary
    the embedding kernel, the plan and the world size, none setting a key of the base."""
    check = parity.choose_check(["model=x"], [], family)
    base_keys = {parity.override_key(o) for o in check.base}
    assert {"trainer.steps", "data.global_batch_size"} <= base_keys
    assert len(check.variants) >= 3 and check.variants[0].nproc == 1
    assert any(v.nproc > 1 for v in check.variants)
    varied = {parity.override_key(o) for v in check.variants for o in v.overrides}
    assert {"backend.embedding_kernel", "planner.sharding"} <= varied and not varied & base_keys


def test_help_lists_each_familys_default_check():
    """(tests/test_hydra.py checks that `anyrec-parity --help` prints it.)"""
    text = parity.default_checks_help()
    for family in FAMILIES.values():
        assert f"\n{family.name}: {' '.join(family.parity.base)}\n" in f"{text}\n"
        assert all(f"  variant: {v or '(base)'}" in text for v in family.parity.variants)


def _record(losses, w):
    return {"losses": losses, "weights_sha256": parity.weights_sha256({"t.weight": torch.tensor(w)}),
            "weights": {"t.weight": {"shape": [2], "values": w}}}


def test_compare_reports_the_largest_differences():
    ref = _record([1.0, 0.5], [0.0, 1.0])
    d = compare(ref, _record([1.0, 0.5001], [0.0, 1.25]))
    assert d["loss_abs"] == pytest.approx(1e-4) and d["loss_rel"] == pytest.approx(2e-4)
    assert d["weight_abs"] == 0.25
    assert compare(ref, ref) == {"loss_abs": 0.0, "loss_rel": 0.0, "weight_abs": 0.0}
    assert compare(ref, _record([1.0], [0.0, 1.0]))["loss_rel"] == math.inf  # fewer steps
    other = _record([1.0, 0.5], [0.0, 1.0])
    other["weights"] = {"u.weight": other["weights"]["t.weight"]}
    assert compare(ref, other)["weight_abs"] == math.inf  # a tensor missing


def test_against_a_saved_file(tmp_path, monkeypatch, capsys):
    """save writes every run; against compares with the first one, and a perturbed file fails."""
    record = _record([0.7, 0.6], [0.1, 0.2])  # every variant's
    monkeypatch.setattr(parity, "run_variant", lambda base, v, timeout_s: record)
    saved = tmp_path / "b200.json"
    assert main(["model=dlrm_tiny", f"parity.save={saved}"]) == 0
    data = json.loads(saved.read_text())
    assert data["format"] == parity.FORMAT and data["runs"][0]["losses"] == [0.7, 0.6]
    assert main(["model=dlrm_tiny", f"parity.against={saved}"]) == 0
    record = _record([0.7, 0.6 * (1 + 1e-4)], [0.1, 0.2])
    assert main(["model=dlrm_tiny", f"parity.against={saved}"]) == 1
    assert "DIFFERS" in capsys.readouterr().out


def _no_variant_runs(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a variant ran although an input or output was bad")
    monkeypatch.setattr(parity, "run_variant", refuse)


def _saved(tmp_path) -> tuple:
    """A valid records file and its data."""
    run = parity.sealed({"label": "(base)", **_record([0.7, 0.6], [0.1, 0.2])})
    data = {"format": parity.FORMAT, "runs": [run]}
    path = tmp_path / "ref.json"
    path.write_text(json.dumps(data))
    return path, data


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("anyrec-parity: error:"), err
    return err[0]


def _nan_loss(data):
    data["runs"][0]["losses"][1] = math.nan


def _value_changed(data):
    data["runs"][0]["weights"]["t.weight"]["values"][0] = 0.5


def _value_dropped(data):
    data["runs"][0]["weights"]["t.weight"]["values"].pop()


def _loss_edited(data):
    data["runs"][0]["losses"][1] = 0.6 * (1 + 1e-4)  # the weights and their hash left alone


def _label_edited(data):
    data["runs"][0]["label"] = "backend.embedding_kernel=fbgemm"


def _older_format(data):
    data["format"] = "anyrec-parity/1"


def _no_weights(data):
    del data["runs"][0]["weights"]


def _no_runs(data):
    data["runs"] = []


@pytest.mark.parametrize(("spoil", "message"), [
    (lambda text: text[:len(text) // 2], "not valid JSON (Unterminated string"),  # cut short
    (lambda text: "", "not valid JSON (Expecting value at line 1 column 1"),
    (_nan_loss, "run 0 losses is not a list of finite numbers"),
    (_value_changed, "run 0 weights do not match their weights_sha256"),
    (_value_dropped, "run 0 weight t.weight has 1 values for shape [2]"),
    (_loss_edited, "run 0 does not match its record_sha256"),
    (_label_edited, "run 0 does not match its record_sha256"),
    (_older_format, "written by an older anyrec"),
    (lambda text: "[" * 100_000 + "]" * 100_000, "nests deeper than 64"),
    (_no_weights, "run 0 has no 'weights'"),
    (_no_runs, "holds no runs"),
])
def test_against_file_is_checked_whole_before_any_variant_runs(tmp_path, monkeypatch, capsys, spoil, message):
    path, data = _saved(tmp_path)
    if spoil.__name__ == "<lambda>":
        path.write_text(spoil(path.read_text()))
    else:
        spoil(data)  # and signed, as a file this user wrote: the checks behind the signature's
        path.write_text(json.dumps(resolve_key(None).signed(data)))
    _no_variant_runs(monkeypatch)
    assert main(["model=dlrm_tiny", f"parity.against={path}"]) == 2
    line = _one_error_line(capsys)
    assert f"parity.against {path}" in line and message in line, line


def test_with_a_signing_key_records_are_signed_and_a_forged_one_refused(tmp_path, monkeypatch, capsys):
    """A forger can recompute record_sha256; without the key they cannot sign the file."""
    monkeypatch.setenv("ANYREC_SIGNING_KEY", "0123456789abcdef0123")
    monkeypatch.setattr(parity, "run_variant", lambda base, v, timeout_s: _record([0.7, 0.6], [0.1, 0.2]))
    saved = tmp_path / "ref.json"
    assert main(["model=dlrm_tiny", f"parity.save={saved}"]) == 0
    assert main(["model=dlrm_tiny", f"parity.against={saved}"]) == 0
    capsys.readouterr()
    data = json.loads(saved.read_text())
    assert data["hmac_sha256"]
    data["runs"][0]["losses"][1] = 0.5
    data["runs"][0] = parity.sealed(data["runs"][0])  # the hash made to match
    saved.write_text(json.dumps(data))
    assert main(["model=dlrm_tiny", f"parity.against={saved}"]) == 2
    assert "signature does not match" in _one_error_line(capsys)
    path, _ = _saved(tmp_path)  # unsigned
    assert main(["model=dlrm_tiny", f"parity.against={path}"]) == 2
    assert "is not signed" in _one_error_line(capsys)


def test_without_a_configured_key_a_resealed_record_is_refused(tmp_path, monkeypatch, capsys):
    """The per-user key signs what anyrec-parity saves: a record edited and resealed (its hashes made to
    match, the signature dropped or left stale) is refused without any key configured."""
    monkeypatch.delenv("ANYREC_SIGNING_KEY", raising=False)
    monkeypatch.setattr(parity, "run_variant", lambda base, v, timeout_s: _record([0.7, 0.6], [0.1, 0.2]))
    saved = tmp_path / "ref.json"
    assert main(["model=dlrm_tiny", f"parity.save={saved}"]) == 0
    assert main(["model=dlrm_tiny", f"parity.against={saved}"]) == 0
    capsys.readouterr()
    data = json.loads(saved.read_text())
    data["runs"][0]["losses"][1] = 0.5
    data["runs"][0] = parity.sealed(data["runs"][0])
    saved.write_text(json.dumps(data))
    assert main(["model=dlrm_tiny", f"parity.against={saved}"]) == 2
    assert "signature does not match" in _one_error_line(capsys)
    del data["hmac_sha256"]
    saved.write_text(json.dumps(data))
    assert main(["model=dlrm_tiny", f"parity.against={saved}"]) == 2
    assert "is not signed" in _one_error_line(capsys)


def test_escape_codes_in_a_record_never_reach_the_terminal(tmp_path, monkeypatch, capsys):
    """A label read from a records file (and a child's error line) is printed escaped."""
    monkeypatch.setattr(parity, "run_variant", lambda base, v, timeout_s: _record([0.7, 0.6], [0.1, 0.2]))
    path, data = _saved(tmp_path)
    data["runs"][0] = parity.sealed({**data["runs"][0], "label": "ref\x1b[2J\x1b]0;pwned\x07|x"})
    path.write_text(json.dumps(resolve_key(None).signed(data)))
    assert main(["model=dlrm_tiny", f"parity.against={path}"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "ref\\x1b[2J\\x1b]0;pwned\\x07\\|x from" in out, out
    table, _ = parity.report(["a\rb"], [{"error": "exit 1: \x1b[31mboom"}], data["runs"][0], "r",
                             ParityConfig())
    assert "\x1b" not in table and "\r" not in table and "a\\rb" in table


def test_unwritable_save_path_is_refused_before_any_variant_runs(tmp_path, monkeypatch, capsys):
    _no_variant_runs(monkeypatch)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main(["model=dlrm_tiny", f"parity.save={blocker}/out.json"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("anyrec-parity: error: parity.save") and "is a file, not a folder" in line, line
    assert main(["model=dlrm_tiny", f"parity.save={tmp_path}"]) == 2
    assert "is a folder, not a file" in _one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing written


BASE = ["model=dlrm_tiny", "backend=cpu", "trainer.steps=8", "trainer.eval_steps=0",
        "trainer.progress=false", "optim=rowwise_adagrad", "data.global_batch_size=64"]


def _run(variants: list[str], capsys) -> tuple[int, list[str]]:
    rc = main([*BASE, _variants(variants), "parity.timeout_s=400"])
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ") and "---" not in ln]
    return rc, rows[1:]


@pytest.mark.integration
def test_world_sizes_and_two_rank_plans_agree(capsys):
    """One rank (unsharded torch TBE) against row-wise, table-wise (anyrec's torch TBE) and
    data-parallel sharding over two loopback ranks, with the same global batch."""
    simple = "planner.name=simple planner.sharding"
    rc, rows = _run(["backend.embedding_kernel=torch",
                     f"backend.embedding_kernel=fbgemm {simple}=row_wise nproc=2",
                     f"backend.embedding_kernel=torch {simple}=table_wise nproc=2",
                     f"backend.embedding_kernel=fbgemm {simple}=data_parallel nproc=2"], capsys)
    assert rc == 0, rows
    assert len(rows) == 4 and all(r.split("|")[-2].strip() == "ok" for r in rows)


@pytest.mark.integration
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_one_rank_kernels_give_the_same_bits_and_plans_agree(optimizer, capsys):
    """SGD and exact Adagrad round as FBGEMM's CPU kernels do on anyrec's TBE too: FBGEMM and the
    torch TBE on one rank end with the same weights (same SHA-256), not merely within tolerance.
    (An embedding lr that is not a power of two, so that SGD's lr * g rounds.) With Adagrad, FBGEMM with
    every table replicated (trained by the replicated-table optimizer) agrees with both, and a kernel
    that does not exist fails its row."""
    base = [a for a in BASE if not a.startswith("optim=")] + [f"optim={optimizer}", "optim.embedding_lr=0.3"]
    variants = ["backend.embedding_kernel=torch", "backend.embedding_kernel=fbgemm"]
    if optimizer == "adagrad":
        variants += ["backend.embedding_kernel=fbgemm planner.name=simple planner.sharding=data_parallel",
                     "backend.embedding_kernel=no_such_kernel"]
    rc = main([*base, _variants(variants), "parity.timeout_s=400"])
    out = capsys.readouterr().out.splitlines()
    rows = [ln.split("|") for ln in out if ln.startswith("| ") and "---" not in ln][1:]
    if optimizer == "adagrad":
        assert rc == 1 and len(rows) == 4, rows  # the last variant fails, and says so in its row
        assert [r[-2].strip() for r in rows[:3]] == ["ok", "ok", "ok"] and "FAILED" in "|".join(rows[3])
    else:
        assert rc == 0 and len(rows) == 2, rows
    sha = [r[-3].strip() for r in rows[:2]]
    assert len(sha[0]) == 12 and sha[0] == sha[1], rows


@pytest.mark.integration
def test_dlrmv4_small_agrees_across_world_sizes_and_plans(tmp_path, capsys):
    """`anyrec-parity model=dlrmv4_small`, its family's default check: the sequence model on one rank
    against two ranks under the co-design plan, every table table-wise and every table row-wise (on
    anyrec's torch TBE): the same losses and weights within tolerance, each variant under the plan and
    kernel it names."""
    saved = tmp_path / "v4.json"
    rc = main(["model=dlrmv4_small", f"parity.save={saved}", "parity.timeout_s=400"])
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert out.startswith("check: default check of dlrmv4: "), out
    assert rc == 0 and len(rows) == 5 and all(r.split("|")[-2].strip() == "ok" for r in rows[1:]), rows
    runs = json.loads(saved.read_text())["runs"]
    assert [r["meta"]["world_size"] for r in runs] == [1, 2, 2, 2]
    assert runs[2]["meta"]["sharding_types"] == ["table_wise"]
    assert runs[3]["meta"]["sharding_types"] == ["row_wise"]
    assert [r["meta"]["embedding_kernel"] for r in runs] == ["fbgemm", "fbgemm", "fbgemm", "torch"]
    assert len(runs[0]["losses"]) == 4 and all(0 < x < 1 for x in runs[0]["losses"])

"""anyrec-parity: argument parsing, the comparison, and real runs across kernels, plans and ranks."""

from __future__ import annotations

import json
import math

import pytest

from anyrec import parity
from anyrec.parity import compare, main, parse_args, parse_variant


def test_variant_tokens_split_into_overrides_ranks_and_environment():
    v = parse_variant("backend.embedding_kernel=triton nproc=2 TRITON_INTERPRET=1 "
                      "'planner.sharding=row_wise'")
    assert v.overrides == ["backend.embedding_kernel=triton", "planner.sharding=row_wise"]
    assert v.nproc == 2 and v.env == {"TRITON_INTERPRET": "1"}


@pytest.mark.parametrize("argv, message", [
    (["parity.variant=nproc=0"], "nproc must be a positive integer"),
    (["parity.variant=oops"], "is not KEY=VALUE"),
    (["parity.tolerance=1"], "unknown option parity.tolerance"),
    (["parity.loss_rtol=abc"], "must be a number"),
    (["parity.weight_atol=0"], "must be > 0"),
    (["parity.against=/nonexistent/run.json"], "no such file"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(ValueError, match=message):
        parse_args(argv)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("anyrec-parity: error:") and message in err[0]


def test_base_overrides_and_defaults():
    args = parse_args(["model=dlrm_tiny", "trainer.steps=3"])
    assert args.base == ["model=dlrm_tiny", "trainer.steps=3"]
    assert [v.label for v in args.variants] == ["(base)"]
    assert (args.loss_rtol, args.weight_atol) == (1e-5, 1e-5)


def _record(losses, w):
    return {"losses": losses, "weights_sha256": "0" * 64,
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
    runs = iter([_record([0.7, 0.6], [0.1, 0.2]), _record([0.7, 0.6], [0.1, 0.2])])
    monkeypatch.setattr(parity, "run_variant", lambda base, v, timeout_s: next(runs))
    saved = tmp_path / "b200.json"
    assert main(["model=dlrm_tiny", f"parity.save={saved}"]) == 0
    data = json.loads(saved.read_text())
    assert data["format"] == parity.FORMAT and data["runs"][0]["losses"] == [0.7, 0.6]
    assert main(["model=dlrm_tiny", f"parity.against={saved}"]) == 0
    data["runs"][0]["losses"][1] = 0.6 * (1 + 1e-4)
    saved.write_text(json.dumps(data))
    runs = iter([_record([0.7, 0.6], [0.1, 0.2])])
    assert main(["model=dlrm_tiny", f"parity.against={saved}"]) == 1
    assert "DIFFERS" in capsys.readouterr().out

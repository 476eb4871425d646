"""2-process gloo: a DLRM sharded table-wise and row-wise matches an unsharded copy."""

from __future__ import annotations

import json

import pytest

from .conftest import ROOT, torchrun

pytestmark = pytest.mark.integration  # every test here starts processes


def test_sharded_dlrm_matches_unsharded(tmp_path):
    proc = torchrun([str(ROOT / "tests" / "dist" / "sharding_check.py"), str(tmp_path)], nproc=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert set(results[0]["shardings"].values()) == {"table_wise", "row_wise"}
    for res in results:
        assert res["max_logit_diff"] < 1e-5
        for name, diff in res["max_weight_diff"].items():
            assert diff < 1e-5, (name, diff)
        # Every table and layer really trained (the comparison is not of untouched weights).
        for name, moved in res["max_update"].items():
            if "sparse_arch" in name or name.endswith("weight"):
                assert moved > 1e-4, (name, moved)
    # Every table is present on some rank.
    tables = {k for res in results for k in res["max_weight_diff"] if "sparse_arch" in k}
    assert len(tables) == 6

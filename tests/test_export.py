"""anyrec.serving and the export entry point, in process: the scoring model against the trained DLRM, int8
quantization, checkpoint reading, the artifact's manifest and its refusals, and input checks."""

from __future__ import annotations

import dataclasses
import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from anyrec import export as export_cli
from anyrec.config import IdLayout, Int8Kernel, ModelConfig, TablePrecision
from anyrec.models.dlrm import build_model, table_configs
from anyrec.models.dlrm_scoring import batch_inputs, checker
from anyrec.models.family import DLRM_FAMILY
from anyrec.models.init import init_model
from anyrec.runtime.errors import CheckpointError
from anyrec.schema import load_model_config
from anyrec.serving.artifact import export_program, load_artifact, read_manifest
from anyrec.serving.model import ScoringModel, dequantize_rowwise_int8, quantize_rowwise_int8
from anyrec.serving.program import ScoringProgram
from anyrec.serving.scoring import score_batches
from anyrec.serving.weights import load_checkpoint
from anyrec.trainer.trainer import DLRMTrain
from tests.conftest import compose_config, trainer_checkpoint

TINY = load_model_config("dlrm_tiny")
# a cross-net model with multi-hot features (bags of 1 to 4 ids, some empty in `_batch`)
TINY_DCN = dataclasses.replace(TINY, name="tiny_dcn", interaction="dcn", table_rows=[50, 7, 300],
                               multi_hot=[3, 1, 4], dcn_num_layers=2, dcn_low_rank=4)


def _model(cfg: ModelConfig, seed: int = 0):
    model = build_model(cfg, torch.device("cpu"))
    init_model(model, table_configs(cfg), seed, "sparse_arch")
    with torch.no_grad():  # trained-looking tables: not the init's narrow uniform rows
        for p in model.sparse_arch.parameters():
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed))
    return model.eval()


def _batch(cfg: ModelConfig, size: int = 6, seed: int = 0) -> Batch:
    """A batch of `cfg`'s shape; multi-hot features get bags of 0 to their size (some empty)."""
    g = torch.Generator().manual_seed(seed)
    hot = list(cfg.multi_hot) or [1] * len(cfg.table_rows)
    lengths, values = [], []
    for rows, h in zip(cfg.table_rows, hot, strict=True):
        n_B = torch.randint(0 if h > 1 else 1, h + 1, (size,), generator=g)
        lengths.append(n_B)
        values.append(torch.randint(0, rows, (int(n_B.sum()),), generator=g))
    kjt = KeyedJaggedTensor.from_lengths_sync([f"cat_{i}" for i in range(len(hot))], torch.cat(values),
                                              torch.cat(lengths))
    return Batch(torch.randn(size, cfg.num_dense_features, generator=g), kjt,
                 torch.randint(0, 2, (size,), generator=g).float())


@pytest.mark.parametrize("cfg", [TINY, TINY_DCN], ids=["dot", "dcn_multihot"])
@pytest.mark.parametrize("layout", ["offsets", "lengths"])
def test_fp32_scoring_model_scores_as_the_trained_model(cfg, layout):
    model, batch = _model(cfg), _batch(cfg)
    scoring = ScoringModel(model, TablePrecision.fp32, IdLayout(layout)).eval()
    with torch.no_grad():
        want_B = model(batch.dense_features, batch.sparse_features)
        got_B = scoring(*batch_inputs(batch, IdLayout(layout), torch.device("cpu")).args())
    torch.testing.assert_close(got_B, want_B, rtol=0, atol=0)  # the trained model's roundings
    assert want_B.std() > 0.01  # the scores depend on the inputs: a real comparison


@pytest.mark.parametrize("precision, kernel, atol", [("fp16", "torch", 2e-3), ("int8", "torch", 3e-2),
                                                     ("int8", "fbgemm", 3e-2)])
def test_reduced_precision_tables_stay_close(precision, kernel, atol):
    model, batch = _model(TINY_DCN), _batch(TINY_DCN, size=32)
    fp32 = ScoringModel(model, TablePrecision.fp32, IdLayout.offsets)
    low = ScoringModel(model, TablePrecision(precision), IdLayout.offsets, Int8Kernel(kernel))
    args = batch_inputs(batch, IdLayout.offsets, torch.device("cpu")).args()
    with torch.no_grad():
        diff = (low(*args) - fp32(*args)).abs().max().item()
    assert 0 < diff < atol  # rounded (not the fp32 tables), and close
    assert low.tables.weight.dtype == {"fp16": torch.float16, "int8": torch.uint8}[precision]


def test_rowwise_int8_error_is_within_half_a_step():
    w_RD = torch.randn(64, 16) * torch.logspace(-3, 1, 64)[:, None]
    w_RD[5] = 0.25  # a constant row: exact
    q_RD, sb_R2 = quantize_rowwise_int8(w_RD)
    back_RD = dequantize_rowwise_int8(q_RD, sb_R2)
    assert q_RD.dtype == torch.uint8 and int(q_RD.max()) == 255 and int(q_RD.min()) == 0
    err_RD = (back_RD - w_RD).abs()
    assert (err_RD <= sb_R2[:, :1] / 2 * (1 + 1e-5) + 1e-7).all()
    assert err_RD[5].max() == 0


def _checkpoint(tmp: Path, cfg: ModelConfig, model) -> Path:
    """A checkpoint of `model` written by the trainer's CheckpointManager (the DLRMTrain key layout)."""
    tables = {c.name: [c.num_embeddings, c.embedding_dim] for c in table_configs(cfg)}
    return trainer_checkpoint(tmp, DLRMTrain(model), tables, "adagrad", 7, cfg.name)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny trained-looking model, its checkpoint, and its fp32 export through the entry point's run."""
    tmp = tmp_path_factory.mktemp("export")
    model = _model(TINY)
    ckpt = _checkpoint(tmp, TINY, model)
    _, cfg = compose_config(["model=dlrm_tiny", f"export.checkpoint={ckpt.parent}",
                             f"export.output={tmp / 'tiny.pt2'}"])
    printed = []
    export_cli.run(cfg, print_fn=printed.append)
    return model, ckpt, tmp / "tiny.pt2", json.loads(printed[-1])


def test_checkpoint_loads_into_the_unsharded_model(tmp_path):
    model = _model(TINY, seed=3)
    ckpt = _checkpoint(tmp_path, TINY, model)
    loaded = load_checkpoint(ckpt.parent, TINY, DLRM_FAMILY)  # the folder: its newest checkpoint
    assert loaded.step == 7 and loaded.path == ckpt and set(loaded.sha256) >= {".metadata"}
    for (name, want), got in zip(model.state_dict().items(), loaded.model.state_dict().values(), strict=True):
        assert torch.equal(want, got), name
    other = dataclasses.replace(TINY, table_rows=[*TINY.table_rows[:-1], 5])
    with pytest.raises(CheckpointError, match=r"t_cat_25 is 256 rows .*\(model=dlrm_tiny here"):
        load_checkpoint(ckpt, other, DLRM_FAMILY)


def test_a_damaged_checkpoint_is_refused(tmp_path):
    ckpt = _checkpoint(tmp_path, TINY, _model(TINY))
    shard = next(p for p in ckpt.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(ckpt, TINY, DLRM_FAMILY)


def test_the_artifact_scores_as_the_model_and_says_what_it_is(exported):
    model, ckpt, path, printed = exported
    artifact = load_artifact(path)
    info = artifact.manifest
    assert printed["artifact"] == str(path.resolve()) and printed["precision"] == "fp32"
    assert info["checkpoint"]["step"] == 7 and info["checkpoint"]["path"] == str(ckpt.resolve())
    assert info["checkpoint"]["sha256"] == json.loads((ckpt / "meta.json").read_text())["sha256"]
    assert [f["rows"] for f in info["features"]] == TINY.table_rows
    assert info["table_bytes"] == sum(TINY.table_rows) * TINY.embedding_dim * 4
    assert artifact.model == TINY
    _scores_as(model, TINY, artifact.program)
    _scores_as(model, TINY, artifact.scorer)


def _scores_as(model, cfg: ModelConfig, program) -> None:
    """`program` scores as the trained `model`, bit for bit (fp32 tables)."""
    for size in (1, 9):  # the batch is dynamic, one sample included
        batch = _batch(cfg, size=size, seed=size)
        with torch.no_grad():
            want_B = model(batch.dense_features, batch.sparse_features)
        got_B = program(*batch_inputs(batch, IdLayout.offsets, torch.device("cpu")).args())
        torch.testing.assert_close(got_B, want_B, rtol=0, atol=0)
        assert size == 1 or want_B.std() > 0.01


def test_a_cross_net_model_with_multi_hot_features_exports():
    model = _model(TINY_DCN)
    scoring = ScoringModel(model, TablePrecision.fp32, IdLayout.offsets)
    program = export_program(scoring, DLRM_FAMILY, TINY_DCN, IdLayout.offsets)
    _scores_as(model, TINY_DCN, program.module())
    _scores_as(model, TINY_DCN, ScoringProgram(program, 7, checker(TINY_DCN, IdLayout.offsets)))


@pytest.mark.parametrize("precision, kernel", [("int8", "fbgemm"), ("int8", "torch"), ("fp16", "torch")])
@pytest.mark.parametrize("layout", ["offsets", "lengths"])
def test_the_graph_called_directly_scores_as_the_guarded_module(precision, kernel, layout):
    """`ScoringProgram` (what anyrec-predict calls) gives the module's scores, bit for bit."""
    model, layout = _model(TINY_DCN), IdLayout(layout)
    program = export_program(ScoringModel(model, TablePrecision(precision), layout, Int8Kernel(kernel)),
                             DLRM_FAMILY, TINY_DCN, layout)
    direct = ScoringProgram(program, 7, checker(TINY_DCN, layout))
    guarded = program.module()
    for size in (1, 7):
        args = batch_inputs(_batch(TINY_DCN, size=size, seed=size), layout, torch.device("cpu")).args()
        with torch.no_grad():
            got_B, want_B = direct(*args), guarded(*args)
        assert got_B.shape == (size,) and torch.equal(got_B, want_B)


def test_the_graph_called_directly_refuses_mismatched_inputs_in_one_line(exported):
    _, _, path, _ = exported
    scorer = load_artifact(path).scorer
    dense_BI, ids, bags = batch_inputs(_batch(TINY, size=4), IdLayout.offsets, torch.device("cpu")).args()
    assert scorer(dense_BI, ids, bags).shape == (4,)
    cases = {"25 ids and 25 bags tensors, the program has 26": (dense_BI, ids[1:], bags[1:]),
             "dense is torch.float32 \\[4, 5\\]": (dense_BI[:, :5], ids, bags),
             "dense is torch.float64": (dense_BI.double(), ids, bags),
             "feature 3: ids torch.int32": (dense_BI, [*ids[:3], ids[3].int(), *ids[4:]], bags),
             "feature 0: .* int64 bags of 5 offsets": (dense_BI, ids, [bags[0][:-1], *bags[1:]]),
             "int64 bags of 4 offsets for a batch of 3": (dense_BI[:3], ids, bags)}
    for why, args in cases.items():
        with pytest.raises(ValueError, match=why) as e:
            scorer(*args)
        assert "\n" not in str(e.value)


def test_the_graph_called_directly_moves_to_a_device(exported):
    """`to(device)`: the weights moved and the graph run there (the meta device: shapes only, no GPU)."""
    _, _, path, _ = exported
    scorer = load_artifact(path).scorer
    assert scorer.to(torch.device("cpu")) is scorer
    meta = scorer.to(torch.device("meta"))
    assert meta.device.type == "meta" and scorer.device.type == "cpu"
    dense_BI, ids, bags = batch_inputs(_batch(TINY, size=4), IdLayout.offsets, torch.device("meta")).args()
    logits_B = meta(dense_BI, ids, bags)
    assert logits_B.device.type == "meta" and logits_B.shape == (4,)


def test_a_program_of_another_shape_is_not_called_as_a_scoring_program(exported):
    _, _, path, _ = exported
    program = torch.export.load(str(path))
    with pytest.raises(ValueError, match="not an anyrec scoring program"):
        ScoringProgram(program, 51, checker(TINY, IdLayout.offsets))


def test_tables_larger_than_the_host_are_refused_before_anything_is_written(exported, tmp_path):
    _, ckpt, _, _ = exported
    _, cfg = compose_config(["model=dlrm_tiny", f"export.checkpoint={ckpt}",
                             f"export.output={tmp_path}/x.pt2",
                             "export.precision=int8"])
    need = sum(TINY.table_rows) * (TINY.embedding_dim * 5 + 8)  # fp32 read + int8 with scale/bias
    why = f"needs {need / 2**30:.2f} GiB of host memory, this host has 0.00 GiB"
    with pytest.raises(ValueError, match=why):
        export_cli.run(cfg, host_bytes=need - 1)
    assert not list(tmp_path.iterdir())


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of archive `src` with `edit(name, data) -> data` applied to each member."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            zout.writestr(item, edit(item.filename, zin.read(item.filename)))
    return dst


class _Payload:
    def __reduce__(self):
        return (print, ("unpickled",))


def test_bad_artifacts_are_refused_in_one_line(exported, tmp_path):
    _, _, path, _ = exported
    (tmp_path / "text.pt2").write_text("hello")
    cases = {tmp_path / "missing.pt2": "no such file", tmp_path / "text.pt2": "not a torch.export archive"}
    drop = _rewrite(path, tmp_path / "nomanifest.pt2",
                    lambda n, d: b"{}" if n.endswith("manifest.json") else d)
    cases[drop] = "not an anyrec scoring manifest"

    def pickled_weight(name: str, data: bytes) -> bytes:
        if "weights_config" not in name:
            return data
        return data.replace(b'"use_pickle": false', b'"use_pickle": true', 1)
    cases[_rewrite(path, tmp_path / "pickled.pt2", pickled_weight)] = "stored as a pickled object"
    forged = io.BytesIO()
    torch.save({"x": _Payload()}, forged)
    cases[_rewrite(path, tmp_path / "forged.pt2",
                   lambda n, d: forged.getvalue() if "/sample_inputs/" in n else d)] = \
        "sample inputs are not plain"
    for bad, why in cases.items():
        with pytest.raises(ValueError, match=why) as e:
            load_artifact(bad)
        assert "\n" not in str(e.value)
    assert read_manifest(path)["format"] == "anyrec-scoring"


@pytest.mark.parametrize("call", ["scorer", "program"])
def test_mismatched_inputs_are_refused_before_scoring(exported, call):
    _, _, path, _ = exported
    artifact = load_artifact(path)
    program = getattr(artifact, call)  # the graph called directly (what anyrec-predict calls), the module
    cpu = torch.device("cpu")
    good = _batch(TINY, size=4)
    run = score_batches(program, DLRM_FAMILY, TINY, IdLayout.offsets, [good], cpu)
    assert run.samples == 4 and np.isfinite(torch.cat(run.probs).numpy()).all()
    kjt = good.sparse_features
    too_big = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values() + 10_000, kjt.lengths())
    fewer = KeyedJaggedTensor.from_lengths_sync(kjt.keys()[:-1], kjt.values()[:-4], kjt.lengths()[:-4])
    for batch, why in [(Batch(good.dense_features, too_big, good.labels), "out of range|outside"),
                       (Batch(good.dense_features, fewer, good.labels), "25 sparse features"),
                       (Batch(good.dense_features[:, :5], kjt, good.labels), "5 dense features")]:
        with pytest.raises(ValueError, match=why):
            score_batches(program, DLRM_FAMILY, TINY, IdLayout.offsets, [batch], cpu)

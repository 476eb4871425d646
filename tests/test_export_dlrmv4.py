"""DLRMv4's scoring artifact, in process, on a tiny dlrmv4_small: a checkpoint exported through the entry
point's run scores ragged batches (an empty history, length 1, the longest sequence, padding samples) as
the trained model does, at every id layout and table precision; its jagged inputs are checked in one line
before its graph runs; a forged artifact is refused."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from anyrec import export as export_cli
from anyrec.backends.dispatch import get_impl
from anyrec.config import IdLayout, Int8Kernel, TablePrecision
from anyrec.data.sequences import SequenceBatch
from anyrec.models.dlrmv4 import dlrmv4_config, table_configs
from anyrec.models.dlrmv4_scoring import FEATURES, S
from anyrec.models.family import DLRMV4_FAMILY
from anyrec.models.init import init_model
from anyrec.serving.artifact import load_artifact
from anyrec.serving.model import TableStages
from anyrec.serving.scoring import score_batches
from tests.conftest import compose_config, trainer_checkpoint

MODEL = ["model=dlrmv4_small", "model.hstu.table_scale=0.000002"]  # tables of 2 to 200 rows
CPU = torch.device("cpu")
EXPORT = DLRMV4_FAMILY.export_signature()


def _config():
    return compose_config(MODEL)[1].model


def _trained(seed: int = 0):
    """A trained-looking dlrmv4_small (its tables drawn wide, not the init's narrow rows), eval mode."""
    cfg = _config()
    train = DLRMV4_FAMILY.build_train(cfg, CPU, CPU, {"hstu_attention": get_impl("hstu_attention", "torch")})
    init_model(train, table_configs(cfg), seed, "sparse_arch", collection="embeddings")
    with torch.no_grad():
        for p in train.sparse_arch.parameters():
            p.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
    return train.eval()


def _batch(lengths: list[int], seed: int = 0) -> SequenceBatch:
    """Samples of `lengths` positions (history, then one target; 0: a padding sample, no target)."""
    g = torch.Generator().manual_seed(seed)
    rows = dlrmv4_config(_config()).table_rows
    lengths_B = torch.tensor(lengths)
    T, B = int(lengths_B.sum()), len(lengths)
    values = [torch.randint(0, rows[f], (T if i < S else B,), generator=g) for i, f in enumerate(FEATURES)]
    ones_B = torch.ones(B, dtype=torch.int64)
    kjt = KeyedJaggedTensor(keys=list(FEATURES), values=torch.cat(values),
                            lengths=torch.cat([lengths_B] * S + [ones_B] * (len(FEATURES) - S)))
    stamps = [1_700_000_000 + torch.sort(torch.randint(0, 30 * 86_400, (n,), generator=g)).values
              for n in lengths]
    targets = (lengths_B > 0).long()
    return SequenceBatch(kjt, torch.randint(0, 8, (T,), generator=g), torch.cat(stamps), targets,
                         torch.randint(0, 2, (int(targets.sum()),), generator=g).float(), window=0)


LONGEST = 64 - 8  # dlrmv4_small's max_seq_len less its 8 contextual tokens
RAGGED = [[1, 2, 37, LONGEST, 0, 9], [LONGEST], [1], [0, 5]]  # empty history, length 1 (2), max, padding


def _checkpoint(tmp: Path, train) -> Path:
    """A checkpoint of `train` as the trainer writes it (its signature, signed with the per-user key)."""
    cfg = _config()
    return trainer_checkpoint(tmp, train, DLRMV4_FAMILY.table_shapes(cfg), "rowwise_adagrad", 11, cfg.name)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny trained-looking dlrmv4_small, its checkpoint, and its fp32 export by the entry point's run."""
    tmp = tmp_path_factory.mktemp("export_v4")
    train = _trained()
    ckpt = _checkpoint(tmp, train)
    _, cfg = compose_config([*MODEL, f"export.checkpoint={ckpt.parent}", f"export.output={tmp / 'v4.pt2'}"])
    printed = []
    export_cli.run(cfg, print_fn=printed.append)
    # loaded once: torch.export.load of this graph takes seconds (its symbolic shapes)
    return train, tmp / "v4.pt2", json.loads(printed[-1]), load_artifact(tmp / "v4.pt2")


def _eager(train, batch: SequenceBatch) -> torch.Tensor:
    with torch.no_grad():
        _, (logits_G, _) = train(batch)
    return logits_G


def test_the_artifact_scores_ragged_batches_as_the_trained_model(exported):
    train, _, printed, artifact = exported
    assert printed["checkpoint"]["step"] == 11 and artifact.model.name == "dlrmv4_small"
    assert [f["name"] for f in artifact.manifest["features"]] == list(FEATURES)
    for i, lengths in enumerate(RAGGED):
        batch = _batch(lengths, seed=i)
        want_G = _eager(train, batch)
        args, labels = EXPORT.batch_args(batch, IdLayout.offsets, CPU)
        for program in (artifact.scorer, artifact.program):  # the graph called directly, the module
            got_G = program(*args)
            assert got_G.shape == labels.shape == (sum(n > 0 for n in lengths),)
            torch.testing.assert_close(got_G, want_G, rtol=0, atol=1e-6)
    assert want_G.numel() == 1 or want_G.std() > 0.01  # the scores depend on the inputs


@pytest.mark.parametrize("layout, precision, kernel, atol",
                         [("lengths", "fp32", "torch", 1e-6), ("offsets", "fp16", "torch", 5e-3),
                          ("offsets", "int8", "torch", 5e-2), ("lengths", "int8", "fbgemm", 5e-2)])
def test_every_id_layout_and_table_precision_scores_close(exported, layout, precision, kernel, atol):
    """The scoring module itself (what is traced), eager: the layouts give the trained model's scores, the
    narrower tables close to them."""
    train = exported[0]
    scoring = EXPORT.build(train, TableStages(TablePrecision(precision), IdLayout(layout),
                                               Int8Kernel(kernel))).eval()
    batch = _batch(RAGGED[0], seed=7)
    want_G = _eager(train, batch)
    with torch.no_grad():
        got_G = scoring(*EXPORT.batch_args(batch, IdLayout(layout), CPU)[0])
    diff = (got_G - want_G).abs().max().item()
    assert diff <= atol and (precision == "fp32" or diff > 0)


def test_predict_scores_sequence_batches_with_the_trainers_metrics(exported):
    artifact = exported[3]
    batches = [_batch(lengths, seed=i) for i, lengths in enumerate(RAGGED)]
    run = score_batches(artifact.scorer, DLRMV4_FAMILY, artifact.model, IdLayout.offsets, batches, CPU)
    assert run.samples == sum(n > 0 for lengths in RAGGED for n in lengths) and run.batches == len(RAGGED)
    assert 0 <= run.metrics["auc"] <= 1 and np.isfinite(torch.cat(run.probs).numpy()).all()


def _replace(args, **changes):
    ids, bags, actions, stamps, targets = args
    named = {"ids": ids, "bags": bags, "actions": actions, "timestamps": stamps, "num_targets": targets}
    return tuple({**named, **changes}.values())


def test_bad_inputs_are_refused_in_one_line_before_the_graph(exported):
    scorer = exported[3].scorer
    args, _ = EXPORT.batch_args(_batch([3, 5, 1]), IdLayout.offsets, CPU)
    ids, bags, actions, stamps, targets = args
    assert scorer(*args).shape == (3,)
    too_big = [ids[0].clone(), *ids[1:]]
    too_big[0][1] = 10_000
    long_ids = [torch.zeros(LONGEST + 1, dtype=torch.int64)] * S + [i[:1] for i in ids[S:]]
    long_pos = torch.zeros(LONGEST + 1, dtype=torch.int64)
    cases = {"ids must be a list of 11 tensors": _replace(args, ids=ids[:-1]),
             "inputs: artist_id has 8 entries": _replace(args, ids=[ids[0], ids[1][:-1], *ids[2:]]),
             "bags add up to 9 positions, the sequence features have 10": _replace(
                 args, ids=[torch.cat([i, i[:1]]) for i in ids[:S]] + ids[S:],
                 actions=torch.cat([actions, actions[:1]]), timestamps=torch.cat([stamps, stamps[:1]])),
             "bags must be offsets of non-negative lengths rising from 0": _replace(
                 args, bags=torch.tensor([0, 5, 3, 9])),
             "inputs: bags has 3 entries": _replace(args, bags=bags[:-1]),
             "inputs: timestamps is torch.int32": _replace(args, timestamps=stamps.int()),
             "feature item_id: id 10000 out of range": _replace(args, ids=too_big),
             "between 0 \\(a padding sample\\) and its positions": _replace(
                 args, num_targets=torch.tensor([1, 6, 1])),
             "a sequence of 57 positions plus 8 contextual tokens exceeds the model's max_seq_len=64":
                 (long_ids, torch.tensor([0, LONGEST + 1]), long_pos, long_pos, torch.tensor([1]))}
    for why, bad in cases.items():
        with pytest.raises(ValueError, match=why) as e:
            scorer(*bad)
        assert "\n" not in str(e.value)


def test_a_batch_whose_sequence_features_differ_in_length_is_refused(exported):
    artifact = exported[3]
    good = _batch([3, 5])
    kjt = good.sparse_features
    lengths = kjt.lengths().clone()
    lengths[2], lengths[3] = 4, 4  # artist_id: 4 and 4 where item_id has 3 and 5 (same total)
    bad = SequenceBatch(KeyedJaggedTensor(kjt.keys(), kjt.values(), lengths=lengths), good.actions,
                        good.timestamps, good.num_targets, good.labels, 0)
    with pytest.raises(ValueError, match="bad input at batch 1: .*same lengths in every sample"):
        score_batches(artifact.program, DLRMV4_FAMILY, artifact.model, IdLayout.offsets, [bad], CPU)


def test_a_forged_artifact_is_refused(exported, tmp_path):
    path = exported[1]
    forged = tmp_path / "forged.pt2"
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(forged, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if "weights_config" in item.filename:
                data = data.replace(b'"use_pickle": false', b'"use_pickle": true', 1)
            zout.writestr(item, data)
    with pytest.raises(ValueError, match="stored as a pickled object"):
        load_artifact(forged)

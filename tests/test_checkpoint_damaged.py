"""A damaged newest checkpoint is named on the console and set aside (the resume says which one it
takes instead); a checkpoint whose folder name disagrees with the step inside it is refused."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from anyrec.config import CheckpointConfig
from anyrec.runtime.distributed import ONE_PROCESS
from anyrec.runtime.errors import CheckpointError
from anyrec.trainer.checkpoint import CheckpointManager

from .test_checkpoint_trust import SIGNATURE, _state


def _two_saves(root):
    m = CheckpointManager(CheckpointConfig(dir=str(root)), SIGNATURE, ONE_PROCESS, {"seed": 0})
    m.start()
    for step in (4, 6):
        m.save(step, _state(), {})
    m.close()


def test_a_damaged_newest_checkpoint_is_named_and_set_aside(tmp_path, caplog):
    root = tmp_path / "ck"
    _two_saves(root)
    (root / "step_6" / "meta.json").write_text("[" * 100_000 + "]" * 100_000)
    m = CheckpointManager(CheckpointConfig(dir=str(root)), SIGNATURE, ONE_PROCESS, {"seed": 0})
    with caplog.at_level(logging.WARNING, logger="anyrec.trainer.checkpoint"):
        start = m.start()
    assert start == root / "step_4"
    said = [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "damaged" in r.getMessage()]
    assert len(said) == 1, said
    assert str(root / "step_6") in said[0] and "nests deeper than 64" in said[0]
    assert f"resuming from the newest usable one, {root / 'step_4'}" in said[0]
    aside = [p.name for p in root.iterdir() if p.name.startswith("step_6.damaged-")]
    assert len(aside) == 1 and f"moved to {aside[0]}" in said[0] and not (root / "step_6").exists()
    m.save(6, _state(), {})  # the step is written again, nothing of the damaged one in the way
    m.close()
    assert (root / aside[0]).is_dir()  # kept for whoever looks into it


def test_a_checkpoint_named_for_another_step_is_refused(tmp_path):
    root = tmp_path / "ck"
    _two_saves(root)
    shutil.rmtree(root / "step_6")
    (root / "step_4").rename(root / "step_6")
    m = CheckpointManager(CheckpointConfig(dir=str(root)), SIGNATURE, ONE_PROCESS, {"seed": 0})
    path = m.start()
    with pytest.raises(CheckpointError) as e:
        m.read_meta(path)
    m.close()
    text = str(e.value)
    assert "\n" not in text and "holds step 4 but is named step_6" in text and str(root / "step_6") in text


@pytest.mark.parametrize("step", ["6", -1, True, 6.0])
def test_a_step_that_is_not_a_step_is_refused(tmp_path, step):
    root = tmp_path / "ck"
    _two_saves(root)
    meta_path = root / "step_6" / "meta.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "step": step}))
    m = CheckpointManager(CheckpointConfig(dir=str(root)), SIGNATURE, ONE_PROCESS, {"seed": 0})
    with pytest.raises(CheckpointError, match="meta.json's step is .*, not a step"):
        m.read_meta(root / "step_6")

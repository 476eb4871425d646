"""The scoring artifact: a `torch.export` program (`.pt2`) with its manifest inside (`extra/manifest.json`).

Loading it needs torch only:

    files = {"manifest.json": ""}
    program = torch.export.load("model.pt2", extra_files=files).module()
    logits_B = program(dense_BI, ids, bags)  # ids, bags: one tensor per feature (see the manifest)

`torch.export.load` unpickles whatever the archive marks as pickled (weights, constants, custom objects,
and its sample inputs after a failed restricted read). `load_artifact` refuses such an archive first:
an anyrec artifact holds plain tensors only, and its sample inputs read with `weights_only=True`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.export import Dim
from torch.fx.experimental import _config as fx_config

import anyrec
from anyrec.config import Int8Kernel, ModelConfig
from anyrec.io_checks import atomic_write, writable_file
from anyrec.safe_load import load_json
from anyrec.schema import sparse_features
from anyrec.serving.model import IdLayout, ScoringInputs, ScoringModel, TablePrecision, table_bytes
from anyrec.serving.program import ScoringProgram

MANIFEST = "manifest.json"
FORMAT = "anyrec-scoring"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 2**20
_MAX_CONFIG_BYTES = 64 * 2**20  # a weights/constants index: a few hundred bytes per tensor


def example_inputs(model: ModelConfig, id_layout: IdLayout, batch: int = 3) -> ScoringInputs:
    """A small batch of `model`'s shape (two ids per bag: no id count equal to the batch, which `torch.export`
    would take for a relation)."""
    feats = sparse_features(model)
    ids = [torch.arange(2 * batch, dtype=torch.int64) % f.num_rows for f in feats]
    if id_layout == IdLayout.lengths:
        bags = [torch.full((batch,), 2, dtype=torch.int64) for _ in feats]
    else:
        bags = [torch.arange(0, 2 * batch + 1, 2, dtype=torch.int64) for _ in feats]
    return ScoringInputs(torch.zeros(batch, model.num_dense_features), ids, bags)


def export_program(scoring: ScoringModel, model: ModelConfig) -> torch.export.ExportedProgram:
    """`scoring` traced by `torch.export`, the batch and every feature's id count dynamic."""
    layout = scoring.tables.id_layout
    example = example_inputs(model, layout)
    batch = Dim("batch", min=1)
    ids = [{0: Dim(f"ids_{i}", min=0)} for i in range(len(example.ids))]
    bags = [{0: batch if layout == IdLayout.lengths else batch + 1} for _ in example.bags]
    scoring = scoring.eval().requires_grad_(False)  # a scoring call builds no autograd graph
    # size-oblivious: a batch of 1 or a feature without ids runs the same graph (no 0/1 specialisation)
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        return torch.export.export(scoring, example.args(), dynamic_shapes=({0: batch}, ids, bags))


def manifest(model: ModelConfig, precision: TablePrecision, id_layout: IdLayout,
             checkpoint: dict[str, Any], int8_kernel: Int8Kernel = Int8Kernel.torch) -> dict[str, Any]:
    """What an artifact says about itself: the model config, its inputs, tables and source checkpoint."""
    feats = sparse_features(model)
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "model": json.loads(json.dumps(dataclasses.asdict(model), default=str)),
        "precision": str(precision), "id_layout": str(id_layout),
        # fbgemm: torch's quantized CPU op, no other device runs it
        "int8_kernel": str(int8_kernel) if precision == TablePrecision.int8 else None,
        "inputs": {"dense": f"float32 [batch, {model.num_dense_features}]",
                   "ids": "one int64 tensor per feature, in `features` order",
                   "bags": ("one int64 tensor of batch + 1 offsets per feature"
                            if id_layout == IdLayout.offsets
                            else "one int64 tensor of batch lengths per feature")},
        "output": "float32 [batch] logits (sigmoid: click probability)",
        "features": [{"name": f.name, "table": f.table, "rows": f.num_rows,
                      "ids_per_sample": f.ids_per_sample}
                     for f in feats],
        "table_bytes": table_bytes(sum(f.num_rows for f in feats), model.embedding_dim, precision),
        "checkpoint": checkpoint,
        "torch_version": torch.__version__, "anyrec_version": anyrec.__version__,
    }


def save_artifact(program: torch.export.ExportedProgram, info: dict[str, Any], path: str | Path) -> None:
    """Write the program and its manifest to `path`, whole or not at all, never through a link."""
    writable_file(path, "export.output")
    with atomic_write(path, "wb") as f:
        torch.export.save(program, f, extra_files={MANIFEST: json.dumps(info, indent=1)})


@dataclass
class Artifact:
    """A loaded artifact: the program as `torch.export` makes it a module (each call's inputs checked by
    torch.export), the same program called as its graph (`ScoringProgram`, what anyrec-predict scores
    with), and its manifest."""

    program: torch.nn.Module
    scorer: ScoringProgram
    manifest: dict[str, Any]
    path: Path

    @property
    def model(self) -> ModelConfig:
        """The model config it was exported from."""
        return model_config(self.manifest["model"])

    @property
    def id_layout(self) -> IdLayout:
        return IdLayout(self.manifest["id_layout"])


def model_config(raw: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a manifest's `model` entry (fields it lacks keep their defaults)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in raw.items() if k in known})


def _refuse_pickles(zf: zipfile.ZipFile, what: str) -> None:
    """ValueError when the archive holds anything `torch.export.load` would unpickle unrestricted."""
    for name in zf.namelist():
        if name.endswith(("_weights_config.json", "_constants_config.json")):
            config = load_json(name, f"{what}: {name}", _MAX_CONFIG_BYTES,
                               text=_read(zf, name, _MAX_CONFIG_BYTES))
            entries = config.get("config", {}) if isinstance(config, dict) else None
            if not isinstance(entries, dict):
                raise ValueError(f"{what}: {name} is not a weights index")
            for key, entry in entries.items():
                pickled = not isinstance(entry, dict) or entry.get("use_pickle") is not False
                if pickled or not str(entry.get("path_name", "")).startswith(("weight_", "tensor_")):
                    raise ValueError(f"{what}: {key} is stored as a pickled object; an anyrec artifact "
                                     "holds plain tensors only (a forged file?)")
        elif "/sample_inputs/" in name:
            try:
                torch.load(io.BytesIO(zf.read(name)), weights_only=True)
            except Exception as e:  # noqa: BLE001 - whatever a damaged or forged pickle raises
                raise ValueError(f"{what}: its sample inputs are not plain tensors ({type(e).__name__}); "
                                 "refused unloaded (a forged file?)") from None


def _read(zf: zipfile.ZipFile, name: str, max_bytes: int) -> str:
    if zf.getinfo(name).file_size > max_bytes:
        raise ValueError(f"{name}: larger than {max_bytes} bytes, refused unread")
    return zf.read(name).decode("utf-8", errors="replace")


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of artifact `path`, checked (format, version, model), without loading the program;
    ValueError in one line for anything that is not an anyrec artifact."""
    what = f"predict.artifact {path}"
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what}: no such file")
    if not zipfile.is_zipfile(p):
        raise ValueError(f"{what}: not a torch.export archive (.pt2)")
    with zipfile.ZipFile(p) as zf:
        names = [n for n in zf.namelist() if n.endswith(f"/extra/{MANIFEST}")]
        if len(names) != 1:
            raise ValueError(f"{what}: no anyrec manifest inside (not written by anyrec-export)")
        info = load_json(names[0], f"{what}: manifest", MAX_MANIFEST_BYTES,
                         text=_read(zf, names[0], MAX_MANIFEST_BYTES))
        if not isinstance(info, dict) or info.get("format") != FORMAT:
            raise ValueError(f"{what}: the manifest is not an anyrec scoring manifest")
        if info.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{what}: manifest version {info.get('format_version')!r}, this anyrec reads "
                             f"version {FORMAT_VERSION}")
        try:
            model = model_config(info["model"])
            sparse_features(model)
            TablePrecision(info["precision"]), IdLayout(info["id_layout"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{what}: the manifest is incomplete or malformed ({e})") from None
        _refuse_pickles(zf, what)
    return info


def load_artifact(path: str | Path) -> Artifact:
    """An artifact checked (`read_manifest`) then loaded; ValueError in one line if it cannot be."""
    info = read_manifest(path)
    try:
        exported = torch.export.load(str(path))
        program = exported.module()
    except Exception as e:  # noqa: BLE001 - a damaged archive raises whatever its bytes trigger
        raise ValueError(f"predict.artifact {path}: the program cannot be loaded "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
    model = model_config(info["model"])
    try:
        scorer = ScoringProgram(exported, len(sparse_features(model)), model.num_dense_features,
                                IdLayout(info["id_layout"]))
    except ValueError as e:
        raise ValueError(f"predict.artifact {path}: {e}") from None
    return Artifact(program, scorer, info, Path(path))

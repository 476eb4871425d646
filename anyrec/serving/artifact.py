"""The scoring artifact: a `torch.export` program (`.pt2`) with its manifest inside (`extra/manifest.json`).

Loading it needs torch only:

    files = {"manifest.json": ""}
    program = torch.export.load("model.pt2", extra_files=files).module()
    logits_B = program(dense_BI, ids, bags)  # DLRM: ids, bags one tensor per feature (see the manifest)
    logits_G = program(ids, bags, actions_T, timestamps_T, num_targets_B)  # DLRMv4 (jagged)

What a family's program takes, holds and checks is its export signature (anyrec.models.scoring).

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
from torch.fx.experimental import _config as fx_config

import anyrec
from anyrec.config import Int8Kernel, ModelConfig
from anyrec.io_checks import atomic_write, writable_file
from anyrec.models.family import ModelFamily, resolve_family
from anyrec.models.scoring import flat_inputs
from anyrec.safe_load import load_json
from anyrec.serving.model import IdLayout, TablePrecision, table_bytes
from anyrec.serving.program import ScoringProgram

MANIFEST = "manifest.json"
FORMAT = "anyrec-scoring"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 2**20
_MAX_CONFIG_BYTES = 64 * 2**20  # a weights/constants index: a few hundred bytes per tensor


def export_program(scoring: torch.nn.Module, family: ModelFamily, model: ModelConfig,
                   id_layout: IdLayout) -> torch.export.ExportedProgram:
    """`scoring` (the family's scoring module of `model`) traced by `torch.export` on the family's example
    call, with its dynamic dims (the batch, and each feature's id count or the sequence positions)."""
    export = family.export_signature()
    scoring = scoring.eval().requires_grad_(False)  # a scoring call builds no autograd graph
    # size-oblivious: a batch of 1 or a feature without ids runs the same graph (no 0/1 specialisation)
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        return torch.export.export(scoring, export.example(model, id_layout),
                                   dynamic_shapes=export.dynamic_shapes(model, id_layout))


def model_table_bytes(family: ModelFamily, model: ModelConfig, precision: TablePrecision) -> int:
    """Bytes of `model`'s tables at `precision`."""
    return sum(table_bytes(rows, dim, precision) for rows, dim in family.table_shapes(model).values())


def manifest(model: ModelConfig, family: ModelFamily, precision: TablePrecision, id_layout: IdLayout,
             checkpoint: dict[str, Any], int8_kernel: Int8Kernel = Int8Kernel.torch) -> dict[str, Any]:
    """What an artifact says about itself: the model config, its inputs (the family's), tables and source
    checkpoint."""
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "model": json.loads(json.dumps(dataclasses.asdict(model), default=str)),
        "precision": str(precision), "id_layout": str(id_layout),
        # fbgemm: torch's quantized CPU op, no other device runs it
        "int8_kernel": str(int8_kernel) if precision == TablePrecision.int8 else None,
        **family.export_signature().describe(model, id_layout),
        "table_bytes": model_table_bytes(family, model, precision),
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
            resolve_family(model).export_signature().describe(model, IdLayout(info["id_layout"]))
            TablePrecision(info["precision"])
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
    model, layout = model_config(info["model"]), IdLayout(info["id_layout"])
    export = resolve_family(model).export_signature()
    try:
        scorer = ScoringProgram(exported, len(flat_inputs(export.example(model, layout))),
                                export.check(model, layout))
    except ValueError as e:
        raise ValueError(f"predict.artifact {path}: {e}") from None
    return Artifact(program, scorer, info, Path(path))

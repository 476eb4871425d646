"""`anyrec-export` / `python -m anyrec.export`: a checkpoint to one self-contained scoring artifact.

    anyrec-export model=dlrm_small export.checkpoint=ckpt/ export.output=model.pt2 export.precision=int8
    anyrec-export model=dlrmv4_small export.checkpoint=ckpt/ export.output=v4.pt2

The checkpoint may come from any world size and sharding plan; the model is rebuilt unsharded from the
run's model overrides, checked against the checkpoint and loaded, its tables stored at `export.precision`,
and its family's scoring module (its export signature, anyrec.models.scoring) traced by `torch.export`
into a `.pt2` file that loads with torch alone (anyrec.serving.artifact)."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from anyrec import _hydra
from anyrec.config import AnyrecConfig, check_values
from anyrec.io_checks import writable_file
from anyrec.models.family import resolve_family
from anyrec.signing import resolve_key

logger = logging.getLogger("anyrec.export")


def run(cfg: AnyrecConfig, host_bytes: int | None = None,
        print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Export `cfg.export.checkpoint` to `cfg.export.output`; returns (and prints, last) the manifest.
    ValueError in one line for a missing option, a checkpoint of another model, a damaged one, or tables
    larger than this host's memory (`host_bytes`, default: this host's), before anything is written."""
    from anyrec.serving.artifact import export_program, manifest, save_artifact  # torch.export loads late
    from anyrec.serving.model import TableStages, resolve_int8_kernel  # late: after the command line
    from anyrec.serving.weights import (  # late: after the command line
        check_fits,
        export_memory_bytes,
        host_memory_bytes,
        load_checkpoint,
    )

    check_values(cfg)
    ec = cfg.export
    for key in ("checkpoint", "output"):
        if not getattr(ec, key):
            raise ValueError(f"export.{key}: a value is required; set it on the command line, e.g. "
                             f"export.{key}=...")
    writable_file(ec.output, "export.output")
    family = resolve_family(cfg.model)  # once, here
    export = family.export_signature()
    check_fits(export_memory_bytes(cfg.model, family, ec.precision), f"exporting model {cfg.model.name} at "
               f"{ec.precision}", host_memory_bytes() if host_bytes is None else host_bytes)
    loaded = load_checkpoint(Path(ec.checkpoint), cfg.model, family,
                             resolve_key(cfg.trainer.signing_key_file))
    logger.info("checkpoint %s: step %d, written by %s rank(s)", loaded.path, loaded.step,
                loaded.world_size or "?")
    kernel = resolve_int8_kernel(ec.int8_kernel)  # kept for every precision: the manifest says it
    scoring = export.build(loaded.model, TableStages(ec.precision, ec.id_layout, kernel))
    program = export_program(scoring, family, cfg.model, ec.id_layout)
    source = {"path": str(loaded.path.resolve()), "step": loaded.step, "sha256": loaded.sha256,
              "world_size": loaded.world_size, "lineage": loaded.lineage}
    info = manifest(cfg.model, family, ec.precision, ec.id_layout, source, kernel)
    save_artifact(program, info, ec.output)
    logger.info("wrote %s (%s tables, %.1f MiB)", ec.output, ec.precision, info["table_bytes"] / 2**20)
    sys.stdout.flush()
    print_fn(json.dumps({"artifact": str(Path(ec.output).resolve()), **info}))
    return info


def main(cfg: DictConfig) -> None:
    """Export a composed config; user mistakes and bad checkpoints: one line, exit status 2."""
    _hydra.run_typed("anyrec-export", run, cfg)


def cli() -> None:
    """Console entry: the job under Hydra's runner (`_hydra.launch`), one line and exit 2 for a mistake."""
    _hydra.launch("anyrec-export", main)


if __name__ == "__main__":
    cli()

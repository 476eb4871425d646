"""`anyrec-train` / `torchrun ... -m anyrec.train`: train a model from Hydra config groups."""

from __future__ import annotations

import json
import logging
import sys

import hydra
from omegaconf import DictConfig

from anyrec import _hydra
from anyrec.config import config_dir, to_object

logger = logging.getLogger("anyrec.train")


def run(cfg: DictConfig) -> dict:
    """Train with a composed config; rank 0 prints the JSON summary as its last stdout line."""
    from anyrec.trainer.trainer import Trainer

    _hydra.quiet_non_main_ranks()
    trainer = Trainer(to_object(cfg))
    try:
        summary = trainer.train()
        is_main = trainer.dist.is_main
    finally:
        trainer.close()
    if is_main:
        sys.stdout.flush()
        print(json.dumps(summary), flush=True)
    return summary


_hydra.setup()


@hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except ValueError as e:  # a user mistake: one line, non-zero exit
        print(f"anyrec-train: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()

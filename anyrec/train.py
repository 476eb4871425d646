"""`anyrec-train` / `torchrun ... -m anyrec.train`: train a model from Hydra config groups."""

from __future__ import annotations

import json
import logging
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from anyrec import _hydra
from anyrec.backends import rewrite_hardware_argv
from anyrec.config import config_dir, to_object
from anyrec.trainer.errors import NonFiniteLossError

logger = logging.getLogger("anyrec.train")


def run(cfg: DictConfig) -> dict:
    """Train with a composed config; rank 0 prints the JSON summary as its last stdout line."""
    from anyrec.trainer.trainer import Trainer  # torchrec loads once Hydra has parsed the command line

    _hydra.quiet_non_main_ranks()
    config = to_object(cfg)
    if config.trainer.run_dir is None and HydraConfig.initialized():
        config.trainer.run_dir = HydraConfig.get().runtime.output_dir
    trainer = Trainer(config)
    try:
        summary = trainer.train()
        is_main = trainer.dist.is_main
    except BaseException as e:
        # An error only this rank saw (bad data where it read it) leaves its peers inside a
        # collective, where close()'s barrier would wait for them: exit now, the launcher stops them.
        if not getattr(e, "rank_local", False):
            trainer.close()
        raise
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
    except (ValueError, NonFiniteLossError) as e:
        # A user mistake, bad data, a bad checkpoint or a diverged run: every rank raises the same
        # error at the same point; rank 0 says it in one line, all exit non-zero. Bad rows found
        # where they were read are seen by the reading rank alone, which says it itself.
        if os.environ.get("RANK", "0") == "0" or getattr(e, "rank_local", False):
            print(f"anyrec-train: error: {e}", file=sys.stderr, flush=True)
        else:
            logger.error("%s", e)
        sys.exit(3 if isinstance(e, NonFiniteLossError) else 2)


def cli() -> None:
    """Console entry: `hardware=FILE.yaml` is accepted as well as `hardware.sku=FILE.yaml`."""
    sys.argv = rewrite_hardware_argv(sys.argv)
    main()


if __name__ == "__main__":
    cli()

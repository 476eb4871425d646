"""Hydra plumbing shared by the entry points: schema registration, resolvers, rank-aware logging."""

from __future__ import annotations

import logging
import os

from omegaconf import OmegaConf

from anyrec.config import register_configs


def _rank0_only(value: str) -> str | None:
    """`${anyrec_rank0:x}` is x on rank 0 and null elsewhere (e.g. only rank 0 writes .hydra/)."""
    return value if os.environ.get("RANK", "0") == "0" else None


def setup() -> None:
    """Idempotent: register the config schema and anyrec's resolvers."""
    # FBGEMM logs every library it loads at INFO on the root logger; load it before Hydra turns
    # INFO logging on, so the console shows anyrec's messages only.
    import torchrec  # noqa: F401

    register_configs()
    if not OmegaConf.has_resolver("anyrec_rank0"):
        OmegaConf.register_new_resolver("anyrec_rank0", _rank0_only)


def quiet_non_main_ranks() -> None:
    """Only rank 0 logs to the console; every rank still writes its own log file."""
    if os.environ.get("RANK", "0") == "0":
        return
    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler:
            handler.setLevel(logging.WARNING)

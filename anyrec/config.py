"""Structured config schemas (Hydra ConfigStore) and where the YAML config groups live.

Library code takes these dataclasses (or plain values); `DictConfig` stops at the entry points.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


def config_dir() -> Path:
    """The Hydra config groups: shipped inside the package when installed, else the repo's `configs/`."""
    installed = Path(__file__).resolve().parent / "configs"
    if (installed / "config.yaml").is_file():
        return installed
    repo = Path(__file__).resolve().parent.parent / "configs"
    if (repo / "config.yaml").is_file():
        return repo
    raise FileNotFoundError(f"anyrec config groups not found in {installed} or {repo}")


@dataclass
class ModelConfig:
    """A DLRM-family model: tables, MLPs and the interaction."""

    name: str = MISSING
    interaction: str = "dot"  # dot | dcn
    embedding_dim: int = 16
    num_dense_features: int = 13
    table_rows: list[int] = field(default_factory=list)  # one table per sparse feature
    multi_hot: list[int] = field(default_factory=list)  # ids per sample per feature (empty: all 1)
    bottom_mlp: list[int] = field(default_factory=list)  # last width == embedding_dim for dot
    top_mlp: list[int] = field(default_factory=list)  # last width == 1
    dcn_num_layers: int = 3
    dcn_low_rank: int = 512


@dataclass
class DataConfig:
    """Where batches come from; `batch_size` is per rank."""

    name: str = "synthetic"
    batch_size: int = 256
    zipf_exponent: float = 1.05  # id popularity ~ 1/rank^s; 0 = uniform
    signal_scale: float = 2.5  # std of the hidden click logit: higher = more learnable
    id_range_scale: float = 1.0  # ids drawn from [0, scale * rows): > 1 makes out-of-range ids
    path: str | None = None  # dataset location for file-backed sources


@dataclass
class BackendConfig:
    """Which backend drives the run and which kernel serves each op."""

    name: str = "auto"  # auto | cpu | cuda | rocm | an installed plugin's name
    embedding_kernel: str = "auto"  # auto | fbgemm | triton | torch
    interaction_kernel: str = "auto"  # auto | triton | torch
    dcn_kernel: str = "auto"  # auto | triton | torch


@dataclass
class HardwareConfig:
    """The device the planner reasons about: `auto` (this one), a SKU name, or a YAML file.

    Resolve with `anyrec.backends.resolve_hardware(sku, spec)`. A calibrated YAML has this same
    shape, so it can also be a group option (`hardware=NAME` with its folder on Hydra's searchpath).
    """

    sku: str = "auto"  # auto | a SKU name | /path/to/hardware.yaml
    spec: dict[str, Any] = field(default_factory=dict)  # DeviceSpec field overrides
    measurements: dict[str, Any] = field(default_factory=dict)  # calibration extras (per kernel)


@dataclass
class PlannerConfig:
    """How embedding tables get their sharding."""

    name: str = "codesign"  # codesign | simple
    # auto, or force one of table_wise|row_wise|column_wise|table_row_wise|data_parallel
    sharding: str = "auto"
    allow_uvm: bool = True
    uvm_cache_ratio: float = 0.2
    memory_reserve_fraction: float = 0.1


@dataclass
class OptimConfig:
    """Embedding (fused) and dense optimizers."""

    name: str = "adagrad"  # sgd | adagrad | rowwise_adagrad | adam
    embedding_lr: float = 0.05
    dense_lr: float = 0.05
    eps: float = 1e-8
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0


@dataclass
class TrainerConfig:
    """The training loop."""

    steps: int = 300
    seed: int = 0
    eval_steps: int = 20  # batches per rank at the end; 0 = no evaluation
    log_every: int = 25
    progress: bool = True


@dataclass
class TopologyConfig:
    """The cluster shape the planner plans for (training uses the real one)."""

    world_size: int = 1
    local_world_size: int | None = None  # ranks per host; default: all on one host


@dataclass
class PlanConfig:
    """Options of `anyrec-plan`."""

    output: str | None = None  # JSON plan
    plot: str | None = None  # PNG picture
    compare: str | None = None  # a second SKU (or YAML) to plan side by side
    batch_size: int | None = None  # per rank; default: data.batch_size


@dataclass
class AnyrecConfig:
    """The whole job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


def register_configs() -> None:
    """Register the schema so every YAML group is type-checked against it."""
    cs = ConfigStore.instance()
    cs.store(name="anyrec_schema", node=AnyrecConfig)
    for group, node in [
        ("model", ModelConfig), ("data", DataConfig), ("backend", BackendConfig),
        ("hardware", HardwareConfig), ("planner", PlannerConfig), ("optim", OptimConfig),
        ("trainer", TrainerConfig),
    ]:
        cs.store(group=group, name=f"{group}_schema", node=node)


def to_object(cfg: Any) -> AnyrecConfig:
    """A typed `AnyrecConfig` from a composed DictConfig (validated by the schema)."""
    from omegaconf import OmegaConf

    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, AnyrecConfig):
        raise TypeError(f"config does not follow the anyrec schema: got {type(obj).__name__}")
    return obj

"""The data schema: how sparse features and their tables are named, and how many ids each sample has.

A model config lists one table per sparse feature. Data sources, models and the planner name features
and tables through this module, so none of them imports another for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from anyrec.config import ModelConfig, STURecompute, config_dir


def feature_names(num_tables: int) -> list[str]:
    """Sparse feature names, one per table, in KeyedJaggedTensor key order: `cat_<i>`."""
    return [f"cat_{i}" for i in range(num_tables)]


def table_name(feature: str) -> str:
    """The table that serves a sparse feature: `t_<feature>`."""
    return f"t_{feature}"


def ids_per_sample(model: ModelConfig) -> list[int]:
    """Ids per sample of each sparse feature (`multi_hot`; empty means one-hot), checked."""
    hot = list(model.multi_hot) or [1] * len(model.table_rows)
    if len(hot) != len(model.table_rows):
        raise ValueError(f"model {model.name}: multi_hot has {len(hot)} entries for "
                         f"{len(model.table_rows)} tables")
    if hot and min(hot) < 1:
        raise ValueError(f"model {model.name}: multi_hot must give >= 1 id for each of the "
                         f"{len(hot)} features")
    return hot


@dataclass(frozen=True)
class SparseFeature:
    """One sparse feature and the table that serves it."""

    name: str
    table: str
    num_rows: int
    ids_per_sample: int


def sparse_features(model: ModelConfig) -> list[SparseFeature]:
    """The model's sparse features in key order, with their tables; ValueError on a malformed config."""
    if not model.table_rows:
        raise ValueError(f"model {model.name}: table_rows is empty")
    if any(r < 1 for r in model.table_rows):
        raise ValueError(f"model {model.name}: every table needs at least one row")
    names = feature_names(len(model.table_rows))
    return [SparseFeature(f, table_name(f), rows, hot)
            for f, rows, hot in zip(names, model.table_rows, ids_per_sample(model), strict=True)]


def load_model_config(name: str, folder: Path | None = None) -> ModelConfig:
    """A shipped model config (`configs/model/<name>.yaml`) without composing a whole job; entries of
    its `defaults` list that name another model config are loaded first, as Hydra would."""
    folder = folder or config_dir() / "model"
    path = folder / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
        raise ValueError(f"unknown model config {name!r}; known: {known}")
    raw = OmegaConf.load(path)
    merged = OmegaConf.structured(ModelConfig)
    for entry in raw.pop("defaults", []):
        if isinstance(entry, str) and (folder / f"{entry}.yaml").is_file():
            merged = OmegaConf.merge(merged, OmegaConf.structured(load_model_config(entry, folder)))
    return OmegaConf.to_object(OmegaConf.merge(merged, raw))


@dataclass(frozen=True)
class HSTUShape:
    """An HSTU dense part's sizes as the planner costs it: at most `seq_len` tokens per sample through
    `num_layers` STU layers of width `model_dim` (`num_heads` heads of `qk_dim` query/key and `v_dim` U/V
    dims), the first `contextual` tokens of each sample contextual, `targets` candidates last;
    `preprocessor_in_dim`: the embedding values per position the preprocessor reads, `preprocessor_action_dim`
    its action MLP's input width, `preprocessor_hidden_dim` its MLPs' width; the dropout rates (a mask is
    kept where one is > 0). Sequences are jagged: `mean_seq_len` tokens per sample on average and
    `rms_seq_len` the root mean square of the lengths (the attention's pairs grow with its square); both
    None: every sample at `seq_len`, the bound. `longest_seq_len`: the longest sample the data gives (an
    implementation that pads a batch pads it to about this; None: `seq_len`). `stu_recompute`: what each
    STU layer's backward recomputes rather than keeps (none: it keeps every tensor its ops save)."""

    seq_len: int
    num_layers: int
    model_dim: int
    num_heads: int
    qk_dim: int
    v_dim: int
    contextual: int = 0
    targets: int = 1
    preprocessor_in_dim: int = 0
    preprocessor_hidden_dim: int = 0
    preprocessor_action_dim: int = 0
    input_dropout: float = 0.0
    stu_dropout: float = 0.0
    mean_seq_len: float | None = None
    rms_seq_len: float | None = None
    longest_seq_len: int | None = None
    stu_recompute: STURecompute = STURecompute.none

    def __post_init__(self) -> None:
        for name in ("seq_len", "num_layers", "model_dim", "num_heads", "qk_dim", "v_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"HSTU shape: {name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.contextual < self.seq_len:
            raise ValueError(f"HSTU shape: contextual must be in [0, seq_len), got {self.contextual}")
        if (self.mean_seq_len is None) != (self.rms_seq_len is None):
            raise ValueError("HSTU shape: give both mean_seq_len and rms_seq_len, or neither")
        mean, rms = self.mean_tokens, self.rms_tokens
        if not self.contextual + self.targets <= mean <= rms <= self.seq_len:
            raise ValueError(f"HSTU shape: need contextual + targets ({self.contextual + self.targets}) <= "
                             f"mean_seq_len ({mean:g}) <= rms_seq_len ({rms:g}) <= seq_len ({self.seq_len})")
        if not rms <= self.longest_tokens <= self.seq_len:
            raise ValueError(f"HSTU shape: need rms_seq_len ({rms:g}) <= longest_seq_len "
                             f"({self.longest_tokens:g}) <= seq_len ({self.seq_len})")

    @property
    def mean_tokens(self) -> float:
        """Mean tokens per sample (`seq_len` where the lengths are not given)."""
        return float(self.seq_len if self.mean_seq_len is None else self.mean_seq_len)

    @property
    def longest_tokens(self) -> int:
        """Tokens of the longest sample (`seq_len` where not given)."""
        return self.seq_len if self.longest_seq_len is None else int(self.longest_seq_len)

    @property
    def rms_tokens(self) -> float:
        """Root mean square of the tokens per sample (`seq_len` where the lengths are not given)."""
        return float(self.seq_len if self.rms_seq_len is None else self.rms_seq_len)



@dataclass(frozen=True)
class WorkloadFacts:
    """What the planner needs of a model besides its tables and dense parameters (which it reads from the
    model itself): ids each feature looks up per sample (pooled: its multi-hot count; sequence: its
    positions), and the dense part's per-sample pairwise interaction and fp32 activation bytes (see
    `PlanOptions`)."""

    lookups_per_sample: dict[str, float]  # feature -> ids per sample
    interaction_pairs: int = 0
    dense_lookup_bytes_per_sample: int = 0  # alive while the embeddings are looked up
    dense_activation_bytes_per_sample: int = 0  # alive at the end of the dense forward
    dense_gradient_bytes_per_sample: int = 0  # alive while the backward reaches the embeddings
    dense_features: int = 0  # dense inputs per sample
    dense_flops_per_sample: float = 0.0  # forward + backward; 0: 6 per dense parameter (the planner's rule)
    # an HSTU dense part (DLRMv4): the planner costs its STU layers' GEMMs, attention and activations
    # from these sizes (anyrec.planner.sequence), the rest of `dense_flops_per_sample` as GEMMs
    hstu: HSTUShape | None = None


@dataclass(frozen=True)
class BatchSchema:
    """What a model reads of a batch, as its input checks see it: the sparse features in key order, the
    rows of the table serving each, dense inputs per sample (pooled models), and whether the features
    are sequences (a jagged list of ids per sample, unpooled) or bags."""

    features: tuple[str, ...]
    table_rows: tuple[int, ...]
    num_dense: int = 0
    sequence: bool = False

"""A model family as one value: everything the trainer, the planner, calibration, parity and export need to
know of a kind of model, resolved once from the config (`model.family`) at the entry point and handed down.

A family builds its training module (the model and its loss: `forward(batch) -> (loss, (logits, labels))`)
with its tables on a chosen device (meta: DistributedModelParallel allocates the shards) and the backend's
implementation per op; says where its embedding collection sits in that module and whether it pools (a
torchrec EmbeddingBagCollection) or not (an EmbeddingCollection: one vector per sequence position); and
states its batch schema, the data sources it reads, what the planner needs beyond the tables, whether
torch.compile takes its dense part, its export signature (anyrec.models.scoring) and the check
`anyrec-parity` runs when given no variants (`ParityCheck`). DLRM (dot
interaction) and DLRMv2 (DCNv2) are one family, `dlrm`: the interaction is a field of their config; DLRMv4
(HSTU) is `dlrmv4`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from anyrec.backends.dispatch import Impl
from anyrec.config import ModelConfig
from anyrec.models import dlrm, dlrmv4
from anyrec.models.dlrm_scoring import DLRM_EXPORT
from anyrec.models.dlrmv4_scoring import DLRMV4_EXPORT
from anyrec.models.scoring import ExportSignature
from anyrec.schema import BatchSchema, WorkloadFacts

# (model config, dense device, table device, the backend's implementation per op) -> training module
BuildTrain = Callable[[ModelConfig, torch.device, torch.device, Mapping[str, Impl]], nn.Module]
# (model config, an embedding collection already built on the device, device, implementations) -> module
BuildAround = Callable[[ModelConfig, nn.Module, torch.device, Mapping[str, Impl]], nn.Module]


class UnknownFamilyError(ValueError):
    """`model.family` names no model family."""


@dataclass(frozen=True)
class ParityCheck:
    """A family's default `anyrec-parity` check, run when no `parity.variants` is given: overrides of the
    base job (each dropped where the command line sets its key) and the variants compared with the first,
    each in `parity.variants`' syntax (Hydra overrides, `nproc=N`, `NAME=VALUE` environment)."""

    # a short job: a few steps, a global batch that every world size splits alike. Each entry is one setting:
    # overrides that go together (space-separated), dropped whole where the command line sets any of its keys
    base: tuple[str, ...]
    variants: tuple[str, ...]


@dataclass(frozen=True)
class ModelFamily:
    """One kind of model, as every layer above the models sees it (see the module doc)."""

    name: str
    build_train: BuildTrain
    table_configs: Callable[[ModelConfig], list[BaseEmbeddingConfig]]
    sparse_path: str  # the embedding collection's path in the training module
    pooled: bool  # EmbeddingBagCollection (True) or EmbeddingCollection (sequence embeddings)
    batch_schema: Callable[[ModelConfig], BatchSchema]
    workload_facts: Callable[[ModelConfig], WorkloadFacts]
    data_sources: tuple[str, ...]  # the `data.name`s whose batches the model reads
    parity: ParityCheck  # what `anyrec-parity` checks when given no variants
    # around a single-device embedding collection (anyrec's TBE, no torchrec sharding); None: always sharded
    build_around: BuildAround | None = None
    compiles_dense: bool = False  # trainer.compile applies (anyrec.trainer.compile knows its dense step)
    # what a scoring artifact of a trained module holds and takes (anyrec-export, anyrec-predict); None: none
    export: ExportSignature | None = None

    @property
    def collection_key(self) -> str:
        """The state_dict key under the collection that holds the tables: `embedding_bags` | `embeddings`."""
        return "embedding_bags" if self.pooled else "embeddings"

    def sparse_module(self, train_module: nn.Module) -> nn.Module:
        """The embedding collection inside a training module (unwrapped, or as DistributedModelParallel
        wraps it)."""
        return train_module.get_submodule(self.sparse_path)

    def table_shapes(self, cfg: ModelConfig) -> dict[str, list[int]]:
        """Table name -> [rows, dim]: what a checkpoint's tables must match."""
        return {c.name: [c.num_embeddings, c.embedding_dim] for c in self.table_configs(cfg)}

    def export_signature(self) -> ExportSignature:
        """The family's export signature; ValueError in one line where the family exports none."""
        if self.export is None:
            raise ValueError(f"model.family={self.name} has no scoring artifact (anyrec-export)")
        return self.export

    def scoring_module(self, train_module: nn.Module) -> nn.Module:
        """What a scoring artifact of a trained module holds; ValueError where the family exports none."""
        return self.export_signature().part(train_module)

    def check_data(self, data_name: str) -> None:
        """ValueError (one line) when the model cannot read batches of the `data.name` source."""
        if data_name not in self.data_sources:
            raise ValueError(f"model.family={self.name} reads data={' | '.join(self.data_sources)}, "
                             f"not data={data_name}")


_SIMPLE = "planner.name=simple planner.sharding"

# DLRM and DLRMv2: 8 steps (global batch 64) on FBGEMM's TBE, one rank, against the torch TBE on one rank and
# FBGEMM's with every table row-wise on 2 ranks. The recipe: row-wise Adagrad for the tables (the state a
# plan shards with the rows) and SGD for the dense part. Adagrad's element-wise step, lr * g / (sqrt(m) +
# eps), turns the rounding of a gradient element that cancels to about zero into a visible change, so with
# it the world sizes differ by more than their arithmetic does (measured on dlrm_small on a 2-core CPU: the
# default exact Adagrad, 2.2e-3 on one table element; row-wise Adagrad with a dense Adagrad, 8.5e-6 on the
# dense weights; this recipe, 6e-8). Left out: the Triton TBE (a CPU runs it only under the Triton
# interpreter: slow; tests/test_kernels_triton_interpret.py checks it against a float64 reference); give
# it as a variant where it runs ("backend.embedding_kernel=triton", with TRITON_INTERPRET=1 on a CPU).
DLRM_PARITY = ParityCheck(
    base=("trainer.steps=8", "data.global_batch_size=64", "optim=rowwise_adagrad optim.dense_name=sgd"),
    variants=("backend.embedding_kernel=fbgemm", "backend.embedding_kernel=torch",
              f"backend.embedding_kernel=fbgemm {_SIMPLE}=row_wise nproc=2"),
)

# DLRMv4: 4 steps of the job (global batch 64, the torch attention) on one rank, the co-design plan, against
# - world size: 2 ranks under the co-design plan, with the same global batch;
# - plans: every table forced table-wise, then row-wise, on 2 ranks;
# - embedding kernels: the row-wise variant runs anyrec's torch TBE (backend.embedding_kernel=torch), the
#   others the backend's default (FBGEMM's where present), so kernel and plan are checked in 4 launches.
# Left out, and why:
# - column-wise: refused in one line under the recipe's row-wise Adagrad (its per-row accumulator would be
#   kept per column shard); it applies only with an element-wise optimizer;
# - data-parallel: torchrec's EmbeddingCollection fails on it on CPU (its output split sizes);
# - table-row-wise: torchrec's EmbeddingCollection sharder has no such type;
# - the Triton TBE: a CPU runs it only under the Triton interpreter (slow); its unpooled lookups are the
#   pooled kernels on a per-lookup view, checked against a float64 reference under the interpreter
#   (tests/test_kernels_triton_interpret.py);
# - the Triton attention: a CPU runs it only under the Triton interpreter, minutes for these 4 steps; its
#   float64 check against the torch version (tests/test_hstu_attention.py) covers it instead.
# Attention scores are divided by the configured max_seq_len, so a sample's output does not depend on the
# other samples of its batch: the losses agree across world sizes to float tolerance.
DLRMV4_PARITY = ParityCheck(
    base=("trainer.steps=4", "data.global_batch_size=64", "backend.attention_kernel=torch"),
    variants=("", "nproc=2", f"{_SIMPLE}=table_wise nproc=2",
              f"backend.embedding_kernel=torch {_SIMPLE}=row_wise nproc=2"),
)

DLRM_FAMILY = ModelFamily(
    name="dlrm",
    build_train=dlrm.build_train,
    table_configs=dlrm.table_configs,
    sparse_path="model.sparse_arch",
    pooled=True,
    batch_schema=dlrm.batch_schema,
    workload_facts=dlrm.workload_facts,
    data_sources=("synthetic", "criteo_tsv", "criteo_npy", "criteo_multihot"),
    parity=DLRM_PARITY,
    build_around=dlrm.build_train_around,
    compiles_dense=True,
    export=DLRM_EXPORT,
)

# DLRMv4 (MLPerf Training v6.1): HSTU over each user's history; sequence embeddings, streamed 1-day windows
DLRMV4_FAMILY = ModelFamily(
    name="dlrmv4",
    build_train=dlrmv4.build_train,
    table_configs=dlrmv4.table_configs,
    sparse_path="sparse_arch",
    pooled=False,
    batch_schema=dlrmv4.batch_schema,
    workload_facts=dlrmv4.workload_facts,
    data_sources=("yambda_synthetic", "yambda"),
    parity=DLRMV4_PARITY,
    export=DLRMV4_EXPORT,
)

FAMILIES: Mapping[str, ModelFamily] = {f.name: f for f in (DLRM_FAMILY, DLRMV4_FAMILY)}


def resolve_family(cfg: ModelConfig) -> ModelFamily:
    """The family `cfg.family` names (once, at the entry point); UnknownFamilyError in one line otherwise."""
    family = FAMILIES.get(cfg.family)
    if family is None:
        raise UnknownFamilyError(f"model.family={cfg.family!r} (model {cfg.name}): known families are "
                                 f"{', '.join(FAMILIES)}")
    return family

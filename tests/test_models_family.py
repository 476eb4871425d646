"""The model family value: resolved once from the config, DLRM's facts, and what the planner makes of a
family's unpooled (sequence) tables."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig

from anyrec.config import ModelConfig
from anyrec.models.dlrm import DLRMTrain
from anyrec.models.family import DLRM_FAMILY, UnknownFamilyError, resolve_family
from anyrec.planner.job import model_tables
from anyrec.schema import WorkloadFacts

TINY = ModelConfig(name="tiny", table_rows=[10, 20, 30], multi_hot=[1, 3, 2], embedding_dim=4,
                   bottom_mlp=[8, 4], top_mlp=[4, 1])


def test_the_family_named_by_the_config_is_resolved_and_an_unknown_one_is_one_line():
    assert resolve_family(TINY) is DLRM_FAMILY
    with pytest.raises(UnknownFamilyError) as e:
        resolve_family(dataclasses.replace(TINY, family="gpt"))
    assert str(e.value) == "model.family='gpt' (model tiny): known families are dlrm, dlrmv4"


def test_dlrm_builds_its_training_module_with_tables_where_asked():
    meta, cpu = torch.device("meta"), torch.device("cpu")
    train = DLRM_FAMILY.build_train(TINY, cpu, meta, {})
    assert isinstance(train, DLRMTrain)
    tables = DLRM_FAMILY.sparse_module(train)
    assert all(p.is_meta for p in tables.parameters())
    assert not any(p.is_meta for n, p in train.named_parameters() if "sparse_arch" not in n)
    assert DLRM_FAMILY.table_shapes(TINY) == {"t_cat_0": [10, 4], "t_cat_1": [20, 4], "t_cat_2": [30, 4]}
    assert DLRM_FAMILY.scoring_module(train) is train.model


def test_dlrm_states_its_lookups_and_batch_schema():
    facts = DLRM_FAMILY.workload_facts(TINY)
    assert facts.lookups_per_sample == {"cat_0": 1.0, "cat_1": 3.0, "cat_2": 2.0}
    assert facts.interaction_pairs == 4**2 and facts.dense_features == 13
    schema = DLRM_FAMILY.batch_schema(TINY)
    assert schema.features == ("cat_0", "cat_1", "cat_2") and schema.table_rows == (10, 20, 30)
    assert not schema.sequence and schema.num_dense == 13


def test_a_family_refuses_data_it_cannot_read():
    DLRM_FAMILY.check_data("criteo_npy")
    with pytest.raises(ValueError, match="model.family=dlrm reads data=synthetic"):
        DLRM_FAMILY.check_data("yambda")


def test_an_unpooled_table_outputs_a_vector_per_id():
    facts = WorkloadFacts({"seq": 50.0, "bag": 50.0})
    pooled, seq = model_tables(
        [EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=100, feature_names=["bag"]),
         EmbeddingConfig(name="s", embedding_dim=8, num_embeddings=100, feature_names=["seq"])], facts)
    assert not pooled.sequence and pooled.bags_per_sample == 1
    assert seq.sequence and seq.bags_per_sample == 50.0 and seq.pooling_factor == 50.0

"""Every torch / torchrec / FBGEMM / OmegaConf internal anyrec relies on, listed once and pinned.

An internal is a private name (`_`-prefixed, or under a `_`-prefixed module) or a behaviour a library does
not promise (a method body anyrec reproduces or overrides, a counter it reads). Each `Pin` names the library
object whose source carries what anyrec relies on, the names anyrec's code uses, the files that use them,
the library version it was read from and the sha256 of `inspect.getsource` of that object (None where the
object has no Python source: such a pin holds for the version it was read from only). `problems()` says in
one line per pin what changed; tests/test_internals.py runs it against the installed libraries and checks
that anyrec uses no private library name this list lacks. After a library upgrade: read what changed in
each failing pin's object, adapt the file that relies on it, then update its sha256 and version here.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass
from typing import Any

# Distribution names per library (the first installed one counts): FBGEMM ships CPU and GPU wheels.
DISTRIBUTIONS = {"torch": ("torch",), "torchrec": ("torchrec",),
                 "fbgemm_gpu": ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly"),
                 "omegaconf": ("omegaconf",)}


@dataclass(frozen=True)
class Pin:
    """One library object anyrec relies on: `target` ("module:qualname", or a module), the internal
    `names` anyrec's code uses through it, what anyrec relies on, the files that rely on it, the library
    version it was read from and the sha256 of its source (None: no Python source)."""

    target: str
    names: tuple[str, ...]
    relied_on: str
    used_in: tuple[str, ...]
    version: str
    sha256: str | None

    @property
    def library(self) -> str:
        return self.target.split(".")[0].split(":")[0]


def installed_version(library: str) -> str:
    """The installed version of `library` ("none" where it is not installed)."""
    for dist in DISTRIBUTIONS[library]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


def resolve(target: str) -> Any:
    """The object `target` names: "module:qualname" (attributes after the colon) or a module."""
    module, _, attrs = target.partition(":")
    return functools.reduce(getattr, attrs.split(".") if attrs else [], importlib.import_module(module))


def source_sha256(obj: Any) -> str | None:
    """The sha256 of `obj`'s Python source, or None where it has none (a C function)."""
    try:
        source = inspect.getsource(obj)
    except (TypeError, OSError):
        return None
    return hashlib.sha256(source.encode()).hexdigest()


def problem(pin: Pin) -> str | None:
    """One line naming the internal and the files relying on it when the installed library no longer
    matches `pin` (gone, or its source changed; without source, another version); None when it does."""
    where = f"{pin.target} (relied on by {', '.join(pin.used_in)}: {pin.relied_on})"
    installed = f"{pin.library} {installed_version(pin.library)}"
    try:
        obj = resolve(pin.target)
    except (ImportError, AttributeError) as e:
        return f"{where} is gone in {installed} ({type(e).__name__}: {e}); read against {pin.version}"
    digest = source_sha256(obj)
    if pin.sha256 is None:
        if installed != pin.version:
            return f"{where} has no Python source and was read against {pin.version}, not {installed}"
        return None
    if digest != pin.sha256:
        return (f"{where} changed: source sha256 {digest} in {installed}, pinned {pin.sha256} "
                f"(read against {pin.version})")
    return None


def problems(pins: tuple[Pin, ...] | None = None) -> list[str]:
    """What no longer matches, one line per pin (PINS by default)."""
    return [p for pin in (PINS if pins is None else pins) if (p := problem(pin)) is not None]


TORCH = "torch 2.13.0+cpu"
TORCHREC = "torchrec 1.9.2"
FBGEMM = "fbgemm_gpu 1.8.0"
OMEGACONF = "omegaconf 2.3.1"
_DMP = "torchrec.distributed.model_parallel:DMPCollection"
_SEBC = "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection"
_PIPELINE = "torchrec.distributed.train_pipeline.train_pipelines:TrainPipelineSparseDist"
_FS = "torch.distributed.checkpoint.filesystem"
_TWOD = ("anyrec/trainer/twod.py",)
_KERNEL = ("anyrec/kernels/torchrec_kernel.py",)
_SEQ = ("anyrec/kernels/torchrec_sequence.py",)
_DCP = ("anyrec/trainer/dcp_reader.py",)
_GLUE = "TwoDModelParallel.__init__ reproduces DMPCollection.__init__'s body and calls its helpers"

PINS: tuple[Pin, ...] = (
    # 2D sparse parallelism: torchrec's DMPCollection, built without its device assert
    Pin(f"{_DMP}.__init__", (), _GLUE, _TWOD, TORCHREC,
        "a154978201b1ced921752fcee4fb2b3839853e9aee67bdce5eb9cb0e1a45d14d"),
    Pin(f"{_DMP}._create_process_groups", ("_create_process_groups",), _GLUE, _TWOD, TORCHREC,
        "4a896ddb4b96948bdbf01a372964eb392159a13efb50db2c7e51d4bd5c00e1a7"),
    Pin(f"{_DMP}._remap_sharding_plan", ("_remap_sharding_plan",), _GLUE, _TWOD, TORCHREC,
        "193ce0d8360814ecba71f8a3da832041cbe97e30ea4819cd87d4d5ecf0ede4db"),
    Pin(f"{_DMP}._group_sharded_modules", ("_group_sharded_modules",), _GLUE, _TWOD, TORCHREC,
        "86e8f07888f0aa5a469cf2742ce09c3211f982f60cfa21a7147df2db984f0316"),
    Pin(f"{_DMP}._cache_sync_tensors", ("_cache_sync_tensors",), _GLUE, _TWOD, TORCHREC,
        "74d80ce2d70b5ec330d61845c9edf167f030b4aeb23b3d1e8557c1b3614a6563"),
    Pin(f"{_DMP}._sync", ("_sync",), "sync() averages the replicas' weights and optimizer state", _TWOD,
        TORCHREC, "cfbb55e7cc999715a8d1a8d6c37afad12d57d266779af267566712245ee26479"),
    Pin(f"{_SEBC}._create_lookups", ("_lookups",),
        "a sharded collection keeps its lookups in a plain list `_lookups`",
        ("anyrec/trainer/twod.py", "anyrec/kernels/torchrec_kernel.py"), TORCHREC,
        "230d0dce87a93d48d4afa3ef14161927b04474fbe31bff4d6b2243dfcbc4b0e9"),
    # the Triton-aware sharder: torchrec's sharding classes with another lookup and kernel
    Pin(f"{_SEBC}.__init__", ("_embedding_shardings", "_env", "_skip_data_parallel_grad_sync"),
        "the collection's shardings, env and DP switch, and that __init__ calls init_data_parallel",
        _KERNEL, TORCHREC,
        "b279f8c3c931407fe5125835cefc4503cf3247748541c8145356233a7327e93a"),
    Pin(f"{_SEBC}.init_data_parallel", (),
        "TritonShardedEmbeddingBagCollection.init_data_parallel is its body with DDP's static_graph",
        _KERNEL, TORCHREC,
        "28bfaaa95687d001e5fcb56b9b5cf496d5ca4e2cac025f059926d6efda5596ff"),
    Pin("torchrec.distributed.embeddingbag:EmbeddingBagCollectionSharder.shard",
        ("_sharded_module_order_overwrite",), "TritonEmbeddingBagCollectionSharder.shard is its body",
        _KERNEL, TORCHREC,
        "47fb4b8f1b9316a26e58a05d1478b0f07bf03daf79a81177e99300cc53fe8abc"),
    Pin("torchrec.distributed.batched_embedding_kernel:BaseBatchedEmbeddingBag.__init__",
        ("_config", "_local_rows", "_local_cols", "_feature_table_map", "_pooling"),
        "the kernel's config, local shard shapes, feature-table map and pooling, set before the TBE",
        _KERNEL, TORCHREC,
        "bf992962f93c2ec7930edbb1c7bb79812ade69f7a238be1aa26ff6f6a080e772"),
    Pin("torchrec.distributed.batched_embedding_kernel:_gen_named_parameters_by_table_dense",
        ("_gen_named_parameters_by_table_dense",), "the dense kernel's per-table parameters", _KERNEL,
        TORCHREC,
        "9f7dcf9f874c9860835e80758c47839621b4bf0e3695a96c95bd38b0d0e24515"),
    Pin("torchrec.distributed.embedding_lookup:GroupedPooledEmbeddingsLookup._create_embedding_kernel",
        ("_create_embedding_kernel",), "the lookup builds each group's kernel here (overridden)", _KERNEL,
        TORCHREC,
        "1e5e74a55cbdbd082360efc8b75f68c65d39eb3847dc945591742764095b2a80"),
    Pin("torchrec.distributed.sharding.tw_sharding:BaseTwEmbeddingSharding.__init__",
        ("_grouped_embedding_configs",), "create_lookup's inputs: the grouped configs, pg, device, env",
        _KERNEL, TORCHREC,
        "49f8e35b6840645bb238481b0e1fa9f1bddf921f6688f33390d1931a1706190f"),
    Pin("torchrec.distributed.sharding.tw_sharding:TwPooledEmbeddingSharding.create_lookup", (),
        "_TritonLookupMixin.create_lookup is its body with the Triton-aware lookup", _KERNEL, TORCHREC,
        "306914f8d7f569de120b3e9524d9b3cd5a5cd40d90a9f2920b3f4e892796cfc7"),
    Pin("torchrec.distributed.sharding.rw_sharding:BaseRwEmbeddingSharding.__init__",
        ("_grouped_embedding_configs",), "create_lookup's inputs", _KERNEL, TORCHREC,
        "d9bd02484c8d406196210bec47fadc148afdc7239f33a8d7b99932b98b1195b1"),
    Pin("torchrec.distributed.sharding.twrw_sharding:BaseTwRwEmbeddingSharding.__init__",
        ("_grouped_embedding_configs_per_rank",), "create_lookup's inputs: this rank's grouped configs",
        _KERNEL, TORCHREC,
        "1a4c443351724398935d542784b236fed3e2f5bb1af48cd32f8cd94bdb4ec092"),
    Pin("torchrec.distributed.sharding.dp_sharding:DpPooledEmbeddingSharding.create_lookup", (),
        "TorchDpPooledEmbeddingSharding.create_lookup is its body with the dense torch kernel", _KERNEL,
        TORCHREC,
        "2a9e5a79a0599683d0cd8b3eeddc722fc725652ed24b6cbf0037376881fe09bf"),
    # the sequence sharder: torchrec's sequence shardings with another lookup and kernel
    Pin("torchrec.distributed.batched_embedding_kernel:BaseBatchedEmbedding.__init__",
        ("_local_rows", "_local_cols", "_feature_table_map"),
        "the sequence kernel's local shard shapes and feature-table map, set before the TBE", _SEQ, TORCHREC,
        "95482d0f9de566d1c35fb9b3f1e928e129006ab658f8ce755da91fb94c897c21"),
    Pin("torchrec.distributed.batched_embedding_kernel:TritonBatchedFusedEmbeddingBag", ("_param_per_table",),
        "TritonFusedEmbedding borrows its plumbing methods, which read only the TBE and the config", _SEQ,
        TORCHREC, "0f5f3daa29f3e183af98e3ce4ad27202d9be24f9e5569252179be882c3d90951"),
    Pin("torchrec.distributed.embedding_lookup:GroupedEmbeddingsLookup._create_embedding_kernel",
        ("_create_embedding_kernel",), "the sequence lookup builds each group's kernel here (overridden)",
        _SEQ, TORCHREC, "d8c8198e252b9917653e0d20163e7f2003bd3140d3ffd00ab0e1a4a950a1c7b4"),
    Pin("torchrec.distributed.sharding.tw_sequence_sharding:TwSequenceEmbeddingSharding.create_lookup",
        ("_grouped_embedding_configs", "_env"),
        "_SequenceLookupMixin.create_lookup is its body with the Triton-aware lookup", _SEQ, TORCHREC,
        "a8fa77a9ca0cd3f2af712f1db5dbf2a8a84209752086e4a4adb455ecaaffc313"),
    Pin("torchrec.distributed.sharding.rw_sequence_sharding:RwSequenceEmbeddingSharding.create_lookup",
        ("_grouped_embedding_configs", "_env"),
        "_SequenceLookupMixin.create_lookup is its body with the Triton-aware lookup", _SEQ, TORCHREC,
        "69959f1b0a0ccc7a922c020d9535fa8d7f63e0efa7c9149fda9868fbf2fdb437"),
    Pin("torchrec.distributed.sharding.cw_sequence_sharding:CwSequenceEmbeddingSharding.create_lookup",
        ("_grouped_embedding_configs", "_env"),
        "_SequenceLookupMixin.create_lookup is its body with the Triton-aware lookup", _SEQ, TORCHREC,
        "a8fa77a9ca0cd3f2af712f1db5dbf2a8a84209752086e4a4adb455ecaaffc313"),
    Pin("torchrec.distributed.embedding:EmbeddingCollectionSharder.shard", ("_use_index_dedup",),
        "TritonEmbeddingCollectionSharder.shard is its body", _SEQ, TORCHREC,
        "effa8e15a2090127f68e46fe82c9aff5c5b878e984c73c9c78240b29bc74601c"),
    Pin("torchrec.distributed.embedding:ShardedEmbeddingCollection.create_embedding_sharding", (),
        "TritonShardedEmbeddingCollection.create_embedding_sharding is its body with the Triton-aware "
        "shardings", _SEQ, TORCHREC, "128dfb20c9c1bcae6a5e23409706ba77095ac46318cdf11e9f4b3b4278c6ac87"),
    # the train pipeline's hooks
    Pin(f"{_PIPELINE}.progress", (), "progress calls _backward and _optimizer_step once per training step",
        ("anyrec/trainer/pipeline.py",), TORCHREC,
        "81400c3d3173fc6332d23c74d2ebdcecdeb6b2cf4e5e182333d44c1c2a8d10d0"),
    Pin(f"{_PIPELINE}._backward", ("_backward",), "the pipeline's backward hook (overridden)",
        ("anyrec/trainer/pipeline.py",), TORCHREC,
        "2621b5b24ea3aea1e480977686cfb81e02fca8bcb32bb2afc77e573a81e928c1"),
    Pin(f"{_PIPELINE}._optimizer_step", ("_optimizer_step",), "the pipeline's optimizer hook (overridden)",
        ("anyrec/trainer/pipeline.py",), TORCHREC,
        "7f5249f4b6dfad4ba86941b3ff22ee664c37b220a5a7f44f63a080cb8011161b"),
    Pin(f"{_PIPELINE}.__init__", ("_model",), "the pipeline keeps its model as `_model`",
        ("anyrec/trainer/pipeline.py",), TORCHREC,
        "7a923ff8bb79feff6b2b6da752eb0401c4bac3c560eb76570eec08146ba7c8cf"),
    # FBGEMM's training TBE
    Pin("fbgemm_gpu.split_table_batched_embeddings_ops_training:SplitTableBatchedEmbeddingBagsCodegen.forward",
        ("iter", "iter_cpu"), "forward counts its calls in `iter` / `iter_cpu` (Adam's bias correction)",
        ("anyrec/trainer/replica_exchange.py",), FBGEMM,
        "b69aa7e540a953f7d63c9187b838975940827da1bd080ff89528fd0c65bf10e3"),
    # torch: the fused optimizers' marks on parameters
    Pin("torch.distributed.optim.apply_optimizer_in_backward:_apply_optimizer_in_backward",
        ("_optimizer_kwargs", "_in_backward_optimizers"),
        "each parameter's optimizer kwargs and in-backward optimizers, which torchrec's sharders read",
        ("anyrec/trainer/optim.py", "anyrec/kernels/ebc.py"), TORCH,
        "996b0297b2b64740269110f1528de8e9c51f4186db2c7c098c5d17eb442a92b2"),
    Pin("torch.nn.modules.module:Module._apply", ("_apply",),
        "moving a module (to, cpu, ...) goes through _apply, overridden to move the TBE's own tensors",
        ("anyrec/kernels/ebc.py", "anyrec/kernels/tbe.py"), TORCH,
        "e50d01ca9c5c9b607b4121a6df4c54d65bc5c8e146fcc3f80211a4b4932bb4fb"),
    Pin("torch.nn.modules.module:Module.register_parameter", ("_parameters",),
        "a module's own parameters live in `_parameters`", ("anyrec/models/init.py",), TORCH,
        "eefb7990f204ed627886104fe3d789bef0f86fb77aa48cb521dd77ee1fb365d8"),
    Pin("torch.distributed._shard.sharded_tensor:ShardedTensor", ("_shard",),
        "the sharded tensors torchrec's state dicts hold (local shards, metadata)",
        ("anyrec/models/init.py", "anyrec/trainer/fingerprint.py"), TORCH,
        "570ee7e62e1fb3cca94c9ebe2da4156011ac82cdff0e2dfcb6cb3446153561b5"),
    Pin("torch.distributed.remote_device:_remote_device", ("_remote_device",),
        "a shard's placement, `rank:<r>/<device>`", ("anyrec/trainer/planning.py",), TORCH,
        "e8453c853e0891ef72ad7766c388368c3d846eb555918fef652b44400cd2f4ef"),
    Pin("torch.distributed.distributed_c10d:_get_default_store", ("_get_default_store",),
        "the default process group's store (agreements, stop requests)",
        ("anyrec/runtime/agreement.py", "anyrec/runtime/shutdown.py"), TORCH,
        "4f987107c62d0352eea05483dd84737f07c272fa7aa6aafe08b9cc04da727eeb"),
    Pin("torch.fx.experimental._config", ("_config",), "`patch(backed_size_oblivious=True)` for export",
        ("anyrec/serving/artifact.py",), TORCH,
        "fee06726a744cf8b4ed69a3959a07ead96265e9710f9960c8dc914bfddf6e1a0"),
    Pin("torch._inductor.codegen.common:get_scheduling_for_device", ("_inductor",),
        "whether inductor has a scheduling for a device type", ("anyrec/backends/interface.py",), TORCH,
        "26aa2885cf651f3596d3d810eb5775c37aa2671181d9d8b2c15b070dfadf5362"),
    Pin("torch._inductor.codegen.common:init_backend_registration", ("_inductor",),
        "registering inductor's built-in device backends", ("anyrec/backends/interface.py",), TORCH,
        "dd325dc6ec8f44f584f80f9d56b67af2c996b589e88ebc82e3851082ddff5a95"),
    Pin("torch.library:Library._destroy", ("_destroy",), "removing the kernels a Library registered",
        ("anyrec/backends/sparse_ops.py",), TORCH,
        "9773ccaed2f7d603926bcedafc47296c5e2e0df18747bc8badfa36c9a48294c0"),
    Pin("torch:_check", ("_check",),
        "torch._check(cond) states a size fact (a length's bounds) torch.export's tracer takes as given",
        ("anyrec/kernels/hstu.py", "anyrec/models/dlrmv4_scoring.py"), TORCH,
        "a6343f21c57e95c4fccb44d89ebdaad656854116939f543520c55bbd8bd1d769"),
    Pin("torch._C:_get_privateuse1_backend_name", ("_C", "_get_privateuse1_backend_name"),
        "the name a PrivateUse1 device registered", ("anyrec/backends/dispatch.py",), TORCH, None),
    Pin("torch._C._autograd:_top_saved_tensors_default_hooks",
        ("_C", "_autograd", "_top_saved_tensors_default_hooks"),
        "the saved-tensor hooks in force (pack, unpack) or None, which recompute_saved passes on",
        ("anyrec/models/recompute.py",), TORCH, None),
    Pin("torch._C:_dispatch_get_all_op_names", ("_C", "_dispatch_get_all_op_names"),
        "every operator the dispatcher knows",
        ("anyrec/backends/dispatch.py", "anyrec/backends/sparse_ops.py"), TORCH, None),
    Pin("torch._C:_dispatch_has_kernel_for_dispatch_key", ("_C", "_dispatch_has_kernel_for_dispatch_key"),
        "whether an operator has a kernel for a dispatch key",
        ("anyrec/backends/dispatch.py", "anyrec/backends/sparse_ops.py"), TORCH, None),
    # torch.distributed.checkpoint: the restricted reader
    Pin("torch.distributed.checkpoint._traverse:set_element", ("_traverse",),
        "SafeLoadPlanner.load_bytes puts a non-tensor entry in place as DCP does", _DCP, TORCH,
        "a07d75df5abdd9228a43e97c90022c0f63493d13eabc404866fa3693ec5533f6"),
    Pin("torch.distributed.checkpoint.default_planner:DefaultLoadPlanner.load_bytes", (),
        "SafeLoadPlanner.load_bytes is its body with torch.load(weights_only=True)", _DCP, TORCH,
        "666701f9808c4bc29122aea82f71239bcbe5bfed8a21445f3818ef969d0dec75"),
    Pin(f"{_FS}:FileSystemReader.read_metadata", (),
        "SafeReader.read_metadata is its body with the restricted unpickler", _DCP, TORCH,
        "8586ce344a52360276695837d6febff86c8adc7daf5df9530d4f494184cd6c41"),
    Pin(f"{_FS}:FileSystemReader._get_metadata_path", ("_get_metadata_path",), "where `.metadata` is",
        _DCP, TORCH,
        "4caa1459c35316362aedc179005932cebe704b7b901b56ff7bb76d41e01d6334"),
    Pin(f"{_FS}:_StorageInfo", ("_StorageInfo",), "a class DCP pickles into `.metadata` (allowed by name)",
        _DCP, TORCH,
        "74febf0cc7db965c243cd9ee7c141ff26873c0f44f4afaacbd00b029ebfad8d8"),
    Pin("torch.distributed.checkpoint.metadata", ("_MEM_FORMAT_ENCODING",),
        "the classes DCP pickles into `.metadata` (allowed by name) and their fields",
        (*_DCP, "anyrec/trainer/checkpoint.py"), TORCH,
        "6231a271f0c4808062d44982f730bdf9be83439fad62762d0a1a4ad215de1dd9"),
    Pin("torch.serialization:_get_layout", ("_get_layout",), "what a pickled layout calls (allowed by name)",
        _DCP, TORCH,
        "31d3193d247fd7344821f9ef8f09205436d2b0b54268a367425d4e89e88de024"),
    # OmegaConf: a config's nodes without resolving them
    Pin("omegaconf:DictConfig._get_node", ("_get_node",), "a child node, unresolved", ("anyrec/_hydra.py",),
        OMEGACONF,
        "a898217e5508e81b6d4d7e1dca6799b6541c091e8e3223ddc552e8bb50f3079d"),
    Pin("omegaconf:DictConfig._is_missing", ("_is_missing",), "whether a node is ???",
        ("anyrec/_hydra.py",), OMEGACONF,
        "dcde7c266e638d1f2069c5fac19dd073d41714d9606e6650e234c9ada401271f"),
    Pin("omegaconf:DictConfig._is_none", ("_is_none",), "whether a node is None", ("anyrec/_hydra.py",),
        OMEGACONF,
        "88007b342e0fbe5a43d2dbcff92f63e8ab467b4141ffa37af42aaea7962ba3ae"),
)

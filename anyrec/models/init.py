"""Plan-invariant initialisation: the same initial weights whatever the kernel, plan, world size or device.

Embedding tables: element (r, c) of table T is a pure function of (seed, T's name, r, c): a 32-bit integer
mixer over the table key, the row's two 32-bit halves and the column (int64 torch ops, no overflow) gives
24 random bits u, and the value is `(2 u / 2^24 - 1) * bound` in fp32 -- two exactly rounded operations,
so every device computes the same bits. The range is torchrec's default, +-1/sqrt(global rows) (or the
config's weight_init_min/max). A table with its own `init_fn` keeps it: the full table is drawn on the
CPU under a generator seeded from (seed, table name) and each shard takes its slice (one full table in
host memory, for those tables only).

Dense layers: each parameter-owning submodule runs its `reset_parameters` on a CPU copy under torch's
generator seeded from (seed, module path): each layer keeps its usual distribution, and neither the build
order nor the device changes the draw. A checkpoint loaded afterwards replaces all of it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec.distributed.shards_wrapper import LocalShardsWrapper

_MASK32 = 0xFFFFFFFF
# Elements hashed per pass: the hash's int64 temporaries take ~40 bytes an element (20 MiB at 2^19), which
# the planner's memory model counts at start-up (anyrec.planner.memory.INIT_WORKSPACE_BYTES).
_CHUNK_ELEMENTS = 1 << 19


def _seed32(*parts: object) -> int:
    """A 32-bit key from `parts` (stable across processes and Python versions, unlike `hash`)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little")


@contextlib.contextmanager
def _seeded(*key: object):
    """torch's global generator seeded from `key` inside the block; its CPU state restored after."""
    gen_state = torch.get_rng_state()
    try:
        torch.manual_seed(_seed32(*key))
        yield
    finally:
        torch.set_rng_state(gen_state)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32): the constant in 16-bit halves, so nothing overflows."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer mixer (xorshift-multiply, constants from C. Wellons' lowbias32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_hash(key: int, rows_R: torch.Tensor, cols_C: torch.Tensor, low: float,
                 high: float) -> torch.Tensor:
    """uniform(low, high) values [R, C] (fp32) at global rows `rows_R` and columns `cols_C`."""
    key_t = torch.tensor(key & _MASK32, dtype=torch.int64, device=rows_R.device)
    h_R = _mix32(key_t ^ (rows_R & _MASK32))
    h_R = _mix32(h_R ^ (rows_R >> 32))
    h_RC = _mix32(h_R[:, None] ^ _mix32(cols_C[None, :] + 0x9E3779B9 & _MASK32))
    u_RC = (h_RC >> 8).to(torch.float32)  # 24 random bits: exact in fp32
    centred_RC = u_RC * (2.0 / (1 << 24)) - 1.0  # exact: a power-of-two scale, then a 25-bit sum
    # separate multiply and add (no fused multiply-add): each rounds once, identically everywhere
    out_RC = centred_RC * torch.tensor((high - low) / 2, dtype=torch.float32, device=rows_R.device)
    if high != -low:
        out_RC = out_RC + torch.tensor((high + low) / 2, dtype=torch.float32, device=rows_R.device)
    return out_RC


def uniform_range(init_fn: Callable | None, num_rows: int) -> tuple[float, float] | None:
    """(low, high) when `init_fn` is None or torchrec's default, `partial(uniform_, a=min, b=max)` (drawn by
    the hash); None for any other `init_fn`."""
    if init_fn is None:
        bound = math.sqrt(1 / num_rows)  # torchrec's formula, to the last bit
        return -bound, bound
    if (isinstance(init_fn, functools.partial) and init_fn.func is torch.nn.init.uniform_ and not init_fn.args
            and set(init_fn.keywords) == {"a", "b"}):
        return float(init_fn.keywords["a"]), float(init_fn.keywords["b"])
    return None


@torch.no_grad()
def fill_table_block(out_RC: torch.Tensor, seed: int, table: str, num_rows: int, row0: int = 0,
                     col0: int = 0, init_fn: Callable[[torch.Tensor], object] | None = None,
                     num_cols: int | None = None) -> None:
    """Write the initial values of global rows row0.. and columns col0.. of `table` (`num_rows` rows in all)
    into `out_RC`; another `init_fn` than torchrec's uniform draws the full table on the CPU, then slices."""
    rows, cols = out_RC.shape
    bounds = uniform_range(init_fn, num_rows)
    if bounds is None:
        if num_cols is None:
            raise ValueError(f"table {table}: init_fn needs the table's full width")
        full = torch.empty(num_rows, num_cols, dtype=torch.float32)
        with _seeded(seed, "init_fn", table):
            init_fn(full)
        out_RC.copy_(full[row0:row0 + rows, col0:col0 + cols])
        return
    device = out_RC.device
    key = _seed32(seed, "table", table)
    cols_C = torch.arange(col0, col0 + cols, dtype=torch.int64, device=device)
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        rows_R = torch.arange(row0 + start, row0 + stop, dtype=torch.int64, device=device)
        out_RC[start:stop].copy_(uniform_hash(key, rows_R, cols_C, *bounds))


@torch.no_grad()
def init_tables(state: Mapping[str, object], tables: Iterable, seed: int, prefix: str) -> int:
    """Fill the rows this process holds of every table (EmbeddingBagConfigs `tables`) in a module's
    `state_dict()`: whole tensors, ShardedTensor shards at their offsets, or replicas. A weight is
    `state[f"{prefix}{name}.weight"]`, a view of the live weights (torchrec's and anyrec's EBCs give
    views). Returns the number of blocks written, so a caller can check that the keys matched."""
    written = 0
    for cfg in tables:
        key = f"{prefix}{cfg.name}.weight"
        if key not in state:
            raise KeyError(f"no {key} in the model's state_dict")
        value = state[key]
        blocks = ([(s.tensor, s.metadata.shard_offsets) for s in value.local_shards()]
                  if isinstance(value, ShardedTensor) else dtensor_shards(value)
                  if isinstance(value, DTensor) else [(value, [0, 0])])
        for tensor, (row0, col0) in blocks:
            if tensor.numel() == 0:
                continue
            fill_table_block(tensor, seed, cfg.name, cfg.num_embeddings, row0, col0,
                             init_fn=cfg.init_fn, num_cols=cfg.embedding_dim)
            written += 1
    return written


def dtensor_shards(value: DTensor) -> list[tuple[torch.Tensor, Sequence[int]]]:
    """The local shards of a table torchrec's 2D parallelism gives as a DTensor (LocalShardsWrapper:
    views of the live weights) with their offsets in the table."""
    local = value.to_local()
    if not isinstance(local, LocalShardsWrapper):
        raise TypeError(f"a table's DTensor holds {type(local).__name__}, not torchrec's LocalShardsWrapper")
    # a rank without shards of the table has no tensor but one empty chunk in the metadata
    return list(zip(local.local_shards(), local.local_offsets(), strict=False))


@torch.no_grad()
def init_dense(model: nn.Module, seed: int, skip: Callable[[str], bool] = lambda name: False) -> int:
    """Re-draw every parameter-owning submodule with `reset_parameters`, keyed by its path; returns a count.
    `skip(path)` leaves a submodule and its children alone (the embedding tables). One without
    `reset_parameters` is an error: its values would follow the plan."""
    done = 0
    skipped: list[str] = []
    for name, module in model.named_modules():
        if skip(name) or any(name.startswith(s + ".") for s in skipped):
            skipped.append(name)
            continue
        # the module's own parameters (wrappers such as DistributedModelParallel report their children's)
        own = [p for p in module._parameters.values() if p is not None]
        if not own:
            continue
        if not hasattr(module, "reset_parameters"):
            raise ValueError(f"{name} ({type(module).__name__}) has parameters but no reset_parameters(); "
                             "it cannot be initialised independently of the plan")
        cpu = cpu_copy(module)
        with _seeded(seed, "dense", _strip_wrappers(name)):
            cpu.reset_parameters()
        for p, q in zip(own, [q for q in cpu._parameters.values() if q is not None], strict=True):
            p.copy_(q)
        done += 1
    return done


def cpu_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` on the CPU whose tensors are copied there directly: a deepcopy of a device tensor
    that is not a parameter clones its storage on the device, which needs the device's own storage
    allocator (an out-of-tree device may have none)."""
    memo: dict[int, object] = {}
    for t in (*module.parameters(), *module.buffers()):
        cpu = t.detach().to("cpu", copy=True)
        memo[id(t)] = nn.Parameter(cpu, t.requires_grad) if isinstance(t, nn.Parameter) else cpu
    return copy.deepcopy(module, memo).to("cpu")


def _strip_wrappers(name: str) -> str:
    """A module path without DistributedModelParallel / DDP wrapper segments (same key on every plan)."""
    return ".".join(p for p in name.split(".") if p not in ("_dmp_wrapped_module", "module"))


def init_model(model: nn.Module, tables: Iterable, seed: int, ebc_path: str,
               collection: str = "embedding_bags") -> None:
    """Plan-invariant initial weights for a built (and, if sharded, materialised) model, in place. The
    embedding collection sits at `ebc_path` (`<ebc_path>.<collection>.<table>.weight` in the state_dict,
    DistributedModelParallel or not: `embedding_bags` for an EmbeddingBagCollection, `embeddings` for an
    EmbeddingCollection); everything else is dense."""
    init_tables(model.state_dict(), tables, seed, f"{ebc_path}.{collection}.")
    init_dense(model, seed, skip=lambda name: _strip_wrappers(name) == ebc_path)

"""`anyrec-parity` / `python -m anyrec.parity`: one training job under several variants, compared.

    anyrec-parity model=dlrmv4_small
    anyrec-parity model=dlrm_tiny trainer.steps=20 parity.variants='["backend.embedding_kernel=fbgemm",
        "backend.embedding_kernel=torch nproc=2", "backend.embedding_kernel=triton TRITON_INTERPRET=1"]'

The overrides other than `parity.*` are the base job. Each of `parity.variants` is Hydra overrides, plus
`nproc=N` (ranks, under their own `torchrun --standalone`) and `NAME=VALUE` environment variables. Given no
variants, the model family's default check runs (`ParityCheck`, anyrec.models.family; `--help` lists them):
its base overrides (a few steps, a small global batch) and its variants, less every default whose key the
command line sets. Every variant runs `anyrec-train`'s loop (no evaluation or checkpoints) and records its
per-step loss (mean over ranks) and final weights (every `*weight` / `*bias`, whole). The table says which
check ran and compares each variant with the first; exit status 1 when one exceeds `parity.loss_rtol` /
`parity.weight_atol` or a variant failed, 2 for bad arguments. `parity.save=FILE` writes the records
(JSON); `parity.against=FILE` compares with the first record of such a file written elsewhere (e.g. a B200
run checked on an MI350X), checked whole first: bounded in size and nesting, each record's `record_sha256`
covering all it asserts (losses, weights, label, meta), and, with a signing key (anyrec.signing), the
file's HMAC-SHA256.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from anyrec import _hydra
from anyrec.config import AnyrecConfig, ParityConfig
from anyrec.io_checks import atomic_write, writable_file
from anyrec.models.family import FAMILIES, ModelFamily, resolve_family
from anyrec.proc import run_session
from anyrec.runtime.distributed import DistInfo, all_reduce_mean
from anyrec.safe_load import load_json
from anyrec.signing import SignatureError, SigningKey, resolve_key, warn_unkeyed
from anyrec.trainer.fingerprint import full_state
from anyrec.trainer.trainer import Trainer

FORMAT = "anyrec-parity/2"  # /1: a record's hash covered its weights only
# A records file holds every variant's whole weights: bounded, but far above the other files' bound.
MAX_RECORDS_BYTES = 1 << 30
_WORKER_FLAG = "--parity-worker"
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
             "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Variant:
    """One way to run the base job: Hydra overrides, ranks and environment."""

    label: str
    overrides: list[str] = field(default_factory=list)
    nproc: int = 1
    env: dict[str, str] = field(default_factory=dict)


def parse_variant(text: str) -> Variant:
    """`"backend.embedding_kernel=torch nproc=2 TRITON_INTERPRET=1"` -> a Variant."""
    v = Variant(label=text.strip() or "(base)")
    for token in shlex.split(text):
        key, sep, value = token.partition("=")
        if not sep:
            raise ValueError(f"variant token {token!r} is not KEY=VALUE")
        if key == "nproc":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"nproc must be a positive integer, got {value!r}")
            v.nproc = int(value)
        elif key.isupper():
            v.env[key] = value
        else:
            v.overrides.append(token)
    return v


def override_key(text: str) -> str:
    """The config key (or group) a Hydra override sets: `+trainer.steps=4` -> `trainer.steps`."""
    return text.partition("=")[0].lstrip("~+")


@dataclass
class Check:
    """What one `anyrec-parity` call runs: its name (the table's first line), the base job's overrides
    and the variants, the first of them the reference."""

    name: str
    base: list[str]
    variants: list[Variant]


def _without_keys(overrides: Iterable[str], keys: set[str]) -> list[str]:
    return [o for o in overrides if override_key(o) not in keys]


def _unset_settings(settings: Iterable[str], keys: set[str]) -> list[str]:
    """The overrides of every setting (overrides that go together, space-separated) none of whose keys is
    in `keys`."""
    kept = []
    for setting in settings:
        words = shlex.split(setting)
        if not any(override_key(w) in keys for w in words):
            kept += words
    return kept


def choose_check(command_line: list[str], variants: list[str], family: ModelFamily) -> Check:
    """The check to run: the given `variants` on the command line's base job, or, given none, `family`'s
    default check less what the command line sets (the user's own settings win; the command line's come
    last): a base setting where the command line sets any of its keys, a variant's override where it sets
    that key."""
    if variants:
        return Check("parity.variants", command_line, [parse_variant(v) for v in variants])
    keys = {override_key(o) for o in command_line}
    chosen = []
    for text in family.parity.variants:
        v = parse_variant(text)
        kept = _without_keys(v.overrides, keys)
        if kept != v.overrides:  # labelled by what runs
            env = [f"{k}={val}" for k, val in v.env.items()]
            nproc = [f"nproc={v.nproc}"] if v.nproc > 1 else []
            v = Variant(" ".join([*kept, *nproc, *env]) or "(base)", kept, v.nproc, v.env)
        chosen.append(v)
    base = [*_unset_settings(family.parity.base, keys), *command_line]
    return Check(f"default check of {family.name}", base, chosen)


def default_checks_help() -> str:
    """`--help`'s section on each family's default check."""
    lines = ["== Default checks (no parity.variants given) ==",
             "Per model family (model.family); a key set on the command line replaces the check's own", ""]
    for family in FAMILIES.values():
        lines.append(f"{family.name}: {' '.join(family.parity.base)}")
        lines += [f"  variant: {v or '(base)'}" for v in family.parity.variants]
    return "\n".join(lines)


def check_options(opts: ParityConfig, signing_key: SigningKey | None = None) -> dict[str, Any] | None:
    """The tolerances and files of `opts` checked before any variant runs; the `against` records (signed
    with `signing_key`, if given)."""
    writable_file(opts.save, "parity.save")
    if opts.against is None:
        return None
    if not Path(opts.against).is_file():
        raise ValueError(f"parity.against: no such file {opts.against}")
    return read_records(Path(opts.against), signing_key)


# ---- one variant, inside its own process(es) ----------------------------------------------------

# What the worker adds to the base job: the steps only (no evaluation, checkpoints or progress bar).
STEPS_ONLY = ["trainer.evaluate=false", "trainer.checkpoint.dir=null", "trainer.progress=false"]


def full_weights(model, info: DistInfo) -> dict[str, Any]:
    """Every `*weight` / `*bias` entry of the state_dict, whole (fp32, shards gathered), on rank 0; else {}
    (other entries, optimizer state and counters, are in some kernels' state_dict only)."""
    state = full_state(model, info)
    if not info.is_main:
        return {}
    return {name: t.float() for name, t in state.items() if name.endswith(("weight", "bias"))}


def weights_sha256(weights: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the names and fp32 bytes of `weights`, in order (a record's `weights_sha256`)."""
    h = hashlib.sha256()
    for name, t in weights.items():
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sharding_types(trainer: Trainer) -> list[str]:
    """The sharding types the trainer's plan gives its tables, sorted; [] when the tables are unsharded
    (one device, no plan)."""
    if trainer.planned is None:
        return []
    return sorted({ps.sharding_type for tables in trainer.planned.plan.plan.values()
                   for ps in tables.values()})


def train_losses(trainer: Trainer) -> list[float]:
    """Run `trainer.train()` (anyrec-train's loop) and return every step's loss, averaged over ranks."""
    losses: list[torch.Tensor] = []
    trainer.step_hooks.append(lambda t: losses.append(t.last_loss))
    trainer.train()
    return all_reduce_mean([float(x) for x in losses], trainer.device)


def worker(out_path: str, overrides: list[str]) -> None:
    """Train one variant; rank 0 writes its record to `out_path`."""
    trainer = Trainer(_hydra.compose_job([*overrides, *STEPS_ONLY]))
    try:
        losses = train_losses(trainer)
        weights = full_weights(trainer.model, trainer.dist)
        meta = {"embedding_kernel": trainer.embedding_kernel, "world_size": trainer.dist.world_size,
                "backend": trainer.backend.describe(), "torch": torch.__version__,
                "batch_size_per_rank": trainer.batch_size, "sharding_types": sharding_types(trainer)}
        is_main = trainer.dist.is_main
    finally:
        trainer.close()
    if not is_main:
        return
    record = {"losses": losses, "weights_sha256": weights_sha256(weights), "meta": meta,
              "weights": {n: {"shape": list(t.shape), "values": t.reshape(-1).tolist()}
                          for n, t in weights.items()}}
    with atomic_write(out_path) as f:
        json.dump(record, f)


# ---- records read back ---------------------------------------------------------------------------

def _finite_numbers(values: Any, what: str) -> None:
    if not isinstance(values, list) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise ValueError(f"{what} is not a list of finite numbers")


def record_sha256(run: dict[str, Any]) -> str:
    """SHA-256 over everything a record asserts (its `record_sha256` aside), as sorted compact JSON."""
    body = {k: v for k, v in run.items() if k != "record_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed(run: dict[str, Any]) -> dict[str, Any]:
    """`run` with its `record_sha256`."""
    return {**run, "record_sha256": record_sha256(run)}


def check_record(run: Any, what: str) -> None:
    """One run of a records file, whole: label, losses, and weights that match their shapes and hash,
    and its `record_sha256` over all of it."""
    if not isinstance(run, dict):
        raise ValueError(f"{what} is not an object")
    for key in ("label", "losses", "weights", "weights_sha256", "record_sha256"):
        if key not in run:
            raise ValueError(f"{what} has no {key!r}")
    _finite_numbers(run["losses"], f"{what} losses")
    if not run["losses"]:
        raise ValueError(f"{what} has no steps")
    if not isinstance(run["weights"], dict) or not run["weights"]:
        raise ValueError(f"{what} has no weights")
    tensors = {}
    for name, w in run["weights"].items():
        shape = w.get("shape") if isinstance(w, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"{what} weight {name} has no valid shape")
        _finite_numbers(w.get("values"), f"{what} weight {name} values")
        if len(w["values"]) != math.prod(shape):
            raise ValueError(f"{what} weight {name} has {len(w['values'])} values for shape {shape}")
        tensors[name] = torch.tensor(w["values"], dtype=torch.float32).reshape(shape)
    if weights_sha256(tensors) != run["weights_sha256"]:
        raise ValueError(f"{what} weights do not match their weights_sha256 (the file was altered)")
    if record_sha256(run) != run["record_sha256"]:
        raise ValueError(f"{what} does not match its record_sha256 (the file was altered: losses, label "
                         "or meta)")


def read_records(path: Path, signing_key: SigningKey | None = None) -> dict[str, Any]:
    """A `parity.save` file, checked whole (and against `signing_key`, if given) before any variant
    runs; ValueError names what is wrong."""
    what = f"parity.against {path}"
    data = load_json(path, what, max_bytes=MAX_RECORDS_BYTES)  # bounded: size and nesting
    if isinstance(data, dict) and data.get("format") == "anyrec-parity/1":
        raise ValueError(f"{what}: written by an older anyrec (anyrec-parity/1, whose hash does not cover "
                         "the losses): record it again with parity.save")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{what}: not an {FORMAT} file")
    if signing_key is not None:
        try:
            signing_key.check(data, what)
        except SignatureError as e:
            raise ValueError(str(e)) from None
    else:
        warn_unkeyed(what)
    if not isinstance(data.get("runs"), list) or not data["runs"]:
        raise ValueError(f"{what}: holds no runs")
    for i, run in enumerate(data["runs"]):
        check_record(run, f"{what}: run {i}")
    return data


# ---- the driver ---------------------------------------------------------------------------------

def run_variant(base: list[str], variant: Variant, timeout_s: float) -> dict[str, Any]:
    """Launch one variant (torchrun when nproc > 1) and return its record, or {"error": ...}."""
    with tempfile.TemporaryDirectory(prefix="anyrec-parity-") as tmp:
        out = str(Path(tmp) / "record.json")
        ranks = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={variant.nproc}"]
        cmd = [sys.executable, *(ranks if variant.nproc > 1 else []), "-m", "anyrec.parity", _WORKER_FLAG,
               out, *base, *variant.overrides]
        # a fresh job: no rendezvous settings inherited from a surrounding (or finished) one
        env = {k: v for k, v in os.environ.items()
               if k not in _DIST_ENV and not k.startswith("TORCHELASTIC_")}
        env.update({"PYTHONUNBUFFERED": "1", **variant.env})
        try:  # own session: a timeout takes torchrun's workers down with it
            proc = run_session(cmd, timeout_s, env=env, merge_stderr=True)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s:.0f} s"}
        if proc.returncode != 0 or not Path(out).is_file():
            lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
            errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
            last = (errors or lines or ["no output"])[-1].strip()[:300]
            return {"error": f"exit {proc.returncode}: {last}"}
        return json.loads(Path(out).read_text())


def compare(ref: dict[str, Any], rec: dict[str, Any]) -> dict[str, float]:
    """Largest loss differences over the steps and largest weight difference, `rec` against `ref`."""
    a, b = ref["losses"], rec["losses"]
    if len(a) != len(b):
        return {"loss_abs": math.inf, "loss_rel": math.inf, "weight_abs": math.inf}
    loss_abs = max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
    loss_rel = max((abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a, b, strict=True)), default=0.0)
    weight_abs = 0.0 if set(ref["weights"]) == set(rec["weights"]) else math.inf
    for name, w in ref["weights"].items():
        other = rec["weights"].get(name)
        if other is None or other["shape"] != w["shape"]:
            weight_abs = math.inf
        elif w["values"]:
            diff = (torch.tensor(w["values"]) - torch.tensor(other["values"])).abs()
            weight_abs = max(weight_abs, float(diff.max()))
    return {"loss_abs": loss_abs, "loss_rel": loss_rel, "weight_abs": weight_abs}


def shown(text: object) -> str:
    """`text` safe to print: control and other unprintable characters (a terminal's escape codes, from a
    record file or a child's output) as escapes, and `|` escaped so a table row keeps its columns."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in str(text)).replace("|", "\\|")


def report(labels: list[str], records: list[dict[str, Any]], ref: dict[str, Any], ref_label: str,
           opts: ParityConfig, check: str = "parity.variants") -> tuple[str, bool]:
    """The table (markdown) under the name of the `check` that ran, and whether every variant is within
    tolerance (every label and error shown escaped: they come from files and child processes)."""
    rows = [f"check: {shown(check)}", f"reference: {shown(ref_label)}",
            "| variant | steps | final loss | max abs loss diff | max rel loss diff | max abs weight diff "
            "| weights sha256 | result |",
            "|---|---|---|---|---|---|---|---|"]
    ok_all = True
    for label, rec in zip(map(shown, labels), records, strict=True):
        if "error" in rec:
            ok_all = False
            rows.append(f"| {label} | - | - | - | - | - | - | FAILED: {shown(rec['error'])} |")
            continue
        d = compare(ref, rec)
        ok = d["loss_rel"] <= opts.loss_rtol and d["weight_abs"] <= opts.weight_atol
        ok_all &= ok
        final = rec["losses"][-1] if rec["losses"] else math.nan
        rows.append(f"| {label} | {len(rec['losses'])} | {final:.7f} | {d['loss_abs']:.2e} "
                    f"| {d['loss_rel']:.2e} | {d['weight_abs']:.2e} | {rec['weights_sha256'][:12]} "
                    f"| {'ok' if ok else 'DIFFERS'} |")
    return "\n".join(rows), ok_all


def run(cfg: AnyrecConfig) -> int:
    """Run every variant, print the table; 0 when all agree within tolerance, 1 if not."""
    opts = cfg.parity
    signing_key = resolve_key(cfg.trainer.signing_key_file)
    reference = check_options(opts, signing_key)
    command_line = [o for o in HydraConfig.get().overrides.task if not o.startswith("parity.")]
    check = choose_check(command_line, opts.variants, resolve_family(cfg.model))
    base = check.base
    labels, records = [v.label for v in check.variants], []
    described = f"{check.name}: {' '.join(base)}"  # the table's first line names it too
    print(f"anyrec-parity: {described}", file=sys.stderr, flush=True)
    for v in check.variants:
        print(f"anyrec-parity: running {v.label} ...", file=sys.stderr, flush=True)
        records.append(run_variant(base, v, opts.timeout_s))
    if opts.save is not None:
        runs = [sealed({"label": lb, "base": base, **rec}) for lb, rec in zip(labels, records, strict=True)
                if "error" not in rec]
        doc = {"format": FORMAT, "runs": runs}
        with atomic_write(opts.save) as f:
            json.dump(signing_key.signed(doc) if signing_key is not None else doc, f)
    if reference is not None:
        ref, ref_label = reference["runs"][0], f"{reference['runs'][0]['label']} from {opts.against}"
    else:
        if "error" in records[0]:
            for lb, rec in zip(labels, records, strict=True):
                print(f"{shown(lb)}: {shown(rec.get('error', 'ran'))}")
            print("anyrec-parity: the reference (first) variant failed", file=sys.stderr)
            return 1
        ref, ref_label = records[0], labels[0]
    table, ok = report(labels, records, ref, ref_label, opts, described)
    print(table)
    print(f"tolerance: per-step loss {opts.loss_rtol:g} relative, weights {opts.weight_atol:g} absolute: "
          f"{'all variants agree' if ok else 'VARIANTS DIFFER'}")
    return 0 if ok else 1


def _task(cfg: DictConfig) -> None:
    _hydra.run_typed("anyrec-parity", lambda c: sys.exit(run(c)), cfg)


def main(argv: list[str] | None = None) -> int:
    """The command line (or `argv`) under Hydra's runner, as `anyrec-train` runs its own; the exit status:
    0 when all variants agree within tolerance, 1 if not, 2 on bad input."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == _WORKER_FLAG:
        worker(argv[1], argv[2:])
        return 0
    try:
        _hydra.launch("anyrec-parity", _task, argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    else:
        code = 0
    if code == 0 and any(a in ("--help", "-h") for a in argv):
        print(f"\n{default_checks_help()}")
    return code


def cli() -> None:
    """Console entry point."""
    sys.exit(main())


if __name__ == "__main__":
    cli()

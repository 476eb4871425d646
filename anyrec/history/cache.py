"""The calibration cache: a measured hardware file per machine and software stack, found again by key.

The `CacheKey` is what changes a calibration's figures: the device (name, devices per host), how one
host's ranks share it (local world size, each rank's cores before any binding, its thread count) and the
software versions; its digest names the file in `$ANYREC_CACHE_DIR` (default `~/.cache/anyrec/`). Whether
the ranks bound their threads is not in the key (`bind_cores=auto` decides it from the host's load, which
changes between runs): the entry records it, `Lookup.bound`.

An entry is a hardware YAML with a last `cache:` section: its key and a SHA-256 of everything above it,
and, with a signing key (anyrec.signing), an HMAC-SHA256 of the whole entry. A file cut short, damaged,
holding a NaN, made for another key, too big or too deeply nested is never used: `lookup` names the
problem in one line and the caller measures again. The checksum detects damage, not forgery: anyone who
can write the cache folder can write an entry with a matching checksum; with a signing key an entry
not signed with it is refused too. Entries are written whole (the last writer stays).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import yaml

import anyrec
from anyrec.backends import Backend, Hardware
from anyrec.backends.cpu import allowed_cores
from anyrec.backends.hardware import hardware_from_data
from anyrec.io_checks import atomic_write, write_yaml
from anyrec.safe_load import MAX_YAML_BYTES, load_json, load_yaml, read_text
from anyrec.signing import CACHE_DIR_ENV as CACHE_DIR_ENV  # one definition, also for the signing key
from anyrec.signing import FIELD, SigningKey, cache_dir, warn_unkeyed

if TYPE_CHECKING:
    from anyrec.backends.threads import ThreadChoice
    from anyrec.runtime.distributed import DistInfo

# Distribution names per package (the first installed one counts): FBGEMM ships CPU and GPU wheels.
PACKAGES = {"torch": ("torch",), "fbgemm": ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly"),
            "torchrec": ("torchrec",)}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_versions() -> dict[str, str]:
    """The versions of the software a step runs on ("none" where a package is not installed)."""
    out = {name: next(filter(None, map(_version, dists)), "none") for name, dists in PACKAGES.items()}
    return {**out, "anyrec": anyrec.__version__}


@dataclass(frozen=True)
class CacheKey:
    """What a calibration's figures depend on; equal keys may share one measurement."""

    backend: str
    device_name: str
    devices_per_host: int
    local_world_size: int
    cores_per_rank: tuple[tuple[int, ...], ...]  # each local rank's cores before binding
    threads_per_rank: int
    versions: tuple[tuple[str, str], ...]  # (package, version), sorted

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cores_per_rank": [list(c) for c in self.cores_per_rank],
                "versions": dict(self.versions)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CacheKey:
        """The key a cache file says it was measured for (ValueError if it is not one)."""
        try:
            cores = tuple(tuple(int(c) for c in r) for r in d["cores_per_rank"])
            versions = tuple(sorted((str(k), str(v)) for k, v in d["versions"].items()))
            return cls(str(d["backend"]), str(d["device_name"]), int(d["devices_per_host"]),
                       int(d["local_world_size"]), cores, int(d["threads_per_rank"]), versions)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"its cache key is malformed ({type(e).__name__}: {e})") from None

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def file_prefix(self) -> str:
        """The file name up to the digest: backend, device and local world size."""
        device = re.sub(r"[^A-Za-z0-9]+", "-", self.device_name).strip("-").lower() or "device"
        return f"calibration-{self.backend}-{device}-{self.local_world_size}r-"

    def file_name(self) -> str:
        return f"{self.file_prefix()}{self.digest()}.yaml"

    def differences(self, other: CacheKey) -> list[str]:
        """`field: theirs != ours` for each field in which `other` differs from this key."""
        a, b = self.to_dict(), other.to_dict()
        ours, theirs = a.pop("versions"), b.pop("versions")  # versions: per package
        return ([f"{k} {b[k]} (this is {a[k]})" for k in a if a[k] != b[k]]
                + [f"{pkg} {theirs.get(pkg)} (this is {ours.get(pkg)})" for pkg in sorted({*ours, *theirs})
                   if ours.get(pkg) != theirs.get(pkg)])


def make_key(backend: str, device_name: str, devices_per_host: int, cores_per_rank: list[list[int]],
             threads_per_rank: int) -> CacheKey:
    """The key for this process's software and the given machine facts."""
    return CacheKey(backend, device_name, devices_per_host, len(cores_per_rank),
                    tuple(tuple(sorted(c)) for c in cores_per_rank), threads_per_rank,
                    tuple(sorted(package_versions().items())))


def _content_digest(data: dict[str, Any]) -> str:
    body = {k: v for k, v in data.items() if k != "cache"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class Lookup:
    """What the cache holds for a key: its path, and its Hardware (threads bound?) or why it is unusable."""

    path: Path
    hardware: Hardware | None = None
    problem: str | None = None  # set when a file is there but must not be used
    bound: bool | None = None
    distrust: str | None = None  # why its figures may not be this machine's (measured on a busy host, ...)

    @property
    def hit(self) -> bool:
        return self.hardware is not None


def _signed_view(data: dict[str, Any]) -> dict[str, Any]:
    """The entry as `SigningKey` signs it: everything, the signature (kept in `cache:`) aside."""
    cache = data.get("cache") or {}
    return {**data, "cache": {k: v for k, v in cache.items() if k != FIELD}, FIELD: cache.get(FIELD)}


FAR_MISS = 10.0  # a run whose measured step is this many times off the entry's prediction rejects the entry
REJECTED = ".rejected"  # beside an entry: the digest of the entry a run rejected, and why


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def reject_entry(path: str | Path, reason: str) -> bool:
    """Mark the cache entry at `path` as not to be used again (`reason` says why: a run measured its step
    more than FAR_MISS times off what the entry predicted); the next lookup measures again, and the new
    entry is not rejected (the mark names the rejected content's digest). False where `path` is not a
    file in the cache folder (a hardware file the user named is theirs to mend)."""
    path = Path(path)
    if path.parent.resolve() != cache_dir().resolve() or path.is_symlink() or not path.is_file():
        return False
    digest = _digest(read_text(path, "the entry", MAX_YAML_BYTES))
    with atomic_write(path.with_name(path.name + REJECTED)) as f:  # replaces a link, never writes through it
        json.dump({"sha256": digest, "reason": reason}, f)
    return True


def _rejection(path: Path, text: str) -> str | None:
    """Why a run rejected the entry `path` holding `text`, or None (no mark, or a mark of other content)."""
    mark = path.with_name(path.name + REJECTED)
    if not mark.exists():
        return None
    try:
        data = load_json(mark, "the rejection mark", max_bytes=64 * 1024)
    except ValueError:
        return "a rejection mark beside it is unreadable"
    if not isinstance(data, dict) or data.get("sha256") != _digest(text):
        return None
    return f"rejected by an earlier run: {str(data.get('reason'))[:300]}"


def read_entry(path: Path, key: CacheKey, signing_key: SigningKey | None = None) -> Lookup:
    """Cache file `path` as a hit, checked whole, against `key` and (given one) `signing_key`, parsed
    once and bounded; ValueError in one line."""
    try:
        text = read_text(path, "the entry", MAX_YAML_BYTES)
        data = load_yaml(path, "the entry", text=text)
    except ValueError as e:
        raise ValueError(f"unreadable: {str(e).removeprefix('the entry: ')}") from None
    rejected = _rejection(path, text)
    if rejected:
        raise ValueError(rejected)
    if not isinstance(data, dict) or not isinstance(data.get("cache"), dict):
        raise ValueError("no `cache:` section (cut short, or not a cache entry)")
    cache = data["cache"]
    theirs = CacheKey.from_dict(cache.get("key") or {})
    if theirs != key:
        raise ValueError(f"measured for another machine or software: {'; '.join(key.differences(theirs))}")
    if cache.get("sha256") != _content_digest(data):
        raise ValueError("its content does not match its checksum (edited or damaged)")
    if signing_key is not None:
        signing_key.check(_signed_view(data), "the entry")
    else:
        warn_unkeyed(f"calibration cache entry {path}")
    measurements = data.get("measurements") or {}
    bound = measurements.get("bind_cores")  # below: every hardware file's checks
    trust = measurements.get("trust")
    distrust = None
    if isinstance(trust, dict) and trust.get("trusted") is False:  # entries before the verdict: trusted
        distrust = "; ".join(str(r) for r in trust.get("reasons") or []) or "not trusted"
    hardware = hardware_from_data(data, f"calibration cache entry {path}", str(path))
    return Lookup(path, hardware, bound=bound if isinstance(bound, bool) else None, distrust=distrust)


def lookup(key: CacheKey, directory: Path | None = None, signing_key: SigningKey | None = None) -> Lookup:
    """The cached calibration for `key`: a hit, nothing there, or a file that must not be used."""
    path = (directory or cache_dir()) / key.file_name()
    if not path.exists():
        return Lookup(path)
    try:
        return read_entry(path, key, signing_key)
    except ValueError as e:
        return Lookup(path, problem=str(e).removeprefix("the entry: "))


def write_entry(path: Path, key: CacheKey, data: dict[str, Any], header: str = "",
                signing_key: SigningKey | None = None) -> Path:
    """Write hardware-file `data` as the cache entry for `key` at `path` (signed with `signing_key` if
    given), whole or not at all."""
    entry = {k: v for k, v in data.items() if k != "cache"}
    entry = yaml.safe_load(yaml.safe_dump(entry, sort_keys=False))  # the digest of what is read back
    entry["cache"] = {"key": key.to_dict(), "sha256": _content_digest(entry),
                      "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if signing_key is not None:
        entry["cache"][FIELD] = signing_key.sign(_signed_view(entry))
    write_yaml(path, entry, header)
    return path


def local_key(backend: Backend, info: DistInfo, cores: Sequence[int] | None = None,
              threads: ThreadChoice | None = None) -> CacheKey:
    """This host's key, agreed by its ranks (a collective: every rank calls it, after setting its
    threads): each rank's `cores` (`allowed_cores()` taken before binding; default: now) and threads: a
    forced count as set, `backend.threads=auto`'s the rank's share of the cores, which a quiet host gives
    it (the count auto took under other processes' load is not the machine's: jobs that started beside
    different loads share the entry); `threads`: the runtime's thread decision (None: torch's count
    now)."""
    auto = threads is not None and threads.setting is None
    count = threads.share_cores if auto else torch.get_num_threads()
    mine = (info.host, info.local_rank, allowed_cores() if cores is None else cores, count)
    everyone = [mine]
    if info.world_size > 1:
        everyone = [None] * info.world_size
        dist.all_gather_object(everyone, mine)
    local = sorted((r for r in everyone if r[0] == mine[0]), key=lambda r: r[1])
    facts, spec = backend.facts, backend.device_spec()
    name = " ".join(dict.fromkeys(x for x in (spec.name, facts.device_name, spec.arch) if x))
    return make_key(backend.name, name, facts.device_count, [r[2] for r in local], max(r[3] for r in local))


def find_for_device(backend: Backend, one_process: DistInfo, local_world_size: int,
                    directory: Path | None = None, signing_key: SigningKey | None = None) -> Lookup | None:
    """The newest usable entry (signed with `signing_key`, if given) for this device and software at
    `local_world_size` ranks per host, whatever cores its ranks had, or None (for `anyrec-plan`, which
    runs no ranks: `one_process`)."""
    want = dataclasses.replace(local_key(backend, one_process), local_world_size=local_world_size)
    same = ("backend", "device_name", "devices_per_host", "local_world_size", "versions")
    paths = sorted((directory or cache_dir()).glob(f"{want.file_prefix()}*.yaml"),
                   key=lambda p: p.stat().st_mtime, reverse=True)
    for path in paths:
        try:
            key = CacheKey.from_dict(load_yaml(path, "the entry")["cache"]["key"])
            if any(getattr(key, f) != getattr(want, f) for f in same):
                continue
            return read_entry(path, key, signing_key)
        except (OSError, ValueError, TypeError, KeyError):
            continue  # not usable: a training job on this machine names and replaces it
    return None

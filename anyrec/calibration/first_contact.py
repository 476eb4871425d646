"""Calibration on first contact: a training job with `hardware=auto` plans with this machine's own
measured figures, not the datasheet's.

Every rank measures in the job's own `Runtime` (process group joined, cores bound as the trainer's are:
set up once, before); the ranks agree on the cache key (the cores each rank had before binding, so bound
and free runs share the entry; the log line says when the entry was measured with the other binding).
On a hit nothing is measured; on a miss (or `trainer.calibrate=always`, or an unusable cache file) all
ranks run the quick calibration together, so collective and step terms are the job's own, and rank 0
writes the entry. The job plans with the entry's `Hardware`, handed to its Trainer (the config is left
as given). `trainer.calibrate=never`, a SKU or file, or `planner=simple` skip all of it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from anyrec.backends import Hardware, resolve_hardware
from anyrec.backends.core_load import CoreLoad, measure_core_load
from anyrec.backends.hardware import HSTURates
from anyrec.calibration.measure import calibrate, hardware_yaml, report_trust
from anyrec.calibration.measure.hstu import DenseUnderTest, measure_hstu
from anyrec.calibration.run import CalibrationRun, CalibrationStopped, exit_stopped
from anyrec.config import AnyrecConfig, Precision
from anyrec.console import log_file_only
from anyrec.data import resolve_batch_size
from anyrec.history.cache import (
    CACHE_DIR_ENV,
    CacheKey,
    Lookup,
    cache_dir,
    local_key,
    lookup,
    write_entry,
)
from anyrec.history.hstu_records import read_record, record_key, record_path, write_record
from anyrec.history.trust import BUSY_OTHER_CORES
from anyrec.io_checks import atomic_write, writable_dir
from anyrec.models.dlrmv4 import ATTENTION_OP, dlrmv4_config
from anyrec.models.family import resolve_family
from anyrec.models.hstu import HSTUDense
from anyrec.planner.sequence import lengths_text
from anyrec.runtime.agreement import Agreement
from anyrec.runtime.distributed import Runtime
from anyrec.runtime.errors import PeerLostError
from anyrec.runtime.shutdown import peer_failure
from anyrec.safe_load import MAX_YAML_BYTES, read_text
from anyrec.schema import HSTUShape
from anyrec.signing import SigningKey, resolve_key

logger = logging.getLogger(__name__)


def wants_calibration(cfg: AnyrecConfig) -> bool:
    """Whether the job plans for this machine's device with the co-design planner and may calibrate."""
    return (cfg.hardware.sku == "auto" and not cfg.hardware.measurements and cfg.planner.name == "codesign"
            and cfg.trainer.calibrate != "never")


def check_cache_dir() -> None:
    """ValueError (one line) when the calibration cache folder cannot be written (a file, no permission):
    called before a measurement whose result could not be kept (a read-only cache of hits still plans)."""
    try:
        writable_dir(cache_dir(), f"{CACHE_DIR_ENV} (the calibration cache)")
    except ValueError as e:
        raise ValueError(f"{e}; set {CACHE_DIR_ENV} to a writable folder (nothing was measured)") from None


def remeasure_untrusted(distrust: str, now: CoreLoad | None) -> str | None:
    """Why a cache entry whose figures are not trusted (`distrust`) is measured again: the host is quiet
    now (other processes' load `now`, None where unreadable); None while it is still busy (measuring again
    would give no better figures: the job plans with the entry, and says so)."""
    if now is not None and now.other_cores > BUSY_OTHER_CORES:
        return None
    return f"its figures are not trusted ({distrust}) and the host is quiet now"


def calibrated_hardware(cfg: AnyrecConfig, runtime: Runtime, precision: Precision) -> Hardware:
    """The Hardware of this machine's cached calibration file (with `cfg.hardware.spec` on top), measured
    now in `runtime` if none is usable (every rank calls it); for an HSTU model, with its kernels' rates
    on the job's own shapes in the job's dense `precision` (`job_hstu_rates`). Its `measured_by` names
    the file."""
    signing_key = resolve_key(cfg.trainer.signing_key_file)
    info = runtime.dist
    agreement = Agreement.begin(info.rank, info.world_size, "calibration on first contact")
    try:
        path = _find_or_measure(cfg, runtime, signing_key, agreement)
        hw = cfg.hardware
        hardware = resolve_hardware(path, hw.spec, runtime.backend, hw.measurements)
        rate = job_hstu_rates(cfg, runtime, Path(path), agreement, precision)
    except Exception as e:
        _name_lost_peer(e, cfg, runtime)
        raise
    return dataclasses.replace(hardware, hstu_rates=(rate,)) if rate is not None else hardware


def _name_lost_peer(e: Exception, cfg: AnyrecConfig, runtime: Runtime) -> None:
    """Every choice that decides what the ranks do next (hit or miss, a folder that cannot be written, the
    file's text, an HSTU record) is rank 0's, agreed through one `Agreement`; a rank's collective that
    fails because a peer went a different way or left is named in one line (PeerLostError)."""
    info = runtime.dist
    lost = peer_failure(e, info.rank, info.world_size, cfg.trainer.collective_timeout_s)
    if lost:
        raise PeerLostError(lost) from None


def hstu_record_key(entry: Path, impl: str, half: bool, shape: HSTUShape, batch: int) -> str:
    """The name of the HSTU record of a job of `shape` (attention implementation `impl`, bf16 where `half`,
    `batch` samples per rank) kept beside the calibration entry `entry`."""
    return record_key(read_text(entry, "the calibration entry", MAX_YAML_BYTES), impl, half, shape, batch)


def recorded_hstu_rates(entry: Path, impl: str, half: bool, shape: HSTUShape,
                        batch: int) -> tuple[HSTURates, Path] | None:
    """The HSTU record a training job of `shape` at `batch` samples per rank measured on first contact
    beside the calibration entry `entry` (what it planned with), and where it is; None where none is
    kept. What `anyrec-plan` on this machine plans with, as the job does."""
    path = record_path(key := hstu_record_key(entry, impl, half, shape, batch))
    rate = read_record(path, key)
    return (rate, path) if rate is not None else None


def job_hstu_rates(cfg: AnyrecConfig, runtime: Runtime, entry: Path, agreement: Agreement,
                   precision: Precision) -> HSTURates | None:
    """For an HSTU model, the rates of its kernels (the attention implementation the job runs, the
    backend's choice; the STU GEMMs; the elementwise passes) on the job's heads, dims, planned lengths and
    batch, in the dtype the planner costs: the record kept beside the calibration entry `entry`
    (anyrec.history.hstu_records), or measured now by every rank at once (as the job's ranks will run
    them) and kept (rank 0's figures); None for other models."""
    shape = resolve_family(cfg.model).workload_facts(cfg.model).hstu
    if shape is None:
        return None
    backend, info = runtime.backend, runtime.dist
    impl = backend.select_kernels(cfg.backend)[ATTENTION_OP]
    batch = resolve_batch_size(cfg.data, info.world_size).batch_size
    half = precision == Precision.bf16  # measured in the precision the job runs, and so is costed, in
    # rank 0 looks the record up and writes it: the key is its own
    key = hstu_record_key(entry, impl.name, half, shape, batch) if info.is_main else ""
    path = record_path(key)

    def recorded() -> dict | None:
        if not info.is_main or cfg.trainer.calibrate == "always":
            return None
        rate = read_record(path, key)
        return dataclasses.asdict(rate) if rate is not None else None

    found = agreement.decide("HSTU record", recorded)
    if found is not None:
        if info.is_main:
            logger.info("calibration: HSTU kernels (attention %s) at this job's shapes from %s", impl.name,
                        path)
        return HSTURates(**found)
    fn = impl.build()
    model = dlrmv4_config(cfg.model)
    with torch.device(runtime.device):  # its draws precede the trainer's seeding (Trainer.build)
        dense = DenseUnderTest(HSTUDense(model, fn), model.table_dim)
    mine = measure_hstu(fn, impl.name, shape, batch, half, backend, runtime.device,
                        cfg.trainer.calibrate_budget_s, dense=dense)
    stamp = time.strftime("%Y-%m-%d", time.gmtime())
    mine = dataclasses.replace(mine, source=f"measured on first contact ({backend.describe()}, "
                                            f"{info.world_size} ranks at once) on {stamp}")
    rate = HSTURates(**agreement.decide("HSTU measured", lambda: dataclasses.asdict(mine)))
    if info.is_main:
        try:
            write_record(path, key, rate)
            kept = f"kept in {path}"
        except OSError as e:
            kept = f"not kept ({e})"
        logger.info("calibration: HSTU kernels measured at this job's shapes (%d samples of %s, %d heads): "
                    "the whole dense part %.1f ms forward + backward; attention %s %.1f ms per layer (%.2f "
                    "GFLOP/s), GEMMs %.1f GFLOP/s, elementwise %.1f GB/s; %s", batch, lengths_text(shape),
                    shape.num_heads, rate.dense_step_s * 1e3, impl.name, rate.step_s * 1e3,
                    rate.flops_per_s / 1e9, rate.gemm_flops_per_s / 1e9,
                    rate.elementwise_bw_bytes_per_s / 1e9, kept)
    return rate


def _look_up(cfg: AnyrecConfig, key: CacheKey, cores: tuple[int, ...],
             signing_key: SigningKey | None) -> list:
    """Rank 0's view of the cache: [path, hit, problem, bound the entry was measured with]."""
    found = (Lookup(cache_dir() / key.file_name()) if cfg.trainer.calibrate == "always"
             else lookup(key, signing_key=signing_key))
    hit, problem = found.hit, found.problem
    if found.distrust:  # measured on a busy host: measured again once the host is quiet
        problem = remeasure_untrusted(found.distrust, measure_core_load(cores))
        hit = problem is None
        if hit:
            logger.warning("calibration: the entry %s is not trusted (%s) and the host is still busy: "
                           "planning with it", found.path, found.distrust)
    return [str(found.path), hit, problem, found.bound]


def _cache_dir_problem() -> str:
    """Why this rank could not keep a measurement (check_cache_dir's line), or ''."""
    try:
        check_cache_dir()
    except ValueError as e:
        return str(e)
    return ""


def _find_or_measure(cfg: AnyrecConfig, runtime: Runtime, signing_key: SigningKey | None,
                     agreement: Agreement) -> str:
    backend, info, cores = runtime.backend, runtime.dist, runtime.cores
    # what the binding rule chose (backend.bind_cores=auto looks at the cores' load), once for the process:
    # the step points' trainers and this job's trainer run with it
    bound = runtime.bound
    key = local_key(backend, info, cores, runtime.binding.threads)
    path, hit, problem, measured_bound = agreement.decide(
        "cache lookup", lambda: _look_up(cfg, key, cores, signing_key) if info.is_main else None)
    threads = {True: "bound", False: "free"}
    if hit:
        if info.is_main:
            differs = (f" (measured with threads {threads[measured_bound]}, this run's are {threads[bound]}: "
                       f"its step costs may differ)" if measured_bound not in (None, bound) else "")
            logger.info("calibration: cache hit, planning with %s%s", path, differs)
        return path
    # before a measurement whose result could not be kept: any rank's folder that cannot be written stops all
    unwritable = agreement.decide("cache folder writable", _cache_dir_problem, "max")
    if unwritable:
        raise ValueError(unwritable)
    if problem and info.is_main:
        logger.warning("calibration cache file %s not used: %s; measuring again", path, problem)
    start = time.perf_counter()
    run = CalibrationRun.begin(cfg.calibrate.time_limit_s, info.rank, info.world_size, cfg.trainer.progress,
                               cfg.trainer.collective_timeout_s, agreement, started=runtime.started)
    try:
        with log_file_only():  # the point-by-point log: the console's is the thorough calibration's
            calibration = calibrate(runtime, "quick", cfg.trainer.calibrate_budget_s, run)
    except CalibrationStopped as e:
        exit_stopped("anyrec-train", e, info.is_main)
    finally:
        run.close()
    if info.is_main:
        # the job plans with these figures either way: it runs on this host as it is
        report_trust(calibration.measurements)

    def written() -> str | None:
        if not info.is_main:
            return None
        header = (f"# Quick calibration measured by anyrec.calibration.first_contact ({backend.describe()}, "
                  f"{info.world_size} ranks) on {time.strftime('%Y-%m-%d', time.gmtime())}; a cache entry,\n"
                  f"# used by hardware=auto on this machine and software (`cache:` below).\n")
        write_entry(Path(path), key, hardware_yaml(backend, calibration), header, signing_key)
        return Path(path).read_text()

    text = agreement.decide("the file written", written)
    if info.host != 0 and info.local_rank == 0:  # the other hosts' ranks read the same file
        with atomic_write(path) as f:
            f.write(text)
    agreement.decide("the file in place on every host", lambda: None)  # nobody reads it before
    if info.is_main:
        logger.info("calibration: %s, measured in %.1f s with threads %s, wrote %s",
                    "re-measured (trainer.calibrate=always)" if cfg.trainer.calibrate == "always"
                    else "cache miss", time.perf_counter() - start, threads[bound], path)
    return path

"""`python -m anyrec.calibrate calibrate.output=FILE.yaml`: measure what the planner costs, write a
hardware YAML (for `hardware.sku=FILE.yaml`); options are the config's `calibrate` section.

The measurements are anyrec.calibration.measure's (under torchrun with collectives and the trainer's
framework costs at that world size). Within `calibrate.time_limit_s` of the job's start, stopped by
SIGINT/SIGTERM/SIGHUP with nothing written (anyrec.calibration.run); its last line says whether the
figures are this machine's (anyrec.history.trust).

    python -m anyrec.calibrate calibrate.output=cal.yaml [calibrate.budget_s=0.5] [calibrate.time_limit_s=100]
    torchrun --nproc_per_node=2 -m anyrec.calibrate calibrate.cache=true  # the entry hardware=auto reads
"""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig

from anyrec import _hydra
from anyrec.calibration.measure import calibrate, format_table, hardware_yaml, report_trust
from anyrec.calibration.run import CalibrationRun, CalibrationStopped, exit_stopped
from anyrec.config import AnyrecConfig
from anyrec.history.cache import cache_dir, local_key, write_entry
from anyrec.io_checks import writable_file, write_yaml
from anyrec.runtime.agreement import Agreement
from anyrec.runtime.clock import launch_started
from anyrec.runtime.distributed import close_runtime, start_runtime
from anyrec.signing import resolve_key


def run(cfg: AnyrecConfig, started: float | None = None) -> None:
    """Calibrate with a composed config: the `calibrate` section, `backend.name`, `backend.bind_cores`."""
    opts = cfg.calibrate
    if not opts.output and not opts.cache:
        raise ValueError("calibrate.output=FILE.yaml is required (or calibrate.cache=true)")
    writable_file(opts.output, "calibrate.output")
    signing_key = resolve_key(cfg.trainer.signing_key_file)  # signs the cache entry
    # Ranks take their share of the host's cores as the trainer's do: the figures are the trainer's;
    # what the rule chose (auto) or was told, the step points' trainers run with.
    runtime = start_runtime(cfg.backend.name, cfg.backend.bind_cores, cfg.trainer.collective_timeout_s,
                            cfg.trainer.peer_timeout_s, cfg.backend.threads, started=started)
    backend, info = runtime.backend, runtime.dist
    rank, world = info.rank, info.world_size
    run = CalibrationRun.begin(opts.time_limit_s, rank, world, progress=True,
                               agreement=Agreement.begin(rank, world, "calibration"), started=runtime.started)
    try:
        start = time.perf_counter()
        kernels = backend.select_kernels()
        calibration = calibrate(runtime, opts.size, opts.budget_s, run).timed(time.perf_counter() - start)
        run.close()
        if rank == 0:
            report_trust(calibration.measurements)
        # a collective
        key = local_key(backend, info, runtime.cores, runtime.binding.threads) if opts.cache else None
        run.check()  # a signal now still leaves nothing written
        if rank == 0 and key is not None:
            entry = write_entry(cache_dir() / key.file_name(), key, hardware_yaml(backend, calibration),
                                f"# Calibration measured by anyrec.calibrate ({backend.describe()}, {world} "
                                f"ranks, size={opts.size}); a cache entry used by hardware=auto.\n",
                                signing_key)
            print(f"wrote the cache entry for this machine: {entry}", flush=True)
        if rank == 0 and opts.output:
            out = Path(opts.output)
            header = (f"# Hardware spec measured by anyrec.calibrate ({backend.describe()}, kernels "
                      f"{kernels}) on {time.strftime('%Y-%m-%d', time.gmtime())}.\n"
                      f"# Units are in the key names (_s seconds, _bytes_per_s bytes/s, _flops FLOP/s).\n"
                      f"# Use with: hardware.sku={out.resolve()}\n")
            write_yaml(out, hardware_yaml(backend, calibration), header)
            print(format_table(calibration.measurements))
            print(f"wrote {out} in {calibration.measurements.seconds:.1f} s", flush=True)
    except CalibrationStopped as e:
        exit_stopped("anyrec.calibrate", e, rank == 0)
    finally:
        run.close()
        close_runtime(runtime)


def main(cfg: DictConfig, started: float | None = None) -> None:
    """The calibration of a composed config; a user mistake is one line and exit status 2. `started`: when
    the job began (calibrate.time_limit_s counts from it; None: from now)."""
    _hydra.run_typed("anyrec.calibrate", lambda typed: run(typed, started), cfg)


def cli(argv: list[str] | None = None) -> None:
    """Console entry: the command line (or `argv`) under Hydra's runner (`_hydra.launch`). The time limit
    counts from the command's start (its launcher's, under torchrun); given `argv` (a call within a
    running program), from the call."""
    started = launch_started() if argv is None else None

    def job(cfg: DictConfig) -> None:  # this module's: Hydra names the job after it
        main(cfg, started)

    _hydra.launch("anyrec.calibrate", job, argv)


if __name__ == "__main__":
    cli()

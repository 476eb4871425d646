"""`anyrec-train` / `torchrun ... -m anyrec.train`: train a model from Hydra config groups."""
# ruff: noqa: E402  (the launcher watch starts before the imports, which take seconds)

from __future__ import annotations

from anyrec.runtime.errors import watch_launcher

watch_launcher()  # a worker whose torchrun dies while it imports or starts up leaves too

import json
import logging
import os
import signal
import sys
import traceback

from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.errors import record

from anyrec import _hydra
from anyrec.io_checks import writable_dir
from anyrec.runtime.errors import NonFiniteLossError, PeerLostError, say_line, write_error_file

logger = logging.getLogger("anyrec.train")
# Exit statuses without torchrun (README, "Exit codes"): 2 a user or data mistake, 3 a diverged run,
# 4 a lost peer; 128 + N after signal N stopped the run. Anything else is a bug (a traceback, 1).
EXIT_CODES = {NonFiniteLossError: 3, PeerLostError: 4}


def run(cfg: DictConfig, started: float | None = None) -> dict:
    """Train with a composed config; rank 0 prints the JSON summary as its last stdout line. `started`: when
    the job began (a first contact's calibrate.time_limit_s counts from it; None: from now)."""
    # torchrec (the trainer, and calibration, which trains) loads once Hydra has parsed the command line
    from anyrec.calibration.first_contact import calibrated_hardware, wants_calibration  # torchrec: late
    from anyrec.runtime.distributed import close_runtime, start_runtime  # after the command line
    from anyrec.runtime.shutdown import peer_failure, peers_met  # with the trainer, after Hydra parsed argv
    from anyrec.trainer.trainer import Trainer  # torchrec loads once Hydra has parsed the command line

    config = _hydra.to_object(cfg)  # every value checked (anyrec.config.check_values)
    if config.trainer.run_dir is None:
        config.trainer.run_dir = _hydra.run_folder()
    config.trainer.checkpoint.dir = _hydra.per_job_dir(config.trainer.checkpoint.dir)
    writable_dir(config.trainer.checkpoint.dir, "trainer.checkpoint.dir")
    writable_dir(config.trainer.run_dir, "trainer.run_dir")
    # The backend, the process group and this rank's core binding: once, for calibration and training.
    tc = config.trainer
    runtime = start_runtime(config.backend.name, config.backend.bind_cores, tc.collective_timeout_s,
                            tc.peer_timeout_s, config.backend.threads, started=started)
    hardware = None  # the Trainer resolves `hardware.sku` itself
    try:
        # the dense part's precision, resolved once: first contact measures an HSTU model's kernels in it,
        # the plan is costed in it and the step runs in it
        precision = runtime.backend.dense_precision(tc.mixed_precision)
        if wants_calibration(config):  # hardware=auto: this machine's cached figures, measured on a miss
            hardware = calibrated_hardware(config, runtime, precision)
        trainer = Trainer(config, runtime=runtime, hardware=hardware, precision=precision)
    except BaseException as e:
        # No Trainer owns the runtime to close it (a bad checkpoint, a failed calibration): take the group
        # and the heartbeat down here. A heartbeat thread left in the store's C++ code when the
        # interpreter exits aborts the process ("terminate called without an active exception").
        traceback.clear_frames(e.__traceback__)  # the half-built Trainer's model goes before the group
        close_runtime(runtime, barrier=peers_met(runtime.dist.rank, runtime.dist.world_size))  # bounded wait
        raise
    try:
        summary = trainer.train()
    except BaseException as e:
        # A peer may be gone: name it (before the group goes) and do not wait for it in close(). An
        # error only this rank saw (bad data it read) leaves its peers in a collective: exit now; a
        # process alone has no peer to wait for and closes as after any other error.
        info, timeout_s = trainer.dist, config.trainer.collective_timeout_s
        lost = peer_failure(e, info.rank, info.world_size, timeout_s) if isinstance(e, Exception) else None
        if not getattr(e, "rank_local", False) or info.world_size == 1:
            trainer.close(failed=True)
        if lost:
            raise PeerLostError(lost) from None
        raise
    is_main = trainer.dist.is_main
    trainer.close()
    if is_main:
        sys.stdout.flush()
        print(json.dumps(summary), flush=True)
    return summary


@record  # under torchrun: an unexpected exception's traceback goes to torchrun's error report
def main(cfg: DictConfig, started: float | None = None) -> None:
    """The job of a composed config; exits with the statuses `EXIT_CODES` names."""
    try:
        summary = run(cfg, started)
    except (ValueError, NonFiniteLossError, PeerLostError) as e:
        # A user mistake, bad data, a bad checkpoint or a diverged run: every rank raises the same
        # error at the same point; rank 0 says it in one line, all exit non-zero. Bad rows are seen
        # by the reading rank alone, a lost peer differently by each survivor: each says its own.
        line = f"anyrec-train: error: {e}"
        if os.environ.get("RANK", "0") == "0" or getattr(e, "rank_local", False) or \
                isinstance(e, PeerLostError):
            say_line(line)
        else:
            logger.error("%s", e)
        write_error_file(line)
        sys.exit(EXIT_CODES[type(e)] if type(e) in EXIT_CODES else 2)
    except KeyboardInterrupt:  # SIGINT before or after the step loop (in it, the loop stops cleanly)
        sys.exit(128 + signal.SIGINT)
    if summary.get("stopped_by"):  # SIGINT/SIGTERM: stopped at a step boundary, as a shell expects
        # Everything is saved and closed; skip the interpreter's teardown (seconds with torch loaded):
        # whoever sent the signal is waiting for the process to go.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signal.Signals[summary["stopped_by"]])


def cli() -> None:
    """Console entry: the job under Hydra's runner (`_hydra.launch`), one line and exit 2 for a mistake;
    a first contact's time limit counts from the command's start (its launcher's, under torchrun)."""
    from anyrec.runtime.clock import launch_started  # no torch: --help stays quick

    started = launch_started()

    def job(cfg: DictConfig) -> None:  # this module's: Hydra names the job after it
        main(cfg, started)

    _hydra.launch("anyrec-train", job)


if __name__ == "__main__":
    cli()

"""Run one training script under torchrun with `TrainPipelineSparseDist.progress` timed; one JSON per rank.

    python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/progress_runner.py \\
        --out DIR -- anyrec model=dlrm_small trainer.steps=200 ...
    python -m torch.distributed.run ... benchmarks/progress_runner.py --out DIR -- \\
        script /path/to/dlrm/torchrec_dlrm/dlrm_main.py --batch_size 256 ...

`benchmarks/vs_reference.py` launches it for both contenders, so both are timed by the same code at the
same call: the wrapper patches torchrec's `TrainPipelineSparseDist.progress` at runtime (subclasses,
such as anyrec's pipeline, inherit it) and records the start and end of every call made in training
mode (evaluation's calls are left out). The script runs unmodified (`anyrec`: `anyrec.train`'s CLI;
`script`: any file, run as `__main__` with its own folder first on sys.path). Each rank writes
`DIR/rank<R>.json`: {"calls": [[start_s, end_s], ...], "cpu": the process's CPU seconds (all its
threads) at the same starts and ends, "bind": what anyrec's core-binding rule chose
(null for a script), "exit": the script's exit status}.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from pathlib import Path

from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

CALLS: list[tuple[float, float]] = []
CPU: list[tuple[float, float]] = []  # the process's CPU time (all its threads) at each call's start and end
BIND: list[str] = []


def _timed(progress):
    def wrapper(self, dataloader_iter):
        training = self._model.training
        start, cpu = time.perf_counter(), time.process_time()
        out = progress(self, dataloader_iter)  # StopIteration passes through untimed
        if training:
            CALLS.append((start, time.perf_counter()))
            CPU.append((cpu, time.process_time()))
        return out
    return wrapper


def _record_binding() -> None:
    """Keep what anyrec's CPU backend decided about binding (its reason string) for the result."""
    from anyrec.backends.cpu import CPUBackend

    bind = CPUBackend.bind_local_rank

    def wrapper(self, *args, **kwargs):
        share = bind(self, *args, **kwargs)
        choice = getattr(self, "bind_choice", None)
        BIND.append(choice.describe() if choice is not None else "nothing to bind")
        return share
    CPUBackend.bind_local_rank = wrapper


def _run(kind: str, rest: list[str]) -> int:
    # this folder (first on sys.path, as the launched file's) must not shadow the script's modules:
    # benchmarks/data.py against the reference's data/ package
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != here]
    if kind == "anyrec":
        _record_binding()
        sys.argv = ["anyrec-train", *rest]
        target = ("module", "anyrec.train")
    else:
        if not rest or not Path(rest[0]).is_file():
            raise SystemExit(f"progress_runner.py: error: no script {rest[0] if rest else '(none given)'}")
        script = str(Path(rest[0]).resolve())
        sys.path.insert(0, str(Path(script).parent))
        sys.argv = [script, *rest[1:]]
        target = ("path", script)
    try:
        if target[0] == "module":
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target[1], run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    head, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        description="Time TrainPipelineSparseDist.progress in a training script run under torchrun "
                    "(usage: progress_runner.py --out DIR -- anyrec OVERRIDES... | -- script FILE ARGS...)")
    parser.add_argument("--out", type=Path, required=True, help="folder for rank<R>.json")
    args = parser.parse_args(head)
    if not rest or rest[0] not in ("anyrec", "script"):
        parser.error("after --, name the contender: anyrec OVERRIDES... or script FILE ARGS...")
    TrainPipelineSparseDist.progress = _timed(TrainPipelineSparseDist.progress)
    code = _run(rest[0], rest[1:])
    rank = int(os.environ.get("RANK", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"calls": CALLS, "cpu": CPU, "bind": BIND[0] if BIND else None, "exit": code}
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    return code


if __name__ == "__main__":
    sys.exit(main())

"""Two ranks decide and compile the dense model (trainer.compile=true) under a collective timeout shorter
than one rank's whole compile: a torch.compile backend that takes SLOW_S seconds a graph. Every rank
compiles at once, so none waits out another's compile in a collective. Rank 0 prints one JSON line: the
decision, the seconds compile_dense took and the graphs rank 0 compiled.

Usage: torchrun --standalone --nproc_per_node=2 compile_check.py TIMEOUT_S SLOW_S RECORDS_DIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from anyrec.choices import Switch
from anyrec.models.dlrm import build_model
from anyrec.runtime.distributed import close_runtime, start_runtime
from anyrec.trainer.compile import compile_dense
from anyrec.trainer.trainer import DLRMTrain

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import compose_config  # noqa: E402

TINY = ["model=dlrm_tiny", "backend=cpu", "backend.embedding_kernel=torch"]


def main(timeout_s: float, slow_s: float, records: Path) -> None:
    graphs = []

    def slow(gm: torch.fx.GraphModule, example_inputs):  # a compile that takes slow_s a graph
        graphs.append(gm)
        time.sleep(slow_s)
        return gm.forward

    runtime = start_runtime("cpu", bind_cores=Switch.false, timeout_s=timeout_s)
    try:
        _, cfg = compose_config(TINY)
        torch.manual_seed(0)
        model = DLRMTrain(build_model(cfg.model, torch.device("cpu")))
        start = time.perf_counter()
        decision = compile_dense(model, cfg.model, runtime.backend, runtime.device, Switch.true, 10, 32,
                                 False, runtime.dist, records, compiler=slow)
        took = time.perf_counter() - start
        if runtime.dist.is_main:
            print(json.dumps({"compiled": decision.compiled, "reason": decision.reason, "seconds": took,
                              "graphs": len(graphs)}), flush=True)
    finally:
        close_runtime(runtime)


if __name__ == "__main__":
    main(float(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3]))

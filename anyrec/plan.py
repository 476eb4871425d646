"""`anyrec-plan` / `python -m anyrec.plan`: plan a job's sharding offline, for any hardware.

    anyrec-plan model=dlrmv2 optim=adagrad hardware=mi350x topology.world_size=8
    anyrec-plan model=dlrmv2 hardware=mi350x plan.compare=b200 plan.output=plan.json plan.plot=plan.png
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from anyrec import _hydra
from anyrec.config import AnyrecConfig, check_values, config_dir, to_object


def run(cfg: AnyrecConfig, print_fn=print):
    """Plan, print the report (and the comparison), write plan.output / plan.plot."""
    from anyrec.backends import get_backend, resolve_hardware
    from anyrec.io_checks import writable_file
    from anyrec.models.dlrm import dense_param_count
    from anyrec.planner.cli import run_plan
    from anyrec.planner.job import plan_options, tables_from_model

    check_values(cfg)
    writable_file(cfg.plan.output, "plan.output")
    writable_file(cfg.plan.plot, "plan.plot")
    backend = get_backend(cfg.backend.name) if cfg.hardware.sku == "auto" else None
    device = resolve_hardware(cfg.hardware.sku, cfg.hardware.spec, backend)
    compare = resolve_hardware(cfg.plan.compare) if cfg.plan.compare else None
    if cfg.topology.world_size < 1:
        raise ValueError(f"topology.world_size must be >= 1, got {cfg.topology.world_size}")
    return run_plan(
        tables_from_model(cfg.model), device, cfg.topology.world_size, cfg.topology.local_world_size,
        cfg.plan.batch_size or cfg.data.batch_size, cfg.optim.name, dense_param_count(cfg.model),
        output=cfg.plan.output, plot=cfg.plan.plot, compare=compare, print_fn=print_fn,
        **plan_options(cfg.planner, cfg.backend.embedding_kernel if cfg.backend.embedding_kernel != "auto"
                       else "fbgemm"),
    )


_hydra.setup()


@hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        run(to_object(cfg))
    except ValueError as e:  # infeasible plans and user mistakes: one line, non-zero exit
        print(f"anyrec-plan: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def cli() -> None:
    """Console entry: `hardware=FILE.yaml` is accepted as well as `hardware.sku=FILE.yaml`."""
    from anyrec.backends import rewrite_hardware_argv

    sys.argv = rewrite_hardware_argv(sys.argv)
    main()


if __name__ == "__main__":
    cli()

"""Calibration: this machine's figures, measured, cached and checked, for the planner to cost with.

One module per role: `measure` (the measurements and their fits), `step` (the trainer's framework costs,
from real training steps), `run` (a run's time limit, stop signals and progress), `trust` (whether the
figures are this machine's), `cache` (entries per machine and software), `core_load` (the cores' load,
which also decides core binding), `first_contact` (a `hardware=auto` job's calibration) and `steplearn`
(each run's measured step, for the next prediction). The command is `anyrec.calibrate`.
"""

# The backends read this package's file format and core-load sampler: importing them first gives one
# import order whichever module of either package a program imports first.
import anyrec.backends  # noqa: F401

"""Calibration: this machine's figures, measured, for the planner to cost with.

One module per role: `measure` (the measurements and their fits), `step` (the trainer's framework costs,
from real training steps), `run` (a run's time limit, stop signals and progress), `fileformat` (a
hardware file checked whole) and `first_contact` (a `hardware=auto` job's calibration). What the
measurements leave for later runs (the cache, trust verdicts, step corrections) is `anyrec.history`; the
command is `anyrec.calibrate`.
"""

# backends/hardware.py still reads this package's file format, the one import arrow left pointing up
# (tests/test_imports.py PENDING_ARROWS): importing the backends first gives one import order whichever
# of the two a program imports first. This line goes with that arrow, when the format moves below.
import anyrec.backends  # noqa: F401

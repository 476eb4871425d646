"""Calibration: this machine's figures, measured, for the planner to cost with.

One module per role: `measure` (a package: the device, embedding and collective measurements, their
timing and fits, the whole run and its report), `step` (the trainer's framework costs, from real
training steps), `run` (a run's time limit, stop signals and progress) and `first_contact` (a
`hardware=auto` job's calibration). The hardware file's schema is `anyrec.backends.hardware_file`; what
the measurements leave for later runs (the cache, trust verdicts, step corrections) is `anyrec.history`;
the command is `anyrec.calibrate`.
"""

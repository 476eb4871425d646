"""What the machine remembers between runs, in anyrec's cache folder (`$ANYREC_CACHE_DIR`).

`cache` (calibrated hardware files per machine and software), `trust` (whether a calibration's figures
are the machine's), `steplearn` (each run's measured step against the prediction, for the next one). The
files are read and written here; what they hold is measured by `anyrec.calibration` and the trainer.
"""

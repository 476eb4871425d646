"""The calibration's measurements: what the planner costs, measured on this device and fitted in the
planner's own terms, as a hardware file's typed `Measurements` (anyrec.backends.hardware_file) and the
DeviceSpec fields they set.

One module per thing measured: `device` (copy, host->device, GEMM and DLRM-MLP FLOP/s), `embedding` (each
embedding implementation's steps fitted into its KernelProfile), `collectives` (the world's and 2D's
sub-groups'); `timing` (timing and fitting, shared), `phases` (a whole calibration, phase by phase, and
its hardware file) and `report` (the table and the trust line). The trainer's framework costs are
anyrec.calibration.step's. `anyrec.calibrate` (the command) and the calibration on first contact
(anyrec.calibration.first_contact) both measure with `calibrate`.
"""

from anyrec.calibration.measure.phases import Calibration, calibrate, hardware_yaml
from anyrec.calibration.measure.report import format_table, report_trust

__all__ = ["Calibration", "calibrate", "format_table", "hardware_yaml", "report_trust"]

"""simdev: a simulated accelerator for anyrec, brought up through public PyTorch extension points.

Importing the package registers the device (`torch.device("simdev")`, `torch.simdev`), its ATen
kernels and its `torch.distributed` backend; `anyrec_simdev.backend.SimdevBackend` is the anyrec
backend, found through the `anyrec.backends` entry point.
"""

from anyrec_simdev import device, distributed

device.register()
distributed.register()

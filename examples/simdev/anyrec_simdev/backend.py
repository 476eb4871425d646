"""anyrec's backend for simdev: the device, its collectives, its figures and its kernels.

Found through the `anyrec.backends` entry point (pyproject.toml); importing it registers the device.
"""

from __future__ import annotations

import logging
import os

import torch

import anyrec_simdev  # noqa: F401 - registers the device, its kernels and its process-group backend
from anyrec.backends.interface import Backend, DeviceFacts
from anyrec.backends.specs import DeviceSpec
from anyrec_simdev import module
from anyrec_simdev.allocator import ALLOC_CONF_ENV, DEFAULT_CAPACITY_BYTES, parse_alloc_conf
from anyrec_simdev.device import NAME, allocators, capacity_bytes, set_allocator_settings

logger = logging.getLogger(__name__)

# Made-up but plausible figures (a mid-range accelerator); the planner costs plans with them. Its
# memory is replaced by the capacity the device enforces (SIMDEV_MEMORY_BYTES), so plans see that.
SPEC = DeviceSpec(
    name="SimDev-1", vendor="simulated", arch="sim1", memory_bytes=DEFAULT_CAPACITY_BYTES,
    memory_bw_bytes_per_s=1.2e12, peak_bf16_flops=200e12, peak_fp32_flops=25e12, simd_width=32,
    scale_up_bw_bytes_per_s=100e9, scale_out_bw_bytes_per_s=12.5e9, h2d_bw_bytes_per_s=25e9,
    host_memory_bytes=128 * 2**30, host_memory_bw_bytes_per_s=50e9,
    runtime_reserved_bytes=0,  # the simulated allocator owns the whole capacity: no runtime context
    auto_precision="fp32",  # no bf16 autocast: the dense part runs in fp32 (trainer.mixed_precision=auto)
    source="simulated device: made-up figures, not a measurement of any hardware",
)


class SimdevBackend(Backend):
    """The simulated accelerator: device `simdev`, collectives by the `simdev` process-group backend."""

    name = NAME
    device_type = NAME
    dist_backend = NAME  # the simdev process group (gloo underneath)
    auto_detect = False  # a simulation is chosen by name (backend=simdev), never found on a machine
    # No FBGEMM or Triton for this device: anyrec's torch TBE and portable sparse ops.
    kernel_order = {
        "embedding": ("torch",),
        "interaction": ("torch",),
        "dcn_cross": ("torch",),
        "collectives": ("gloo",),
        "sparse_ops": ("portable",),
    }

    @classmethod
    def probe_facts(cls) -> DeviceFacts:
        return DeviceFacts(device_count=module.device_count(), device_name=module.get_device_name(),
                           arch=SPEC.arch, memory_bytes=capacity_bytes(), multiprocessors=1)

    @classmethod
    def matches(cls, facts: DeviceFacts) -> bool:
        return facts.device_name == module.get_device_name() and facts.device_count > 0

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device(NAME, 0)  # one simulated device per process

    def set_device(self, local_rank: int = 0) -> None:
        # The planner models expandable segments (anyrec.planner.memory): switched on before the first
        # allocation, as the CUDA and ROCm backends do, unless SIMDEV_ALLOC_CONF turns them off.
        if "expandable_segments" in parse_alloc_conf(os.environ.get(ALLOC_CONF_ENV, "")):
            if not allocators()[0].expandable:
                logger.warning("%s turns expandable segments off: the planner's reserved-memory prediction "
                               "assumes them, so an accepted plan may run out of memory", ALLOC_CONF_ENV)
        else:
            set_allocator_settings("expandable_segments:True")
        module.set_device(0)

    def synchronize(self) -> None:
        module.synchronize()

    def memory_allocated(self) -> int:
        return module.memory_allocated()

    def max_memory_allocated(self) -> int:
        return module.max_memory_allocated()

    def memory_reserved(self) -> int:
        return module.memory_reserved()

    def max_memory_reserved(self) -> int:
        return module.max_memory_reserved()

    def memory_capacity_bytes(self) -> int:
        return module.mem_get_info()[1]

    def memory_stats(self) -> dict[str, int]:
        return module.memory_stats()

    def reset_peak_memory_stats(self) -> None:
        module.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        module.empty_cache()

    def device_spec(self) -> DeviceSpec:
        return SPEC.replace(memory_bytes=capacity_bytes())

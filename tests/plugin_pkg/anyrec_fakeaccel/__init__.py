"""A fake accelerator for anyrec's plugin test: one Backend class that runs on the host.

Everything a real port provides is here in miniature: facts, detection, a torch device, a
collectives library, a DeviceSpec of its own and the kernel order per op (sparse ops included, so
it trains sharded with `backend.embedding_kernel=torch backend.sparse_ops=portable`).
"""

from __future__ import annotations

import torch

from anyrec.backends.interface import Backend, DeviceFacts
from anyrec.backends.specs import DeviceSpec

SPEC = DeviceSpec(
    name="FakeAccel-1", vendor="fake", arch="fake1", memory_bytes=8 * 10**9,
    memory_bw_bytes_per_s=100e9, peak_bf16_flops=10e12, peak_fp32_flops=5e12, simd_width=16,
    scale_up_bw_bytes_per_s=50e9, scale_out_bw_bytes_per_s=12.5e9, h2d_bw_bytes_per_s=25e9,
    source="made up for the plugin test",
)


class FakeAccelBackend(Backend):
    """Pretends to be an accelerator; tensors live on the CPU, gloo does the collectives."""

    name = "fakeaccel"
    device_type = "cpu"
    dist_backend = "gloo"
    kernel_order = {
        "embedding": ("fbgemm", "torch"),
        "interaction": ("torch",),
        "dcn_cross": ("torch",),
        "collectives": ("gloo",),
        # torchrec's KJT permutes and bucketisation: FBGEMM's kernels if it has them for the device,
        # else anyrec's portable ones (what a device with no FBGEMM build relies on to shard).
        "sparse_ops": ("fbgemm", "portable"),
    }

    @classmethod
    def probe_facts(cls) -> DeviceFacts:
        return DeviceFacts(device_count=1, device_name="FakeAccel 1", arch="fake1",
                           memory_bytes=SPEC.memory_bytes, multiprocessors=1)

    @classmethod
    def matches(cls, facts: DeviceFacts) -> bool:
        return facts.device_name.startswith("FakeAccel")

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def device_spec(self) -> DeviceSpec:
        return SPEC

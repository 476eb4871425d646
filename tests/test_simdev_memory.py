"""simdev's capacity and memory statistics on real device tensors, through torch.simdev and anyrec's
Backend, in a process of its own (importing the plugin registers the device): SIMDEV_MEMORY_BYTES sets the
capacity the device enforces and the spec the planner plans with; past it, torch.OutOfMemoryError."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import single_process_env

pytestmark = pytest.mark.integration

MiB = 1 << 20
CHECK = r'''
import json, sys
import torch
from anyrec.backends import get_backend

b = get_backend("simdev")
dev = torch.get_device_module("simdev")
out = {"spec": b.device_spec().memory_bytes, "facts": b.facts.memory_bytes,
       "capacity": b.memory_capacity_bytes()}
x = torch.empty(1, device="simdev")  # 4 bytes: one 512-byte block in a 2 MiB segment
out["one_float"] = [b.memory_allocated(), b.memory_reserved()]
y = torch.empty(3 << 20, dtype=torch.uint8, device="simdev")
out["large"] = [b.memory_allocated(), b.memory_reserved()]
del y
out["freed"] = [b.memory_allocated(), b.memory_reserved(), b.max_memory_allocated(), b.max_memory_reserved()]
b.empty_cache()
out["emptied"] = b.memory_reserved()
b.reset_peak_memory_stats()
out["reset"] = [b.max_memory_allocated(), b.max_memory_reserved()]
out["module_agrees"] = dev.memory_stats()["allocated_bytes.all.current"] == b.memory_stats()[
    "allocated_bytes.all.current"] == dev.memory_allocated() == b.memory_allocated()
z = torch.ones(20 << 20, dtype=torch.uint8, device="simdev")
out["ooms"] = {}
for name, make in (("empty", lambda: torch.empty(1 << 46, dtype=torch.uint8, device="simdev")),
                   ("copy", lambda: torch.zeros(50 << 20, dtype=torch.uint8).to("simdev")),
                   ("op", lambda: torch.cat([z, z, z]))):
    before = b.memory_allocated()
    try:
        make()
        out["ooms"][name] = "no error"
    except torch.OutOfMemoryError as e:
        out["ooms"][name] = [str(e), b.memory_allocated() == before]
out["num_ooms"] = b.memory_stats()["num_ooms"]
print(json.dumps(out))
'''


def test_capacity_statistics_and_out_of_memory_on_device_tensors(simdev_site):
    env = {**single_process_env(simdev_site), "SIMDEV_MEMORY_BYTES": str(64 * MiB)}
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["spec"] == out["facts"] == out["capacity"] == 64 * MiB  # the planner sees what is enforced
    assert out["one_float"] == [512, 2 * MiB]
    assert out["large"] == [512 + 3 * MiB, 2 * MiB + 20 * MiB]  # under 10 MiB: a 20 MiB buffer
    assert out["freed"] == [512, 22 * MiB, 512 + 3 * MiB, 22 * MiB]  # the large segment stays cached
    assert out["emptied"] == 2 * MiB and out["reset"] == [512, 2 * MiB] and out["module_agrees"]
    ooms = out["ooms"]
    # Checked before the host bytes are allocated: the host allocator (which cannot give 64 TiB) never ran.
    assert ooms["empty"][0].startswith("simdev out of memory: tried to allocate 65536.00 GiB (70368744177664 "
                                       "bytes) on simdev:0") and ooms["empty"][1]
    assert "; 42.00 MiB (44040192 bytes) free of 64.00 MiB (67108864 bytes) capacity" in ooms["empty"][0]
    assert ooms["copy"][0].startswith("simdev out of memory: tried to allocate 50.00 MiB") and ooms["copy"][1]
    assert ooms["op"][0].startswith("simdev out of memory: tried to allocate 60.00 MiB") and ooms["op"][1]
    assert out["num_ooms"] == 3


def test_a_bad_capacity_is_one_line(simdev_site):
    env = {**single_process_env(simdev_site), "SIMDEV_MEMORY_BYTES": "lots"}
    proc = subprocess.run([sys.executable, "-m", "anyrec.train", "backend=simdev", "model=dlrm_tiny",
                           "trainer.steps=1", "hydra.run.dir=."], env=env, capture_output=True, text=True,
                          timeout=120, cwd=simdev_site.parent)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "anyrec-train: error: SIMDEV_MEMORY_BYTES must be a positive whole number of bytes, got 'lots'")


EXPANDABLE = r'''
import json, logging
import torch
from anyrec.backends import get_backend

logging.basicConfig()
b = get_backend("simdev")
b.set_device(0)  # the backend's first step in every process: expandable segments on
x = torch.empty(30 << 20, dtype=torch.uint8, device="simdev")
print(json.dumps([b.memory_reserved(), b.memory_stats()["pages_in_use_bytes.all.current"]]))
'''


@pytest.mark.parametrize(("conf", "reserved"), [(None, 40 * MiB), ("expandable_segments:False", 30 * MiB)])
def test_the_backend_turns_expandable_segments_on_unless_told_not_to(simdev_site, conf, reserved):
    """set_device switches simdev's allocator to expandable segments (30 MiB: two 20 MiB pages, not a 30 MiB
    segment), which the planner's reserved model assumes; SIMDEV_ALLOC_CONF=...False keeps plain segments and
    warns."""
    env = {**single_process_env(simdev_site), **({"SIMDEV_ALLOC_CONF": conf} if conf else {})}
    proc = subprocess.run([sys.executable, "-c", EXPANDABLE], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got_reserved, pages_in_use = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got_reserved == reserved and pages_in_use == (reserved if conf is None else 0)
    assert ("turns expandable segments off" in proc.stderr) == (conf is not None)


def test_the_hstu_backward_peak_is_modelled_part_by_part(simdev_site):
    """dlrmv4_small's dense part in fp32 on the simulated device: the peak of one forward and backward,
    with the STU layers' selective recompute and without, within 5 % of the memory model's activation peak
    (every layer's kept tensors, the gradient arriving, and the largest of the last layer's three backward
    parts, each net of what the part before it freed). With the torch attention its padded buffers make the
    attention's part the largest; with an attention that keeps q, k, v (as the Triton kernel does), the UVQK
    part's."""
    check = Path(__file__).parent / "dist" / "hstu_peak_check.py"
    jobs = ["64:45:selective:torch", "32:20:none:torch", "64:45:selective:triton", "32:50:none:triton"]
    proc = subprocess.run([sys.executable, str(check), *jobs],
                          env=single_process_env(simdev_site), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert row["modelled"] == pytest.approx(row["measured"], rel=0.05), row

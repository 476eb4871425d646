"""The hardware file's schema (anyrec.backends.hardware_file, on anyrec.backends.records): every rule
refuses its bad input in one line naming the file and the place; what anyrec writes reads back as itself."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from anyrec.backends.hardware_file import (
    Collectives,
    HardwareFile,
    Link,
    Measurements,
    Subgroup,
    read_hardware_file,
)
from anyrec.backends.records import RecordError, from_data, parse, to_data

CAL = Path(__file__).parent / "data" / "calibration_cpu_2rank.yaml"
WHERE = "hardware file x.yaml"


def _link(latency: float = 1e-4, bw: float = 2e9) -> dict:
    return {"sizes_bytes": [1024, 65536], "seconds": [latency, latency + 65536 / bw], "latency_s": latency,
            "bus_bw_bytes_per_s": bw}


def _valid() -> dict:
    """A small whole file: a base SKU, a few measured figures of every kind."""
    step = {"fields": dict.fromkeys(("step_fixed_s", "step_per_feature_s", "step_per_sample_s",
                                     "step_per_id_s", "step_per_value_s", "step_per_pair_s",
                                     "step_per_dense_tensor_s", "sharding_group_s", "replicated_table_s"),
                                    1e-5),
            "steps_per_point": 10, "passes": 1, "points": [{"name": "table T8", "measured_s": 0.01}],
            "fit_max_rel_error": 0.1}
    measurements = {
        "copy_bw_bytes_per_s": 2e10,
        "gemm_flops": {"fp32": 1e11, "bf16": 2e11},
        "embedding": {"torch": {"profile": {"bw_efficiency": 0.5, "access_bytes": 32, "per_row_s": 1e-8,
                                            "source": "measured", "per_launch_s": 1e-4},
                                "fit_max_rel_error": 0.1},
                      "triton": {"skipped": "no compiler"}},
        "collectives": {"world_size": 4, "all_to_all": _link(), "all_reduce": {"skipped": "no op"}},
        "collectives_subgroups": {2: {"world_size": 4, "replicas": 2, "all_to_all": _link(),
                                      "all_reduce_replicas": _link()}},
        "step": step,
        "spread": {"copy": 0.01},
        "trust": {"trusted": True, "reasons": [], "other_cores": None, "cores": 2, "median_spread": 0.01},
        "measured_fields": ["memory_bw_bytes_per_s", "peak_fp32_flops", "peak_bf16_flops",
                            "scale_up_bw_bytes_per_s", "scale_up_latency_s", *step["fields"]],
    }
    spec = {"memory_bw_bytes_per_s": 2e10, "peak_fp32_flops": 1e11, "peak_bf16_flops": 2e11,
            "scale_up_bw_bytes_per_s": 2e9, "scale_up_latency_s": 1e-4, **step["fields"]}
    return {"sku": "cpu", "measurements": measurements, "spec": spec}


def _key(node, k: str):
    return int(k) if isinstance(node, list) or (k.isdigit() and int(k) in node) else k


def _set(path: str, value):
    """A change to a file's data: the value at dotted `path` set (or deleted, `_DELETE`)."""
    def change(data: dict) -> None:
        *parents, last = path.split(".")
        node = data
        for k in parents:
            node = node[_key(node, k)]
        if value is _DELETE:
            del node[_key(node, last)]
        else:
            node[_key(node, last)] = value
    return change


_DELETE = object()
M = "measurements"


# (change to a whole file, the one line it must fail with)
RULES = [
    # records: types, finiteness, ranges, nesting, unknown and missing keys, sizes
    (_set(f"{M}.gemm_flops", [1, 2]), "measurements.gemm_flops must be a mapping"),
    (_set(f"{M}.gemm_flops.fp64", 1e9), "measurements.gemm_flops: unknown field(s) fp64"),
    (_set(f"{M}.gemm_flops.bf16", _DELETE), "measurements.gemm_flops lacks bf16"),
    (_set(f"{M}.gemm_flops.fp32", "fast"),
     "measurements.gemm_flops.fp32 must be a finite number, got 'fast'"),
    (_set(f"{M}.gemm_flops.fp32", True), "measurements.gemm_flops.fp32 must be a finite number, got True"),
    (_set(f"{M}.gemm_flops.fp32", float("nan")), "measurements.gemm_flops.fp32 is not a finite number"),
    (_set(f"{M}.gemm_flops.fp32", 1e300),
     "measurements.gemm_flops.fp32 = 1e+300 is implausible: expected 1e+06 to 1e+17"),
    (_set(f"{M}.copy_bw_bytes_per_s", 1.0),
     "measurements.copy_bw_bytes_per_s = 1 is implausible: expected 1e+06 to 1e+14 bytes/s"),
    (_set(f"{M}.embedding.torch.profile.access_bytes", 32.5),
     "measurements.embedding.torch.profile.access_bytes must be an integer, got 32.5"),
    (_set(f"{M}.embedding.torch.profile.per_launch_s", _DELETE),
     "measurements.embedding.torch.profile lacks per_launch_s"),
    (_set(f"{M}.embedding.torch.profile.per_row_s", 5.0),
     "measurements.embedding.torch.profile.per_row_s = 5 is implausible: expected 0 to 1 s"),
    (_set(f"{M}.embedding.torch.profile.source", ["a"]),
     "measurements.embedding.torch.profile.source must be a string"),
    (_set(f"{M}.bind_rule", "x" * 5000), "measurements.bind_rule is longer than 4096 characters"),
    (_set(f"{M}.bind_cores", "yes"), "measurements.bind_cores must be true or false, got 'yes'"),
    (_set(f"{M}.collectives.all_to_all.seconds", [1e-4] * 65),
     "measurements.collectives.all_to_all.seconds has 65 entries, more than the 64 allowed"),
    (_set(f"{M}.collectives.all_to_all.seconds", 0.1),
     "measurements.collectives.all_to_all.seconds must be a list"),
    (_set(f"{M}.collectives.all_to_all.seconds.1", float("inf")),
     "measurements.collectives.all_to_all.seconds.1 is not a finite number"),
    (_set(f"{M}.spread", {"copy": -1.0}), "measurements.spread.copy = -1 is implausible"),
    (_set(f"{M}.spread", {3: 0.1}), "measurements.spread: key 3 is not a string"),
    (_set(f"{M}.collectives_subgroups", [2]),
     "measurements.collectives_subgroups must be a mapping of group size to measurements"),
    (_set(f"{M}.collectives_subgroups", {"two": {"skipped": "x"}}),
     "measurements.collectives_subgroups: group size 'two' is not an integer >= 2"),
    (_set(f"{M}.collectives_subgroups", {1: {"skipped": "x"}}),
     "measurements.collectives_subgroups: group size 1 is not an integer >= 2"),
    (_set(f"{M}.trust.trusted", _DELETE), "measurements.trust lacks trusted"),
    (_set(f"{M}.step.points.0.measured_s", _DELETE), "measurements.step.points.0 lacks measured_s"),
    (_set(f"{M}.step.fields.step_fixed_s", 600.0),
     "measurements.step.fields.step_fixed_s = 600 is implausible: expected 0 to 60 s"),
    (_set(f"{M}.phase_s", {f"p{i}": 1.0 for i in range(17)}), "measurements.phase_s has 17 entries"),
    (_set(f"{M}.lookup_bw", 1e9), "measurements: unknown field(s) lookup_bw"),
    # the records' own rules
    (_set(f"{M}.embedding.torch", {"points": []}),
     "measurements.embedding.torch has neither a profile nor a reason it was skipped"),
    (_set(f"{M}.collectives.all_reduce", {"latency_s": 1e-4}),
     "measurements.collectives.all_reduce has neither a fit nor a reason it was skipped"),
    (_set(f"{M}.collectives_subgroups.2", {"world_size": 4}),
     "measurements.collectives_subgroups.2 has neither its replicas nor a reason it was skipped"),
    (_set(f"{M}.collectives_subgroups.2.all_reduce_replicas", _DELETE),
     "collectives_subgroups.2.all_reduce_replicas has neither a fit nor a reason it was skipped"),
    (_set(f"{M}.collectives_subgroups.2.world_size", 6),
     "measurements.collectives_subgroups.2: needs replicas >= 2 and world_size = 2 x replicas"),
    (_set(f"{M}.measured_fields", ["memory_bw_bytes_per_s", "hbm_gb"]),
     "measured_fields names unknown DeviceSpec field(s) hbm_gb"),
    (_set(f"{M}.measured_fields", ["memory_bw_bytes_per_s"]),
     "measured gemm_flops but measured_fields lacks peak_fp32_flops, peak_bf16_flops"),
    (_set(f"{M}.step.fields", _DELETE), "measurements.step lacks fields"),
    # the whole file
    (_set(f"{M}.measured_fields", _DELETE), "claims measurements but lacks measurements.measured_fields"),
    (_set(M, {}), "`measurements` is empty or not a mapping"),
    (_set("spec.peak_bf16_flops", _DELETE), "claims to have measured peak_bf16_flops but its spec lacks it"),
    (_set("spec", [1]), "`spec` must be a mapping of DeviceSpec fields"),
    (_set("spec.hbm_gb", 1), "unknown DeviceSpec field(s) hbm_gb; known: name"),
    (_set("spec.memory_bw_bytes_per_s", 0), "memory_bw_bytes_per_s must be a finite number > 0, got 0"),
    (_set("spec.simd_width", "wide"), "simd_width: expected a number, got 'wide'"),
    (_set("spec.peak_fp32_flops", 1e300), "peak_fp32_flops = 1e+300 is implausible"),
    (_set("spec.name", {"a": 1}), "name must be a short string"),
    (_set("memory_bw_bytes_per_s", 2e10), "memory_bw_bytes_per_s given twice"),
    (_set("bogus", 1), "unknown key(s) bogus"),
    (_set("base", "h100"), "give the base SKU once"),
    (_set("sku", "other.yaml"), "`sku: other.yaml` must be a SKU name or auto, not a file"),
    (_set("cache", {"sha256": float("nan")}), "cache.sha256 is not a finite number"),
    (_set("sku", _DELETE), "no `sku:` base and spec lacks name, vendor, arch"),
]


@pytest.mark.parametrize(("change", "message"), RULES, ids=[m[:60] for _, m in RULES])
def test_each_rule_refuses_its_bad_input_in_one_line(change, message):
    data = _valid()
    read_hardware_file(copy.deepcopy(data), WHERE)  # whole before the change
    change(data)
    with pytest.raises(RecordError, match=re.escape(message)) as e:
        read_hardware_file(data, WHERE)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{WHERE}: ")


def test_a_calibrated_spec_without_its_measurements_is_refused():
    data = _valid()
    del data["measurements"]
    data["spec"]["source"] = "anyrec.calibrate on cpu, 2026-12-01"
    with pytest.raises(RecordError, match="has no `measurements` \\(cut short\\?\\); calibrate again"):
        read_hardware_file(data, WHERE)


def test_not_a_mapping_is_refused():
    with pytest.raises(RecordError, match="x.yaml: expected a mapping with keys sku, base"):
        read_hardware_file(["a"], WHERE)


def test_the_values_are_typed():
    f = read_hardware_file(_valid(), WHERE)
    m = f.measurements
    assert isinstance(f, HardwareFile) and isinstance(m, Measurements) and f.sku == "cpu"
    assert m.embedding["torch"].profile.access_bytes == 32 and m.embedding["triton"].profile is None
    group = m.collectives_subgroups[2]
    assert group == Subgroup(world_size=4, replicas=2, all_to_all=m.collectives.all_to_all,
                             all_reduce_replicas=group.all_reduce_replicas)
    assert m.step.fields.step_fixed_s == 1e-5 and m.step.points[0].tables is None
    data = yaml.safe_load("measurements: {collectives_subgroups: {'2': {skipped: x}}, measured_fields: []}\n"
                          "sku: cpu\n")
    assert list(read_hardware_file(data, WHERE).measurements.collectives_subgroups) == [2]  # digits: an int


def test_what_is_read_writes_back_as_it_was():
    """Field order is the writer's order; None fields are left out, the verdict's unknowns written null."""
    data = _valid()
    m = read_hardware_file(copy.deepcopy(data), WHERE).measurements
    written = yaml.safe_dump(to_data(m), sort_keys=False)
    assert written == yaml.safe_dump(data["measurements"], sort_keys=False)
    shipped = yaml.safe_load(CAL.read_text())["measurements"]
    back = to_data(parse(Measurements, shipped, "measurements", str(CAL)))
    assert back.keys() == shipped.keys() and back["step"] == shipped["step"]
    assert back["collectives"] == shipped["collectives"]


def test_a_list_held_twice_is_written_once():
    """The calibration passes one list of sizes to every collective: YAML writes it once, as before."""
    sizes = [1024, 65536]
    link = {"sizes_bytes": sizes, "latency_s": 0.0, "bus_bw_bytes_per_s": 1e9}
    shared = Collectives(world_size=2, all_to_all=Link(**link), all_reduce=Link(**link))
    text = yaml.safe_dump(to_data(shared), sort_keys=False)
    assert "sizes_bytes: &id001" in text and "sizes_bytes: *id001" in text
    again = from_data(Collectives, yaml.safe_load(text), "collectives")
    assert again == from_data(Collectives, to_data(shared), "collectives")

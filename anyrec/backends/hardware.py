"""Resolving the `hardware` setting to one `Hardware` value: `auto`, a SKU name, or a hardware YAML file.

A hardware YAML (what `anyrec.calibrate` writes, and what `hardware.sku=FILE.yaml` reads) has the
shape of the `hardware` config group, so the same file also works as a group option:

    sku: h200                # optional base: a SKU name or auto; omitted = `spec` is complete
    spec:                    # DeviceSpec fields (units in the names) replacing the base's
      memory_bw_bytes_per_s: 4.18e+12
    measurements: {...}      # optional: what anyrec.calibrate measured (units in the key names)

Three parts of `measurements` feed the planner, in the `Hardware` value `resolve_hardware` returns
(whoever plans passes it down; nothing is registered): `embedding.<impl>.profile` (a KernelProfile costed
instead of the Impl's built-in one), `measured_fields` (spec fields measured rather than taken from the
base) and `collectives_subgroups` (the collectives of 2D's sharding and replica groups, per group size).
The flat form is accepted too: DeviceSpec fields at the top level, `base: <sku>` for the rest. The file's
schema (its records, ranges and rules) is `anyrec.backends.hardware_file`; this module reads its values.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anyrec.backends.dispatch import TORCH_EMBEDDING, Impl, KernelProfile
from anyrec.backends.hardware_file import (
    SPEC_FIELDS,
    Link,
    Measurements,
    check_spec_value,
    is_hardware_path,
    read_hardware_file,
    read_measurements,
    spec_fields,
)
from anyrec.backends.specs import SKUS, DeviceSpec, sku_key
from anyrec.safe_load import load_yaml

if TYPE_CHECKING:
    from anyrec.backends.interface import Backend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddingCost:
    """The planner's view of one embedding implementation on one `Hardware`: the Impl record (its
    placements, data-parallel support and state layout) and the profiles its lookups are costed with."""

    impl: Impl
    profile: KernelProfile  # the implementation's lookups: measured on the hardware, else built in
    dense_profile: KernelProfile  # data-parallel tables' plain embedding bags (the torch implementation's)

    @classmethod
    def builtin(cls, impl: Impl) -> EmbeddingCost:
        """`impl` costed with the built-in profiles (uncalibrated hardware)."""
        assert impl.profile is not None and TORCH_EMBEDDING.profile is not None  # embedding Impls carry one
        return cls(impl, impl.profile, TORCH_EMBEDDING.profile)

    @property
    def name(self) -> str:
        return self.impl.name

    def state_bytes_per_row(self, optimizer: str, dim: int) -> int:
        """Bytes of fused optimizer state one row of width `dim` keeps (as the Impl lays it out)."""
        return self.impl.optimizer_state_bytes_per_row(optimizer, dim)


@dataclass(frozen=True)
class LinkFit:
    """A collective fitted on measured ranks: seconds = latency_s + bus bytes / bus_bw_bytes_per_s."""

    latency_s: float
    bus_bw_bytes_per_s: float


@dataclass(frozen=True)
class SubgroupLinks:
    """The collectives 2D runs, measured on one host's ranks laid out as torchrec's DMPCollection lays
    them out: the all-to-all within a sharding group of `group_size` ranks and the all-reduce over a
    replica group of `replicas` ranks (None: not measured)."""

    group_size: int
    replicas: int
    all_to_all: LinkFit | None = None
    all_reduce_replicas: LinkFit | None = None


@dataclass(frozen=True)
class HSTURates:
    """An HSTU part's kernels measured on this device at one job's shapes: `batch` sequences of
    `mean_tokens` tokens on average (root mean square `rms_tokens`, the longest `longest_tokens`), `heads`
    heads of `qk_dim` query/key and `v_dim` value dims, in `dtype` ("fp32" or "bf16"). The attention
    implementation `impl`: one layer's forward took `forward_s` and forward + backward `step_s` (medians),
    `flops_per_s` the planner's count of its FLOP over those seconds; `gemm_flops_per_s`, one layer's
    UVQK and output GEMMs forward + backward over all the tokens; `elementwise_bw_bytes_per_s`, a layer
    norm's forward + backward over the attention output's elements (bytes read and written);
    `dense_step_s`, the model's whole dense part (every layer after the lookup, the loss's logits: the
    preprocessor, the STU stack with its recompute, the postprocessor, the item MLP, the head, and the
    jagged index work between them) forward + backward on those sequences (median; 0: not measured).
    (anyrec.planner.sequence costs with them; anyrec.calibration.measure.hstu measures them.)"""

    impl: str
    dtype: str
    heads: int
    qk_dim: int
    v_dim: int
    mean_tokens: float
    rms_tokens: float
    longest_tokens: float
    batch: int
    forward_s: float
    step_s: float
    flops_per_s: float
    gemm_flops_per_s: float
    elementwise_bw_bytes_per_s: float
    spread: float = 0.0  # the attention's repeated measurements' spread (anyrec.calibration.run.Timing)
    source: str = ""  # where and when it was measured
    dense_step_s: float = 0.0


@dataclass(frozen=True)
class Hardware:
    """The device the planner reasons about, as one value: its spec (memory, compute and link figures),
    the embedding profiles a calibration measured, which of the spec's figures were measured, and the
    HSTU kernels' rates measured at a job's shapes."""

    spec: DeviceSpec
    profiles: dict[str, KernelProfile] = field(default_factory=dict)  # embedding impl -> measured
    measured_fields: tuple[str, ...] = ()  # spec fields measured (the rest from the base SKU)
    measured_by: str = ""  # where the measurements come from (a file, the hardware config); "" = none
    subgroups: dict[int, SubgroupLinks] = field(default_factory=dict)  # group size -> 2D's collectives
    # an HSTU part's kernels measured at a job's shapes (the calibration on first contact's)
    hstu_rates: tuple[HSTURates, ...] = ()

    @property
    def link_source(self) -> str:
        """Where the spec's scale-up link figures come from (the whole job's collectives, or the base)."""
        if "scale_up_bw_bytes_per_s" in self.measured_fields:
            return f"from the world's figures (measured over the whole job, {self.measured_by})"
        return f"from the datasheet's figures ({self.spec.source or self.spec.name})"

    def embedding_cost(self, impl: Impl) -> EmbeddingCost:
        """What the planner costs `impl` with on this hardware: measured profiles where there are."""
        builtin = EmbeddingCost.builtin(impl)
        return EmbeddingCost(impl, self.profiles.get(impl.name, builtin.profile),
                             self.profiles.get(TORCH_EMBEDDING.name, builtin.dense_profile))


def measured(hardware: Hardware, measurements: Measurements | None, where: str) -> Hardware:
    """`hardware` with a calibration's `measurements` (checked whole by the schema) on top."""
    if measurements is None:
        return hardware
    profiles = {name: KernelProfile(
        bw_efficiency=p.bw_efficiency, access_bytes=p.access_bytes, per_row_s=p.per_row_s,
        per_launch_s=p.per_launch_s, source=p.source or "")
        for name, entry in (measurements.embedding or {}).items()
        if (p := entry.profile) is not None}  # None: skipped on that machine
    return dataclasses.replace(hardware, profiles={**hardware.profiles, **profiles},
                               measured_fields=tuple(dict.fromkeys(hardware.measured_fields
                                                                   + measurements.measured_fields)),
                               measured_by=where,
                               subgroups={**hardware.subgroups, **subgroup_links(measurements)})


def _fit(link: Link | None) -> LinkFit | None:
    """One measured collective's fit, or None where it was skipped."""
    if link is None or link.bus_bw_bytes_per_s is None or link.latency_s is None:
        return None
    return LinkFit(link.latency_s, link.bus_bw_bytes_per_s)


def subgroup_links(measurements: Measurements) -> dict[int, SubgroupLinks]:
    """`collectives_subgroups` per group size; {} in files without it."""
    out = {}
    for group, entry in (measurements.collectives_subgroups or {}).items():
        if entry.replicas is None:  # skipped (the time limit): the world's figures price this size
            continue
        links = SubgroupLinks(group, entry.replicas, _fit(entry.all_to_all), _fit(entry.all_reduce_replicas))
        if links.all_to_all is not None or links.all_reduce_replicas is not None:
            out[group] = links
    return out


def check_spec(spec: DeviceSpec, where: str) -> DeviceSpec:
    """`spec` if every number in it is finite and positive (0 allowed where it means unknown)."""
    for name in SPEC_FIELDS:
        check_spec_value(name, getattr(spec, name), where)
    return spec


def apply_overrides(spec: DeviceSpec, overrides: dict[str, Any] | None,
                    where: str = "hardware.spec") -> DeviceSpec:
    """`spec` with some fields replaced; unknown field names are a ValueError naming `where`."""
    if not overrides:
        return spec
    return check_spec(spec.replace(**spec_fields(overrides, where)), where)


def load_hardware_file(path: str | os.PathLike, backend: Backend | None = None) -> Hardware:
    """A hardware YAML (base SKU + overrides, or a complete spec; measurements) as a Hardware value."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"hardware file {str(p)!r} does not exist")
    where = f"hardware file {p}"
    return hardware_from_data(load_yaml(p, where), where, str(p), backend)  # bounded: size, depth, aliases


def hardware_from_data(data: Any, where: str, source: str, backend: Backend | None = None) -> Hardware:
    """A parsed hardware file (`where` names it in errors, `source` in the Hardware) as a Hardware value,
    checked whole first."""
    file = read_hardware_file(data, where)
    if file.sku is not None:
        base_spec = resolve_hardware(file.sku, backend=backend).spec
        from_base = [f for f in SPEC_FIELDS if f not in file.spec and f not in ("name", "source")]
        if from_base:
            logger.info("%s: %d figure(s) from the base %s (%s): %s", where, len(from_base), file.sku,
                        base_spec.source or "SKU table", ", ".join(from_base))
        spec = check_spec(base_spec.replace(**file.spec), where)
    else:
        spec = check_spec(DeviceSpec(**file.spec), where)
    return measured(Hardware(spec), file.measurements, source)


def resolve_hardware(sku: str, overrides: dict[str, Any] | None = None, backend: Backend | None = None,
                     measurements: dict[str, Any] | None = None) -> Hardware:
    """The Hardware for a `hardware.sku` setting: 'auto' (asks `backend`), a SKU name, or a path to a
    hardware YAML. `overrides` (`hardware.spec`) replace spec fields last; `measurements`
    (`hardware.measurements`, set where a calibrated YAML is a group option) count as the file's would."""
    sku = str(sku).strip()
    if sku == "auto":
        if backend is None:
            raise ValueError("hardware.sku=auto needs the backend whose device it describes")
        hardware = Hardware(check_spec(backend.device_spec(), f"the {backend.name} backend's device spec"))
    elif is_hardware_path(sku):
        hardware = load_hardware_file(sku, backend)
    else:
        key = sku_key(sku)
        if key is None:
            raise ValueError(f"unknown hardware {sku!r}: use auto, a SKU ({', '.join(sorted(SKUS))}) "
                             "or a path to a hardware .yaml")
        hardware = Hardware(SKUS[key])
    hardware = dataclasses.replace(hardware, spec=apply_overrides(hardware.spec, overrides))
    if not measurements:
        return hardware
    # a calibrated YAML used as a group option: checked as the file would be
    where = "hardware.measurements"
    return measured(hardware, read_measurements(measurements, spec_fields(overrides or {}, where), where),
                    where)


def figure_sources(hardware: Hardware, cost: EmbeddingCost) -> list[str]:
    """Where the planner's figures come from: which spec fields and embedding profiles `hardware`'s
    calibration measured, and the source of the rest (the SKU table or the base spec)."""
    lines = []
    if hardware.measured_by:
        done = hardware.measured_fields
        rest = [f for f in SPEC_FIELDS if f not in done and f not in ("name", "vendor", "arch", "source")]
        lines.append(f"measured ({hardware.measured_by}): {', '.join(done) or 'no device figure'}")
        lines.append(f"from the base spec ({hardware.spec.source or hardware.spec.name}): {', '.join(rest)}")
    else:
        lines.append(f"all device figures from the SKU table (datasheet): "
                     f"{hardware.spec.source or hardware.spec.name}")
    profiles = [("embedding", cost.name, cost.profile)]
    if cost.name != TORCH_EMBEDDING.name:
        profiles.append(("data-parallel tables'", TORCH_EMBEDDING.name, cost.dense_profile))
    for what, name, profile in profiles:
        how = (f"measured ({hardware.measured_by}{', ' + profile.source if profile.source else ''})"
               if name in hardware.profiles else f"built in ({profile.source or 'no source given'})")
        lines.append(f"{what} {name} profile: {how}")
    return lines

"""An HSTU job's kernels (its attention implementation, its GEMMs, its elementwise passes) measured on the
job's own shapes (anyrec.calibration.measure.hstu), remembered beside the calibration entry
(anyrec.history.hstu_records), found again on first contact (first_contact.job_hstu_rates) and costed by
the planner at their measured rates (anyrec.planner.sequence)."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest
import torch

from anyrec.backends import get_backend
from anyrec.backends.hardware import HSTURates
from anyrec.backends.specs import get_sku
from anyrec.calibration import first_contact
from anyrec.calibration.measure import hstu as measure
from anyrec.choices import Precision
from anyrec.history import cache as calcache
from anyrec.history import hstu_records as records
from anyrec.kernels.hstu import hstu_attention_torch
from anyrec.models.dlrmv4 import dlrmv4_config
from anyrec.models.dlrmv4 import workload_facts as dlrmv4_facts
from anyrec.models.family import resolve_family
from anyrec.models.hstu import HSTUDense
from anyrec.planner import sequence
from anyrec.planner.estimators import DenseEstimator
from anyrec.planner.planner import make_workload
from anyrec.planner.types import TableSpec, Topology
from anyrec.runtime.agreement import Agreement
from anyrec.schema import HSTUShape

from .conftest import compose_config

SMALL = HSTUShape(64, 2, 32, 2, 16, 16, contextual=8, mean_seq_len=51.7, rms_seq_len=52.0,
                  longest_seq_len=57)
TINY = HSTUShape(16, 1, 8, 1, 16, 16, contextual=2, mean_seq_len=10.0, rms_seq_len=10.5, longest_seq_len=14)


def _rate(shape: HSTUShape = SMALL, **changes) -> HSTURates:
    rate = HSTURates(impl="torch", dtype="fp32", heads=shape.num_heads, qk_dim=shape.qk_dim,
                         v_dim=shape.v_dim, mean_tokens=shape.mean_tokens, rms_tokens=shape.rms_tokens,
                         longest_tokens=shape.longest_tokens, batch=128, forward_s=0.01, step_s=0.04,
                         flops_per_s=2e9, gemm_flops_per_s=5e10, elementwise_bw_bytes_per_s=8e9,
                         dense_step_s=0.05)
    return dataclasses.replace(rate, **changes)


def test_measurement_lengths_have_the_planned_mean_rms_and_longest():
    lengths = measure.measurement_lengths(SMALL, 128)
    assert len(lengths) == 128 and max(lengths) == 57
    assert sum(lengths) / 128 == pytest.approx(51.7, abs=0.05)
    assert math.sqrt(sum(n * n for n in lengths) / 128) == pytest.approx(52.0, abs=0.1)
    # the data's longest not given: the bound, max_seq_len
    bound = measure.measurement_lengths(dataclasses.replace(SMALL, longest_seq_len=None), 128)
    assert max(bound) == 64 and sum(bound) / 128 == pytest.approx(51.7, abs=0.05)
    # lengths that do not vary: every sequence at the mean
    assert measure.measurement_lengths(HSTUShape(64, 2, 32, 2, 16, 16, contextual=8), 4) == [64] * 4
    with pytest.raises(ValueError, match="batch"):
        measure.measurement_lengths(SMALL, 0)


def test_the_measurement_runs_the_given_attention_forward_and_backward():
    calls, grads = [], []

    class Counted(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            grads.append(g.shape)
            return g

    def fn(q, k, v, offsets, max_len, heads, targets, contextual):
        calls.append((tuple(q.shape), tuple(v.shape), offsets.tolist(), max_len, heads, targets.tolist()))
        return Counted.apply(hstu_attention_torch(q, k, v, offsets, max_len, heads, targets, contextual))

    rate = measure.measure_hstu(fn, "counted", TINY, 4, False, get_backend("cpu"), torch.device("cpu"),
                                budget_s=0.0)
    lengths = measure.measurement_lengths(TINY, 4)
    T = sum(lengths)
    # one warm-up and at least MIN_REPS timed passes, each forward and backward, on the job's shapes
    assert len(calls) == len(grads) >= measure.MIN_REPS + 1
    offsets = [0, *[sum(lengths[:i + 1]) for i in range(4)]]
    assert calls[0] == ((T, 1, 16), (T, 1, 16), offsets, 16, 1, [1] * 4)
    assert (rate.impl, rate.dtype, rate.heads, rate.qk_dim, rate.v_dim) == ("counted", "fp32", 1, 16, 16)
    assert rate.batch == 4
    assert 0 < rate.forward_s < rate.step_s
    flops = sequence.attention_layer_flops(float(sum(n * n for n in lengths)), 1, 16, 16)
    assert rate.flops_per_s * rate.step_s == pytest.approx(flops)
    assert rate.gemm_flops_per_s > 0 and rate.elementwise_bw_bytes_per_s > 0


def test_the_whole_dense_part_is_timed_forward_and_backward_on_the_jobs_sequences():
    """dlrmv4_small's dense part, built with the attention under test, trained on the measured lengths:
    every parameter reached by the backward, its median step recorded."""
    _, cfg = compose_config(["model=dlrmv4_small"])
    model = dlrmv4_config(cfg.model)
    shape = dlrmv4_facts(cfg.model).hstu
    dense = measure.DenseUnderTest(HSTUDense(model, hstu_attention_torch), model.table_dim)
    rate = measure.measure_hstu(hstu_attention_torch, "torch", shape, 4, False, get_backend("cpu"),
                                torch.device("cpu"), budget_s=0.0, dense=dense, dense_budget_s=0.0)
    assert rate.dense_step_s > 0 and rate.batch == 4
    assert all(p.grad is not None for p in dense.module.parameters())
    without = measure.measure_hstu(hstu_attention_torch, "torch", shape, 4, False, get_backend("cpu"),
                                   torch.device("cpu"), budget_s=0.0)
    assert without.dense_step_s == 0.0  # no dense part given: not measured


def test_the_dense_part_is_warmed_up_then_timed_for_its_whole_budget(monkeypatch):
    """The dense step (what the planner costs the step by) is a median over `dense_budget_s` of passes
    after DENSE_WARMUPS untimed ones, not over the quick budget's few: on a shared host a few passes give
    that second's speed."""
    passes = []

    def whole(dense, lengths, backend, device, half, gen):
        def step() -> None:
            passes.append(time.perf_counter())
            time.sleep(0.004)
        return step

    timings, timeit = [], measure.timeit

    def kept(*args, **kwargs):
        timings.append(timeit(*args, **kwargs))
        return timings[-1]

    monkeypatch.setattr(measure, "dense_pass", whole)
    monkeypatch.setattr(measure, "timeit", kept)
    rate = measure.measure_hstu(hstu_attention_torch, "torch", TINY, 4, False, get_backend("cpu"),
                                torch.device("cpu"), budget_s=0.0, dense=object(), dense_budget_s=0.1)
    dense = timings[0]  # the first timing is the dense part's
    assert measure.DENSE_WARMUPS > 1 and len(passes) == measure.DENSE_WARMUPS + dense.reps
    timed = passes[measure.DENSE_WARMUPS:]
    assert dense.reps >= 0.1 / 0.006 and timed[-1] - timed[0] >= 0.08  # the whole budget, not MIN_REPS
    assert rate.dense_step_s == dense.median_s and 0.004 <= rate.dense_step_s < 0.05


def test_a_measured_dense_step_is_the_hstu_time_split_by_the_models_shares():
    dev = get_sku("h100")
    ab = sequence.activation_dtypes(cpu=True, half=False)
    parts = sequence.hstu_time_s(SMALL, 1e6, 64, dev, ab, 0.5, "torch", recompute=False,
                                 rates=_rate(dense_step_s=0.0))
    whole = sequence.hstu_time_s(SMALL, 1e6, 64, dev, ab, 0.5, "torch", recompute=False, rates=_rate())
    assert whole.total_s == pytest.approx(0.05 * 64 / 128)  # the measured step per sample, at this batch
    for name in ("gemm_s", "attention_s", "elementwise_s", "selective_recompute_s"):
        assert getattr(whole, name) / whole.total_s == pytest.approx(getattr(parts, name) / parts.total_s)


def test_the_planner_costs_the_kernels_at_their_measured_rates():
    dev = get_sku("h100")  # any spec: the measured rate replaces its peak x assumed efficiency
    ab = sequence.activation_dtypes(cpu=True, half=False)
    rate = _rate(dense_step_s=0.0)  # the parts' rates alone
    assert sequence.measured_hstu((rate,), SMALL, "torch", half=False) is rate
    for other in (_rate(impl="triton"), _rate(dtype="bf16"), _rate(heads=4), _rate(longest_tokens=64.0),
                  _rate(rms_tokens=53.0)):
        assert sequence.measured_hstu((other,), SMALL, "torch", half=False) is None
    measured = sequence.hstu_time_s(SMALL, 1e6, 128, dev, ab, 0.5, "torch", recompute=True, rates=rate)
    assumed = sequence.hstu_time_s(SMALL, 1e6, 128, dev, ab, 0.5, "torch", recompute=True)
    f = sequence.stu_flops(SMALL)
    assert measured.attention_s == pytest.approx(128 * f.attention / 2e9)
    assert assumed.attention_s == pytest.approx(128 * f.attention / (dev.peak_fp32_flops * 0.10))
    # the GEMMs (the STU's and the model's other ones over the same tokens) at the measured GEMM rate
    assert measured.gemm_s == pytest.approx(128 * (f.uvqk + f.output + 1e6) / 5e10)
    assert f.uvqk + f.output == pytest.approx(
        SMALL.num_layers * SMALL.mean_tokens * sequence.stu_gemm_flops_per_token(SMALL))
    # the elementwise passes at the measured bandwidth, not the device's copy bandwidth
    assert measured.elementwise_s / assumed.elementwise_s == pytest.approx(
        dev.memory_bw_bytes_per_s * sequence.ELEMENTWISE_EFFICIENCY / 8e9)
    # recompute runs the attention's forward again: its measured share of forward + backward
    assert measured.recompute_s == pytest.approx(
        128 * (f.uvqk + f.output) / 3 / 5e10 + measured.attention_s * 0.25 + measured.elementwise_s / 3)
    # the dense estimate of a job whose options carry the rate: the same difference in its step
    table = TableSpec("item_id", 1000, 32, 44.0, ["item_id"], sequence=True)
    topology = Topology(dev, 2, compute_device="cpu")

    def dense_s(rates: tuple[HSTURates, ...]) -> float:
        wl = make_workload([table], 128, "rowwise_adagrad", 1000, hstu=SMALL, attention_impl="torch",
                           hstu_rates=rates)
        return DenseEstimator().estimate(topology, wl).perf.total_s

    plain = sequence.hstu_time_s(SMALL, 0.0, 128, dev, ab, 0.5, "torch", recompute=False, rates=rate)
    assert dense_s((rate,)) - dense_s(()) == pytest.approx(
        plain.total_s - sequence.hstu_time_s(SMALL, 0.0, 128, dev, ab, 0.5, "torch", recompute=False).total_s)


def test_records_round_trip_and_damage_is_measured_again(tmp_path, caplog):
    key = records.record_key("entry text", "torch", False, SMALL, 128)
    longer = dataclasses.replace(SMALL, longest_seq_len=58)
    # the key changes with the entry (re-measured), the implementation, the dtype, the lengths and the batch
    assert len({key, records.record_key("other entry", "torch", False, SMALL, 128),
                records.record_key("entry text", "triton", False, SMALL, 128),
                records.record_key("entry text", "torch", True, SMALL, 128),
                records.record_key("entry text", "torch", False, longer, 128),
                records.record_key("entry text", "torch", False, SMALL, 64)}) == 6
    path = records.record_path(key, tmp_path)
    assert records.read_record(path, key) is None  # nothing there: measured, silently
    records.write_record(path, key, _rate())
    assert records.read_record(path, key) == _rate()
    assert records.read_record(path, "another key") is None
    good = json.loads(path.read_text())
    for bad in ('{"version": 1', json.dumps({**good, "version": 0}),
                json.dumps({**good, "rate": {**good["rate"], "step_s": -1.0}}),
                json.dumps({**good, "rate": {**good["rate"], "flops_per_s": True}}),
                json.dumps({**good, "rate": {**good["rate"], "heads": 2.5}}),
                json.dumps({**good, "rate": {**good["rate"], "dtype": "fp8"}}),
                json.dumps({**good, "rate": {**good["rate"], "extra": 1}})):
        path.write_text(bad)
        caplog.clear()
        assert records.read_record(path, key) is None
        assert "ignored" in caplog.text


def test_first_contact_measures_the_jobs_attention_once_then_reads_it(tmp_path, monkeypatch, caplog):
    from anyrec.runtime.distributed import destroy_distributed, start_runtime

    caplog.set_level("INFO")
    monkeypatch.setenv(calcache.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    entry = tmp_path / "calibration-entry.yaml"
    entry.write_text("measurements: {}\n")
    _, cfg = compose_config(["model=dlrmv4_small", "data.batch_size=2", "trainer.calibrate=auto"])
    runtime = start_runtime("cpu", bind_cores=False)
    try:
        def job() -> HSTURates | None:
            return first_contact.job_hstu_rates(cfg, runtime, entry, Agreement.begin(0, 1, "test"),
                                                Precision.fp32)

        rate = job()
        assert rate is not None and "HSTU kernels measured at this job's shapes" in caplog.text
        shape = resolve_family(cfg.model).workload_facts(cfg.model).hstu
        assert sequence.measured_hstu((rate,), shape, "torch", half=False) is rate  # what the job plans
        assert rate.batch == 2 and "first contact" in rate.source and rate.dense_step_s > 0  # the model's
        (kept,) = (tmp_path / "hstu").glob("*.json")

        def never(*args, **kwargs):
            raise AssertionError("measured again")

        monkeypatch.setattr(first_contact, "measure_hstu", never)
        assert job() == rate  # the record, not a measurement
        entry.write_text("measurements: {re-measured: 1}\n")  # a new entry: its own record
        with pytest.raises(AssertionError, match="measured again"):
            job()
        _, dlrm = compose_config(["model=dlrm_tiny"])
        agreement = Agreement.begin(0, 1, "t")
        assert first_contact.job_hstu_rates(dlrm, runtime, entry, agreement, Precision.fp32) is None
        assert kept.exists()
    finally:
        destroy_distributed(barrier=False)

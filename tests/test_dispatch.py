"""Op dispatch: per-backend order, probes, forced choices, clear errors, one log line per choice."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from anyrec.backends import dispatch, get_backend
from anyrec.backends.cpu import CPUBackend
from anyrec.backends.interface import DeviceFacts
from anyrec.backends.specs import get_sku
from anyrec.config import BackendConfig
from anyrec.planner import CoDesignPlanner, InfeasiblePlanError, Topology
from anyrec.planner.workloads import DLRMV2_DENSE_PARAMS, dlrmv2_tables

from .conftest import reset_probes

H200 = DeviceFacts(cuda_available=True, device_count=1, device_name="NVIDIA H200", arch="sm_90",
                   memory_bytes=141 * 10**9)
MI300X = DeviceFacts(cuda_available=True, hip_version="6.2", device_count=1,
                     device_name="AMD Instinct MI300X", arch="gfx942", memory_bytes=192 * 2**30)


@pytest.fixture(autouse=True)
def _fresh_probes(monkeypatch, fresh_impls):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_registry_has_the_ops_and_every_backend_orders_them():
    assert {"embedding", "interaction", "dcn_cross", "hstu_attention", "collectives"} <= set(dispatch.OPS)
    for cls in (CPUBackend, type(get_backend("cuda", facts=H200))):
        assert set(cls.kernel_order) == set(dispatch.OPS)
        assert cls.kernel_order["embedding"][0] == "fbgemm"


def test_cpu_auto_choices_are_logged_once(caplog):
    caplog.set_level(logging.DEBUG, logger="anyrec.backends.dispatch")  # first choices: the log file's
    b = get_backend("cpu")
    kernels = b.select_kernels(BackendConfig())
    assert {op: i.name for op, i in kernels.items()} == {
        "embedding": "fbgemm", "interaction": "torch", "dcn_cross": "torch", "hstu_attention": "torch",
        "collectives": "gloo", "sparse_ops": "fbgemm"}
    b.select_kernels(BackendConfig())
    get_backend("cpu").select_kernels(BackendConfig())
    assert caplog.text.count("op embedding -> fbgemm (fallback chain: fbgemm > torch > triton)") == 1


def test_forced_choices():
    b = get_backend("cpu")
    assert b.select_kernels(BackendConfig(embedding_kernel="torch"))["embedding"].name == "torch"
    assert b.select_kernels(BackendConfig(embedding_kernel="fbgemm"))["embedding"].name == "fbgemm"
    with pytest.raises(ValueError, match=r"backend.embedding_kernel=triton is not available on cpu: "
                                         r"triton does not compile for CPU"):
        b.select_kernels(BackendConfig(embedding_kernel="triton"))
    with pytest.raises(ValueError, match=r"backend.interaction_kernel=triton is not available on cpu"):
        b.select_kernels(BackendConfig(interaction_kernel="triton"))
    with pytest.raises(ValueError, match=r"backend.dcn_kernel=cutlass is not offered by backend cpu"):
        b.select_kernels(BackendConfig(dcn_kernel="cutlass"))


def test_triton_on_cpu_is_an_explicit_opt_in(monkeypatch):
    b = get_backend("cpu")
    assert dispatch.availability(b, "embedding", "triton").startswith("triton does not compile")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reset_probes()
    assert dispatch.probe_triton(b) is None  # the interpreter reaches the CPU ...
    # ... and every op has its kernels, but on CPU auto still prefers torch for the dense ops.
    assert dispatch.availability(b, "interaction", "triton") is None
    assert dispatch.availability(b, "dcn_cross", "triton") is None
    assert dispatch.availability(b, "hstu_attention", "triton") is None
    assert dispatch.availability(b, "embedding", "triton") is None
    auto = b.select_kernels()
    assert auto["interaction"].name == auto["dcn_cross"].name == auto["hstu_attention"].name == "torch"
    forced = b.select_kernels(BackendConfig(interaction_kernel="triton", dcn_kernel="triton",
                                            attention_kernel="triton"))
    assert forced["interaction"].name == forced["dcn_cross"].name == forced["hstu_attention"].name == "triton"


def test_dense_op_order_per_backend():
    """GPUs prefer the Triton interaction and fused cross epilogue, CPU plain torch; torch is always last
    resort on GPUs, and a missing kernel module is a clear reason."""
    for name, facts in (("cuda", H200), ("rocm", MI300X)):
        b = get_backend(name, facts=facts)
        for op in ("interaction", "dcn_cross", "hstu_attention"):
            assert b.kernel_order[op] == ("triton", "torch")
    for op in ("interaction", "dcn_cross", "hstu_attention"):
        assert CPUBackend.kernel_order[op] == ("torch", "triton")
    probe = dispatch._module_present("anyrec.kernels.no_such_op", dispatch._TRITON_KERNELS)
    assert probe(CPUBackend()) == "anyrec.kernels.no_such_op (the op's Triton kernels) is not installed"


def test_gpu_without_its_kernels_falls_back_loudly(caplog):
    # This CPU-only torch has no CUDA FBGEMM kernels and no GPU for Triton: a GPU backend (facts
    # injected) must fall back to torch, and say why at WARNING.
    b = get_backend("cuda", facts=H200)
    assert dispatch.probe_fbgemm(b) == "fbgemm_gpu has no TBE kernels for cuda (wrong fbgemm_gpu build?)"
    with caplog.at_level(logging.INFO, logger="anyrec.backends.dispatch"):
        kernels = b.select_kernels()
    dense_ops = ("embedding", "interaction", "dcn_cross", "hstu_attention")
    assert {kernels[op].name for op in dense_ops} == {"torch"}
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("fbgemm skipped on cuda" in r.getMessage() for r in warned)
    assert any("triton skipped on cuda" in r.getMessage() for r in warned)
    assert any(r.getMessage().startswith("op interaction: triton skipped on cuda") for r in warned)
    with pytest.raises(ValueError, match="backend.dcn_kernel=triton is not available on cuda: triton"):
        b.select_kernels(BackendConfig(dcn_kernel="triton"))
    with pytest.raises(ValueError, match="backend.embedding_kernel=fbgemm is not available on cuda"):
        b.select_kernels(BackendConfig(embedding_kernel="fbgemm"))


def test_plugin_probe_for_its_own_library():
    class Xpu(CPUBackend):
        name = "xpu_test"
        kernel_order = {**CPUBackend.kernel_order, "embedding": ("sycl_tbe", "torch")}

        def probe(self, impl):
            return "oneAPI runtime missing" if impl == "sycl_tbe" else super().probe(impl)

    b = Xpu()
    assert b.select_kernels()["embedding"].name == "torch"
    with pytest.raises(ValueError, match="sycl_tbe is not available on xpu_test: oneAPI runtime missing"):
        b.select_kernels(BackendConfig(embedding_kernel="sycl_tbe"))


def test_embedding_choice_maps_to_a_torchrec_sharder():
    from anyrec.backends.sharders import embedding_sharder

    fbgemm, triton, torch_ = (dispatch.get_impl("embedding", n) for n in ("fbgemm", "triton", "torch"))
    assert fbgemm.compute_kernel() == "fused" and torch_.compute_kernel() == "fused_triton"
    assert fbgemm.compute_kernel("uvm_caching") == "fused_uvm_caching"
    with pytest.raises(ValueError, match="needs backend.embedding_kernel=fbgemm"):
        triton.compute_kernel("uvm_caching")
    with pytest.raises(ValueError, match="unknown embedding implementation 'sycl_tbe'; known: "
                                         "fbgemm, triton, torch"):
        dispatch.get_impl("embedding", "sycl_tbe")
    assert embedding_sharder(torch_).compute_kernels("table_wise", "cpu") == ["fused_triton"]
    assert embedding_sharder(triton).compute_kernels("row_wise", "cuda") == ["fused_triton"]
    assert "dense" in embedding_sharder(fbgemm).compute_kernels("data_parallel", "cpu")
    assert embedding_sharder(fbgemm).compute_kernels("table_wise", "cpu") == ["fused"]
    assert "fused_uvm_caching" in embedding_sharder(fbgemm).compute_kernels("table_wise", "cuda")


def test_fbgemm_sharder_rejects_a_plan_for_another_kernel():
    from torchrec.distributed.types import ParameterSharding

    from anyrec.backends.sharders import embedding_sharder

    ps = ParameterSharding(sharding_type="table_wise", compute_kernel="fused_triton", ranks=[0])
    with pytest.raises(ValueError, match="t0: the plan uses compute kernel 'fused_triton'"):
        embedding_sharder(dispatch.FBGEMM_EMBEDDING).shard(None, {"t0": ps}, None)


def test_every_reader_takes_the_embedding_impl_record():
    """One record per implementation, handed down as a value: the planner's placements and
    data-parallel support follow the record it is given; the registry stays read-only."""
    from anyrec.backends.hardware import EmbeddingCost

    fbgemm = dispatch.get_impl("embedding", "fbgemm")

    def plan(impl):  # DLRMv2 + Adagrad on one B200 needs UVM caching; on 8 H100s it replicates small tables
        one, eight = (CoDesignPlanner().plan(dlrmv2_tables(), Topology(get_sku(sku), w), 8192, "adagrad",
                                             DLRMV2_DENSE_PARAMS, embedding=EmbeddingCost.builtin(impl))
                      for sku, w in (("b200", 1), ("h100", 8)))
        return ({o.placement.value for o in one.tables.values()},
                {o.sharding.value for o in eight.tables.values()})

    placements, shardings = plan(fbgemm)
    assert "uvm_caching" in placements and "data_parallel" in shardings  # the record allows both
    changed = dataclasses.replace(fbgemm, compute_kernels={"hbm": "fused"}, data_parallel=False)
    with pytest.raises(InfeasiblePlanError):  # the planner reads the record: no UVM placement left
        plan(changed)
    assert "data_parallel" not in plan(dataclasses.replace(fbgemm, data_parallel=False))[1]
    assert dispatch.get_impl("embedding", "fbgemm") is fbgemm  # nothing was registered
    with pytest.raises(RuntimeError, match="read-only once plugins are loaded"):
        dispatch.register_impl(dataclasses.replace(changed, name="fbgemm2"))


def test_impl_records_are_checked():
    with pytest.raises(ValueError, match="unknown op 'pooling'"):
        dispatch.Impl("pooling", "x")
    with pytest.raises(ValueError, match="needs a compute kernel for placement 'hbm'"):
        dispatch.Impl("embedding", "x", "m:f", compute_kernels={"ddr": "fused_uvm"})
    with pytest.raises(ValueError, match="needs a builder .* and a profile"):
        dispatch.Impl("embedding", "x", "m:f", compute_kernels={"hbm": "fused"})
    with pytest.raises(ValueError, match="bw_efficiency"):
        dispatch.KernelProfile(1.5)
    with pytest.raises(ValueError, match="builds nothing"):
        dispatch.get_impl("collectives", "gloo").build()


def test_plugin_impls_come_from_entry_points_and_can_be_forced():
    """A plugin's Impl (entry-point group anyrec.impls) is probed, forced and built like a built-in."""
    built = []

    class EP:  # an importlib.metadata.EntryPoint as far as the loader is concerned
        name, value = "vendor_tbe", "vendor:IMPLS"

        def load(self):
            return [dispatch.Impl(
                "embedding", "vendor_tbe", lambda **kw: built.append(kw) or "sharder",
                probe=lambda b: None if b.device_type == "cpu" else "vendor runtime missing",
                options={"flavour": "fast"}, compute_kernels={"hbm": "fused_triton"},
                state_bytes_per_row=lambda opt, dim: 4, profile=dispatch.KernelProfile(0.5, source="test"))]

    dispatch._load_plugins([EP()])
    b = get_backend("cpu")
    assert b.select_kernels()["embedding"].name == "fbgemm"  # auto keeps the backend's order
    assert b.select_kernels(BackendConfig(embedding_kernel="vendor_tbe"))["embedding"].name == "vendor_tbe"
    assert dispatch.get_impl("embedding", "vendor_tbe").build() == "sharder"
    assert built == [{"flavour": "fast"}]
    assert dispatch.torchrec_kernel_placements()["fused_triton"] == "hbm"
    with pytest.raises(ValueError, match="vendor_tbe is not available on cuda: vendor runtime missing"):
        get_backend("cuda", facts=H200).select_kernels(BackendConfig(embedding_kernel="vendor_tbe"))



def test_an_unregistered_plugin_impl_is_not_offered(fresh_impls):
    dispatch._load_plugins([])
    with pytest.raises(ValueError, match="not offered by backend cpu"):
        get_backend("cpu").select_kernels(BackendConfig(embedding_kernel="vendor_tbe"))


def test_a_kernel_order_entry_without_a_record_says_so():
    class Odd(CPUBackend):
        name = "odd_test"
        kernel_order = {**CPUBackend.kernel_order, "interaction": ("fbgemm", "torch")}

    with pytest.raises(ValueError, match="no interaction implementation 'fbgemm' is registered"):
        Odd().select_kernels(BackendConfig(interaction_kernel="fbgemm"))
    assert Odd().select_kernels()["interaction"].name == "torch"

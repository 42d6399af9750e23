"""Quantized vLLM layers through the daemon and the engine's loader, without an engine: the allow-list of
methods, compressed-tensors schemes and linear kernels (vLLM releases without a pre-processed mode, as 0.26),
its one-line refusal, what the engine rebuilds from the attached tensors (Machete's activation permutation, the
GPTQ/AWQ/compressed-tensors MoE kernels), scratch tensors bound as private copies, and the kernel choice in the
cache key. The classes below stand in for vLLM 0.26's by name and by the attributes weightcache reads."""

from __future__ import annotations

import functools
import types

import pytest
import torch
from torch import nn

pytest.importorskip("vllm", reason="vLLM is not installed")

from weightcache import attach, publish  # noqa: E402
from weightcache.errors import WeightCacheError  # noqa: E402
from weightcache.integrations.vllm import common  # noqa: E402
from weightcache.integrations.vllm import compat as vllm_compat  # noqa: E402
from weightcache.integrations.vllm import loader as vllm_loader  # noqa: E402
from weightcache.integrations.vllm import producer as src  # noqa: E402
from weightcache.integrations.vllm.quantization import describe  # noqa: E402
from weightcache.key import CacheKey  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture
def without_pre_processed_mode(monkeypatch):
    """As vLLM 0.26: no ``weights_already_processed``."""
    monkeypatch.setattr(vllm_compat, "has_pre_processed_mode", lambda: False)


def method(name: str, **attrs):
    """An instance of a quantization method class called ``name`` (a vLLM QuantizeMethodBase)."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    cls = type(name, (QuantizeMethodBase,), {"__module__": "vllm.fake", "create_weights": lambda *a, **k: None,
                                             "apply": lambda *a, **k: None})
    qm = cls()
    qm.__dict__.update(attrs)
    return qm


def kernel(name: str, **attrs):
    """A linear kernel (or compressed-tensors scheme) object: it has apply_weights and process_weights_after_loading."""
    cls = type(name, (), {"__module__": "vllm.fake", "apply_weights": lambda *a: None,
                          "process_weights_after_loading": lambda *a: None})
    k = cls()
    k.__dict__.update(attrs)
    return k


def layer(qm, scheme=None) -> nn.Module:
    m = nn.Module()
    m.quant_method = qm
    if scheme is not None:
        m.scheme = scheme
    return m


def test_allow_list_takes_what_was_read_in_vllm_026(without_pre_processed_mode):
    model = nn.Module()
    model.gptq = layer(method("AutoGPTQLinearMethod", kernel=kernel("MacheteLinearKernel")))
    model.awq = layer(method("AutoAWQMarlinLinearMethod", kernel=kernel("MarlinLinearKernel")))
    model.ct = layer(method("CompressedTensorsLinearMethod"),
                     kernel("CompressedTensorsW8A8Fp8", fp8_linear=kernel("CutlassFP8ScaledMMLinearKernel")))
    model.ct4 = layer(method("CompressedTensorsLinearMethod"),
                      kernel("CompressedTensorsWNA16", kernel=kernel("MacheteLinearKernel")))
    model.mo = layer(method("ModelOptFp8LinearMethod", fp8_linear=kernel("CutlassFP8ScaledMMLinearKernel")))
    model.attn = layer(method("CompressedTensorsKVCacheMethod"))
    model.experts = layer(method("AutoGPTQMoEMethod", moe_kernel=None))
    common.check_quantization(model)
    assert describe(model.ct, model.ct.quant_method) == (
        "CompressedTensorsLinearMethod/CompressedTensorsW8A8Fp8 (kernel CutlassFP8ScaledMMLinearKernel)", True)


def test_anything_else_is_refused_in_one_line_naming_method_scheme_kernel_and_layers(without_pre_processed_mode):
    model = nn.Module()
    model.ok = layer(method("AutoGPTQLinearMethod", kernel=kernel("MacheteLinearKernel")))
    model.w4a8 = layer(method("CompressedTensorsLinearMethod"),
                       kernel("CompressedTensorsW4A8Fp8", kernel=kernel("CutlassW4A8LinearKernel")))
    for i in range(4):
        setattr(model, f"ex{i}", layer(method("AutoGPTQLinearMethod", kernel=kernel("ExllamaLinearKernel"))))
    model.moe = layer(method("ExpertsInt8MoEMethod"))
    with pytest.raises(common.UnsupportedQuantization) as e:
        common.check_quantization(model)
    msg = str(e.value)
    assert "\n" not in msg
    assert ("CompressedTensorsLinearMethod/CompressedTensorsW4A8Fp8 (kernel CutlassW4A8LinearKernel): 1 layer(s), "
            "e.g. w4a8") in msg
    assert "AutoGPTQLinearMethod (kernel ExllamaLinearKernel): 4 layer(s), e.g. ex0, ex1, ex2;" in msg
    assert "ExpertsInt8MoEMethod: 1 layer(s), e.g. moe" in msg
    assert "load this model from disk instead" in msg and "docs/vllm.md" in msg
    assert "MacheteLinearKernel" not in msg


def test_with_a_pre_processed_mode_each_method_speaks_for_itself(monkeypatch):
    monkeypatch.setattr(vllm_compat, "has_pre_processed_mode", lambda: True)
    model = nn.Module()
    model.a = layer(method("AutoGPTQLinearMethod", kernel=kernel("MacheteLinearKernel")))  # declares nothing
    model.b = layer(method("SomeFutureMethod", supports_pre_processed_weights=True, kernel=kernel("Unknown")))
    with pytest.raises(common.UnsupportedQuantization) as e:
        common.check_quantization(model)
    assert "AutoGPTQLinearMethod: 1 layer(s), e.g. a" in str(e.value) and "SomeFutureMethod" not in str(e.value)
    assert "supports_pre_processed_weights" in str(e.value)


# ---- Machete's activation order: captured as "rebuilt", made again by the engine ------------------------------


def _machete_layer(g_idx: torch.Tensor, act_type=torch.float32) -> nn.Module:
    k = kernel("MacheteLinearKernel", w_gidx_name="g_idx",
               config=types.SimpleNamespace(has_g_idx=True, act_type=act_type,
                                            partition_weight_shape=(g_idx.numel(), 8)))
    m = layer(method("AutoGPTQLinearMethod", kernel=k))
    m.g_idx = nn.Parameter(g_idx, requires_grad=False)
    m.qweight = nn.Parameter(torch.zeros(g_idx.numel() // 8, 8, dtype=torch.int32), requires_grad=False)
    return m


def test_machete_activation_order_travels_as_a_rebuild_and_is_made_from_the_attached_g_idx(
        sockdir, without_pre_processed_mode):
    g_idx = torch.tensor([1, 0, 1, 0, 0, 1, 1, 0] * 2, dtype=torch.int32) * 1
    model = nn.Module()
    model.proj = _machete_layer(g_idx)
    before = common.python_state(model)
    # what MacheteLinearKernel.process_weights_after_loading does with act order: a closure over argsort(g_idx),
    # the weight repacked into a new parameter, g_idx left as loaded
    perm = torch.argsort(model.proj.g_idx).to(torch.int)
    model.proj.quant_method.kernel.act_perm = functools.partial(lambda x, p: x[:, p], p=perm)
    model.proj.qweight = nn.Parameter(torch.arange(16, dtype=torch.int32).reshape(2, 8), requires_grad=False)
    tensors, roles = src.capture(model, before)
    meta = common.read_meta(tensors)
    assert meta["rebuild"] == ["proj.quant_method.kernel"]
    assert not any("act_perm" in n for n in list(tensors) + list(meta["scalars"]))

    key = CacheKey(model="machete", content_digest="d", engine="vllm")
    d = publish(tensors, f"{sockdir}/m.sock", key, roles=roles)
    try:
        with attach(f"{sockdir}/m.sock", expect=key) as att:
            with torch.device("meta"):
                engine = nn.Module()
                engine.proj = _machete_layer(torch.empty(16, dtype=torch.int32))
            vllm_loader.bind_tensors(engine, dict(att.tensors), att.roles, meta)
            assert vllm_loader.rebuild_kernels(engine, meta["rebuild"]) == 1
            x = torch.randn(3, 16)
            assert torch.equal(engine.proj.quant_method.kernel.act_perm(x), x[:, perm.long()])
            assert torch.equal(engine.proj.qweight, model.proj.qweight)
    finally:
        d.close()


def test_machete_uses_vllms_permute_op_for_half_precision(without_pre_processed_mode, monkeypatch):
    import vllm._custom_ops as ops

    monkeypatch.setattr(ops, "permute_cols", lambda x, perm: ("permute_cols", perm), raising=False)
    m = _machete_layer(torch.tensor([1, 1, 0, 0, 1, 0, 0, 1], dtype=torch.int32), act_type=torch.bfloat16)
    vllm_compat.rebuild_kernels(m, m.quant_method.kernel)
    act_perm = m.quant_method.kernel.act_perm
    assert isinstance(act_perm, functools.partial) and act_perm.func is ops.permute_cols
    assert act_perm.keywords["perm"].tolist() == torch.argsort(m.g_idx).tolist()


def test_a_kernel_without_activation_order_cannot_be_rebuilt(without_pre_processed_mode):
    m = _machete_layer(torch.zeros(8, dtype=torch.int32))
    m.quant_method.kernel.config.has_g_idx = False
    with pytest.raises(WeightCacheError, match="MacheteLinearKernel: this vLLM has no pre-processed weights mode"):
        vllm_compat.rebuild_kernels(m, m.quant_method.kernel)


def test_rebuild_owners_that_name_no_layer_are_refused():
    model = nn.Module()
    model.proj = _machete_layer(torch.zeros(8, dtype=torch.int32))
    for owner in ("nope.quant_method", "proj.quant_method.nokernel", "proj"):
        with pytest.raises(WeightCacheError, match="has no such layer"):
            vllm_loader.rebuild_kernels(model, [owner])


# ---- MoE kernels, per method, the way each post-processing ends on vLLM 0.26 ----------------------------------


def _moe_layer(qm) -> nn.Module:
    m = layer(qm)
    m._expert_routing_tables = lambda: "routing"
    for name in ("w13_weight_g_idx", "w2_weight_g_idx", "w13_g_idx_sort_indices", "w2_g_idx_sort_indices"):
        setattr(m, name, torch.zeros(2, 0, dtype=torch.int32))
    return m


def test_gptq_and_awq_moe_kernels_come_from_their_own_setup_kernel(without_pre_processed_mode):
    calls = []
    qm = method("AutoGPTQMoEMethod", wna16_moe_backend="MARLIN", experts_cls=object,
                _setup_kernel=lambda lay: calls.append(lay))
    m = _moe_layer(qm)
    vllm_compat.rebuild_kernels(m)
    assert calls == [m]


def test_compressed_tensors_moe_kernels_are_made_as_their_post_processing_ends(without_pre_processed_mode,
                                                                               monkeypatch):
    from vllm.model_executor.layers.fused_moe.oracle import int8, int_wna16

    made = {}
    monkeypatch.setattr(int_wna16, "make_wna16_moe_kernel", lambda **kw: made.setdefault("wna16", kw) and "k16")
    monkeypatch.setattr(int8, "make_int8_moe_kernel", lambda **kw: made.setdefault("int8", kw) and "k8")
    qm = method("CompressedTensorsWNA16MarlinMoEMethod", wna16_backend=int_wna16.WNA16MoEBackend.MARLIN,
                experts_cls="Marlin", moe="moe-config", is_k_full=True, get_fused_moe_quant_config=lambda lay: "qc")
    m = _moe_layer(qm)
    vllm_compat.rebuild_kernels(m)
    kw = made["wna16"]
    assert (qm.moe_kernel, qm.moe_quant_config, kw["moe_config"], kw["experts_cls"], kw["routing_tables"]) == \
        ("k16", "qc", "moe-config", "Marlin", "routing")
    assert kw["w13_g_idx"] is m.w13_weight_g_idx and kw["w2_g_idx_sort_indices"] is m.w2_g_idx_sort_indices
    assert kw["is_k_full"] is True

    qm8 = method("CompressedTensorsW8A8Int8MoEMethod", int8_backend="TRITON", experts_cls="Triton", moe="moe8",
                 get_fused_moe_quant_config=lambda lay: "qc8")
    m8 = _moe_layer(qm8)
    vllm_compat.rebuild_kernels(m8)
    assert qm8.moe_kernel == "k8" and made["int8"]["int8_backend"] == "TRITON" and made["int8"]["layer"] is m8


def test_a_moe_method_weightcache_cannot_rebuild_is_named(without_pre_processed_mode):
    with pytest.raises(WeightCacheError, match="MysteryMoEMethod: this vLLM has no pre-processed weights mode"):
        vllm_compat.rebuild_kernels(_moe_layer(method("MysteryMoEMethod")))


# ---- scratch: Marlin's workspace is the engine's own ----------------------------------------------------------


def test_workspaces_are_bound_as_private_writable_copies(sockdir):
    model = nn.Module()
    model.proj = layer(method("AutoGPTQLinearMethod", kernel=kernel("MarlinLinearKernel")))
    model.proj.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
    before = common.python_state(model)
    model.proj.quant_method.kernel.workspace = torch.zeros(132, dtype=torch.int32)  # marlin_make_workspace_new
    model.proj.quant_method.kernel.is_k_full = True
    model.moe = nn.Module()
    model.moe.workspace = model.proj.quant_method.kernel.workspace  # one workspace under two names
    tensors, roles = src.capture(model, before)
    meta = common.read_meta(tensors)
    assert meta["scalars"]["proj.quant_method.kernel.is_k_full"] == {"v": True}
    key = CacheKey(model="marlin", content_digest="d", engine="vllm")
    d = publish(tensors, f"{sockdir}/w.sock", key, roles=roles)
    try:
        with attach(f"{sockdir}/w.sock", expect=key) as att:
            with torch.device("meta"):
                engine = nn.Module()
                engine.proj = layer(method("AutoGPTQLinearMethod", kernel=kernel("MarlinLinearKernel")))
                engine.proj.weight = nn.Parameter(torch.empty(4, 4), requires_grad=False)
                engine.moe = nn.Module()
            vllm_loader.bind_tensors(engine, dict(att.tensors), att.roles, meta)
            vllm_loader.apply_scalars(engine, meta["scalars"])
            ws = engine.proj.quant_method.kernel.workspace
            shared = att.tensors["proj.quant_method.kernel.workspace"]
            assert torch.equal(ws, shared) and ws.untyped_storage().data_ptr() != shared.untyped_storage().data_ptr()
            assert engine.moe.workspace is ws and engine.proj.quant_method.kernel.is_k_full is True
            ws.fill_(7)  # the kernel's locks: the engine writes them, the daemon's bytes stay
            assert int(shared.sum()) == 0
            assert engine.proj.weight.untyped_storage().data_ptr() == att.tensors["proj.weight"].data_ptr()
    finally:
        d.close()


def test_private_scratch_copies_only_scratch():
    w, ws, other = torch.ones(2), torch.zeros(3), torch.zeros(3)
    out = vllm_loader.private_scratch({"a.weight": w, "a.k.workspace": ws, "b.buf": other},
                                      {"aliases": {"c.workspace": "b.buf"}})
    assert out["a.weight"] is w and out["a.k.workspace"] is not ws and torch.equal(out["a.k.workspace"], ws)
    assert out["b.buf"] is not other  # held as a workspace under another name


# ---- the kernel choice is part of the identity -----------------------------------------------------------------


def test_kernel_choice_reads_the_backends_and_the_environment(monkeypatch):
    from weightcache.integrations.vllm.quantization import kernel_choice

    cfg = types.SimpleNamespace(kernel_config=types.SimpleNamespace(linear_backend="auto", moe_backend="marlin"))
    for name in ("VLLM_DISABLED_KERNELS", "VLLM_TEST_FORCE_FP8_MARLIN", "VLLM_USE_DEEP_GEMM"):
        monkeypatch.delenv(name, raising=False)
    assert kernel_choice(cfg) == "linear=auto,moe=marlin"
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", "MacheteLinearKernel")
    monkeypatch.setenv("VLLM_HOST_IP", "10.0.0.1")  # not a kernel choice
    assert kernel_choice(cfg) == "linear=auto,moe=marlin,VLLM_DISABLED_KERNELS=MacheteLinearKernel"
    assert kernel_choice(types.SimpleNamespace()).startswith("linear=auto,moe=auto")


def test_a_quantization_method_that_is_itself_a_module_is_found_on_its_layer(without_pre_processed_mode):
    """vLLM's MoE methods are modules (CustomOp): the owner "<layer>.quant_method" names a module too."""
    calls = []

    class ModuleMethod(nn.Module):
        def __init__(self):
            super().__init__()
            self.wna16_moe_backend = "MARLIN"

        def _setup_kernel(self, lay):
            calls.append(lay)

    model = nn.Module()
    model.experts = nn.Module()
    model.experts.routed = nn.Module()
    model.experts.routed.quant_method = ModuleMethod()
    assert vllm_loader.rebuild_kernels(model, ["experts.routed.quant_method"]) == 1
    assert calls == [model.experts.routed]

"""vLLM integration pieces that need vLLM importable but no engine: plugin registration, options, capture
and rebinding of a model's tensors and host-side state through a real daemon, the quantization allow-list,
parity and the preload front end's argument errors."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("vllm", reason="vLLM is not installed")

from weightcache import attach, publish
from weightcache.errors import WeightCacheError
from weightcache.integrations.model_state import parity
from weightcache.integrations.vllm import common
from weightcache.integrations.vllm import loader as vllm_loader
from weightcache.integrations.vllm import producer as src
from weightcache.integrations.vllm.loader import Options, bind_tensors
from weightcache.key import CacheKey

pytestmark = pytest.mark.vllm


def test_entry_point_registers_the_load_format():
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    eps = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "weightcache"]
    assert len(eps) == 1 and eps[0].value == "weightcache.integrations.vllm.plugin:register"
    register = eps[0].load()
    register()
    register()  # every vLLM process loads plugins; twice is harmless
    loader = get_model_loader(LoadConfig(load_format="weightcache",
                                         model_loader_extra_config={"mode": "copy", "fallback": "true"}))
    assert isinstance(loader, vllm_loader.WeightCacheModelLoader)
    assert loader.options == Options(mode="copy", fallback=True)


@pytest.mark.parametrize("extra, message", [
    ({"mode": "zero_copy"}, "'map' or 'copy'"),
    ({"socket": "/tmp/x"}, "unknown --model-loader-extra-config key(s)"),
    ({"fallback": "maybe"}, "true or false"),
    ({"wait": -1}, ">= 0"),
    ({"wait": "soon"}, "number of seconds"),
])
def test_bad_options_are_refused(extra, message):
    with pytest.raises(ValueError) as e:
        Options.parse(extra)
    assert message in str(e.value)


def test_options_defaults():
    o = Options.parse({})
    assert (o.socket_dir, o.mode, o.fallback, o.wait) == (None, "map", False, vllm_loader.DEFAULT_WAIT_S)
    assert Options.parse({"socket_dir": "/s", "wait": "5", "fallback": False}) == Options("/s", "map", False, 5.0)


class Block(nn.Module):
    """A model with what vLLM models have: tied and aliased parameters, a non-contiguous view sharing a
    parameter's storage, persistent and non-persistent buffers, plain tensor attributes."""

    def __init__(self, device="cpu"):
        super().__init__()
        self.embed = nn.Parameter(torch.empty(16, 8, device=device), requires_grad=False)
        self.proj = nn.Linear(8, 6, bias=True, device=device)
        self.proj.k_scale = nn.Parameter(torch.empty((), device=device), requires_grad=False)  # a placeholder
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(8, device=device), requires_grad=False)
        self.register_buffer("table", torch.empty(4, 8, device=device))
        self.register_buffer("cache", torch.empty(3, device=device), persistent=False)
        self.rope = nn.Module()
        self.rope.register_buffer("cos_sin", torch.empty(5, 2, device=device), persistent=False)
        self.rope2 = self.rope  # one module under two names, like vLLM's shared rotary embeddings


def _loaded_block():
    torch.manual_seed(0)
    m = Block()
    before = common.python_state(m)
    with torch.no_grad():
        m.embed.normal_()
        m.proj.weight.normal_()
        m.proj.bias.normal_()
        m.norm.weight.normal_()
        m.table.normal_()
        m.cache.normal_()
        m.rope.cos_sin.normal_()
    # what post-processing does: views sharing storage, scale attributes, host scalars, deletions
    m.w_t = m.proj.weight.t()  # non-contiguous view of a parameter
    m.scale_cpu = torch.tensor(0.5)
    m.scale_float = 0.5
    m.proj.input_scale = None
    m.lm_head = m.embed  # tied (same object under two names)
    m.proj.bias = None
    del m.proj.k_scale
    return m, before


def test_capture_publish_attach_bind_roundtrip(sockdir):
    model, before = _loaded_block()
    tensors, roles = src.capture(model, before)
    meta = common.read_meta(tensors)
    assert meta["aliases"]["lm_head"] == "embed"
    assert meta["scalars"]["scale_float"] == {"v": 0.5} and meta["scalars"]["proj.input_scale"] == {"v": None}
    assert meta["deleted"] == ["proj.k_scale"] and meta["scalars"]["proj.bias"] == {"v": None}
    assert roles["cache"] == "nonpersistent_buffer" and roles["table"] == "buffer"
    assert roles["w_t"] == "attribute" and roles["scale_cpu"] == "attribute"
    assert meta["aliases"]["rope2.cos_sin"] == "rope.cos_sin" and "rope2.cos_sin" not in tensors

    key = CacheKey(model="block", content_digest="d", engine="vllm")
    d = publish(tensors, f"{sockdir}/b.sock", key, roles=roles)
    try:
        with attach(f"{sockdir}/b.sock", expect=key) as att:
            assert len(att.manifest.storages) == len({t.untyped_storage().data_ptr() for t in tensors.values()})
            with torch.device("meta"):
                engine = Block()
            vllm_loader.apply_deletions(engine, meta["deleted"])
            bind_tensors(engine, dict(att.tensors), att.roles, meta)
            vllm_loader.apply_scalars(engine, meta["scalars"])
            assert vllm_loader.leftover_meta(engine, torch.device("cpu")) == []
            assert engine.lm_head is engine.embed  # tie kept: one Parameter
            assert engine.rope2.cos_sin is engine.rope.cos_sin
            assert engine.proj.bias is None and engine.proj.input_scale is None and engine.scale_float == 0.5
            assert not hasattr(engine.proj, "k_scale")
            assert engine.w_t.stride() == (1, 8) and not engine.w_t.is_contiguous()
            assert engine.w_t.untyped_storage().data_ptr() == engine.proj.weight.untyped_storage().data_ptr()
            assert "cache" in engine._non_persistent_buffers_set and "cache" not in engine.state_dict()
            assert isinstance(engine.proj.weight, nn.Parameter) and not engine.proj.weight.requires_grad
            assert parity(_state(model), _state(engine)) == []
            x = torch.randn(2, 8)
            assert torch.equal(engine.proj(x), model.proj(x))
    finally:
        d.close()


def _state(m):
    tensors, _ = common.reachable_tensors(m)
    return dict(tensors)


def test_parity_reports_every_kind_of_difference():
    a = {"x": torch.arange(4.0), "y": torch.ones(2), "z": torch.zeros(3, dtype=torch.bfloat16)}
    b = {"x": torch.arange(4.0), "y": torch.tensor([1.0, 1.0000001]), "w": torch.ones(1), "z": torch.zeros(3)}
    assert parity(a, a) == []
    diffs = parity(a, b)
    assert "unexpected: w" in diffs and "y: bytes differ" in diffs and "x: bytes differ" not in diffs
    assert "z: torch.bfloat16[3] vs torch.float32[3]" in diffs
    assert parity(b, a)[0] == "missing: w"
    assert parity({"nan": torch.tensor([float("nan")])}, {"nan": torch.tensor([float("nan")])}) == []


def test_state_created_by_loading_that_cannot_be_shared_is_refused():
    model, before = _loaded_block()
    model.proj.kernel = object()  # an opaque object made by post-processing
    with pytest.raises(common.UnsupportedQuantization, match=r"proj\.kernel \(object\)"):
        src.capture(model, before)


def test_kernels_made_by_post_processing_are_rebuilt_not_shipped():
    model, before = _loaded_block()
    model.moe = nn.Module()
    model.moe.quant_method = type("Method", (), {"__module__": "vllm.fake_moe"})()
    before = common.python_state(model)  # as constructed: the method holds no kernel yet
    model.moe.quant_method.moe_kernel = object()  # made from the processed weights (opaque, unshareable)
    model.moe.quant_method.moe_quant_config = object()
    tensors, _ = src.capture(model, before)
    meta = common.read_meta(tensors)
    assert meta["rebuild"] == ["moe.quant_method"]
    assert not any("moe_kernel" in n for n in tensors) and not any("moe_kernel" in n for n in meta["scalars"])


def test_quantization_outside_the_allow_list_is_refused():
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    class PackedInt4Method(QuantizeMethodBase):  # a quantization plugin's method
        def create_weights(self, layer, *args, **kwargs):
            pass

        def apply(self, layer, *args, **kwargs):
            return None

    model = nn.Module()
    model.a = nn.Module()
    model.a.quant_method = UnquantizedLinearMethod()
    common.check_quantization(model)
    model.b = nn.Module()
    model.b.quant_method = PackedInt4Method()
    with pytest.raises(common.UnsupportedQuantization) as e:
        common.check_quantization(model)
    assert "PackedInt4Method: 1 layer(s), e.g. b" in str(e.value)
    assert "load this model from disk" in str(e.value)


def test_layout_string_matches_the_preload_layout():
    from weightcache.preload.layout import Layout

    class PC:
        data_parallel_size, pipeline_parallel_size, tensor_parallel_size, enable_expert_parallel = 2, 1, 4, True

    assert common.layout_string(PC) == Layout(tp=4, dp=2, ep=True, device_type="cpu").describe() == "dp2-pp1-tp4-ep8"


def test_read_meta_refuses_a_cache_from_another_front_end():
    with pytest.raises(WeightCacheError, match="not a `preload --engine vllm` cache"):
        common.read_meta({"w": torch.zeros(1)})


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent", "--load-format", "weightcache"], "drop --load-format weightcache"),
    (["--engine", "transformers", "--model", "x"], "--engine vllm only"),
])
def test_preload_front_end_refuses_bad_flags(argv, message):
    r = subprocess.run([sys.executable, "-m", "weightcache.preload.vllm_frontend", *argv], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert message in r.stderr


def test_versions_outside_the_tested_range_get_one_clear_warning():
    from weightcache.integrations.vllm.compat import version_note

    assert version_note("0.26.0") is None and version_note("0.34.1") is None and version_note("0.32.0+cpu") is None
    for v in ("0.25.1", "0.35.0", "1.0.0", "dev"):
        note = version_note(v)
        assert note and f"this is vLLM {v}" in note and "0.26 to 0.34" in note


def test_engine_budget_counts_the_daemons_bytes_once():
    from weightcache.integrations.vllm.compat import engine_budget

    gib = 2**30
    # 100 GiB device, 0.9 utilization, daemons hold 30 GiB (already in use, so 70 GiB free)
    assert engine_budget(100 * gib, 70 * gib, 0.9, 30 * gib) == 60 * gib
    with pytest.raises(ValueError, match="exceed the --gpu-memory-utilization budget"):
        engine_budget(100 * gib, 70 * gib, 0.2, 30 * gib)
    with pytest.raises(ValueError, match="free memory on the device"):
        engine_budget(100 * gib, 50 * gib, 0.9, 30 * gib)


def test_budget_shim_wraps_request_memory_only_for_weightcache(monkeypatch):
    """vLLM releases without get_external_weight_memory: the GPU worker's request_memory is wrapped."""
    import types

    from weightcache.integrations.vllm import compat as vllm_compat
    from weightcache.integrations.vllm.loader import WeightCacheModelLoader

    calls = []
    fake = types.SimpleNamespace(request_memory=lambda snap, cc: calls.append("original") or 123)
    vllm_compat._wrap_request_memory(fake, lambda load_config, c: WeightCacheModelLoader(load_config)
                                     .get_external_weight_memory(c))
    snap = types.SimpleNamespace(total_memory=100 << 30, free_memory=90 << 30)
    cache = types.SimpleNamespace(gpu_memory_utilization=0.5)
    cfg = types.SimpleNamespace(load_config=types.SimpleNamespace(load_format="auto", model_loader_extra_config={}))
    monkeypatch.setattr("vllm.config.get_current_vllm_config", lambda: cfg)
    assert fake.request_memory(snap, cache) == 123 and calls == ["original"]
    cfg.load_config.load_format = "weightcache"
    monkeypatch.setattr(WeightCacheModelLoader, "get_external_weight_memory", lambda self, c: 10 << 30)
    assert fake.request_memory(snap, cache) == (50 << 30) - (10 << 30)
    assert calls == ["original"]


def test_skeleton_falls_back_to_parameters_on_meta_when_construction_reads_values():
    """Expert parallelism computes its expert map from tensor values at construction: that cannot run on
    the meta device, so the skeleton is rebuilt with only the parameters on meta."""
    registry = {}
    attempts = []

    class ExpertMapped(nn.Module):
        def __init__(self):
            super().__init__()
            registry[f"layer{len(attempts)}"] = self  # what vLLM's layer registry records while building
            attempts.append(1)
            self.local = torch.nonzero(torch.tensor([0, 1, 1])).flatten()  # data-dependent
            self.proj = nn.Linear(4, 4)

    m = vllm_loader._skeleton(ExpertMapped, torch.device("cpu"), registry)
    assert len(attempts) == 2 and list(registry) == ["layer1"]  # the failed attempt's entry is gone
    assert m.proj.weight.is_meta and m.proj.bias.is_meta
    assert m.local.tolist() == [1, 2]
    plain = vllm_loader._skeleton(lambda: nn.Linear(2, 2), torch.device("cpu"), {})
    assert plain.weight.is_meta


def test_the_front_end_plans_a_local_one_node_preload_from_the_flags(tmp_path):
    """Those start their daemons without importing vLLM; anything that needs vLLM's config to plan goes through it."""
    from weightcache.preload.vllm_frontend import _light_plan

    m = str(tmp_path)
    plan = _light_plan([m, "--tensor_parallel_size=2", "-pp", "2", "--enable-expert-parallel", "--dtype", "bfloat16"])
    assert plan is not None and (plan["model"], plan["tp"], plan["pp"], plan["ep"]) == (m, 2, 2, True)
    assert _light_plan(["--model", m, "--max-model-len", "-1"])["tp"] == 1
    for needs_vllm in ([m, "-dp", "2"], [m, "--data-parallel-size-local", "1"], [m, "--nnodes", "2"],
                       [m, "--speculative-config", "{}"], [m, "--config", "c.yaml"], [m, "--help"],
                       [m, "-tp", "two"], [str(tmp_path / "absent")], ["org/model-on-the-hub"]):
        assert _light_plan(needs_vllm) is None, needs_vllm


def test_an_attach_freezes_the_start_up_heap_and_later_garbage_is_still_collected():
    """vLLM's memory profiler collects twice after the loader returns: with the start-up heap frozen those passes
    skip it. Young garbage goes first (it must not be frozen), and garbage made later is still collected."""
    import gc
    import weakref

    from weightcache.integrations.vllm.loader import freeze_startup_heap

    class Cycle:
        def __init__(self):
            self.me = self

    before = Cycle()
    gone_before = weakref.ref(before)
    del before
    frozen = gc.get_freeze_count()
    try:
        freeze_startup_heap()
        assert gone_before() is None
        assert gc.get_freeze_count() > frozen
        after = Cycle()
        gone_after = weakref.ref(after)
        del after
        gc.collect()
        assert gone_after() is None
    finally:
        gc.unfreeze()

"""The pre-quantized random checkpoints of ``weightcache.testing.quantized``: every tensor has the name, dtype and
shape vLLM 0.26's ``create_weights`` gives the parameter it is loaded into (read in vLLM 0.26.0's source, cited
per layout below), the integers decode back to the bf16 weights they were made from (with vLLM's own unpacking
where the CPU build has it), and vLLM's CPU build loads the ones it has kernels for: GPTQ and compressed-tensors
W4A16 decode to the very same weights (same tokens), as do AWQ and compressed-tensors asymmetric W4A16."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from weightcache.testing import quantized as q
from weightcache.testing.checkpoints import make_checkpoint
from weightcache.testing.int_packing import awq_pack, group_index, pack_int32, quantize_groups

DENSE = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512, vocab_size=512)
MOE = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, num_experts=4, moe_intermediate_size=128,
           vocab_size=512)
SHAPES = {"qwen3": DENSE, "qwen3_moe": MOE, "mixtral": MOE}
I32, I64, I8, F16, BF16, F32, F8 = (torch.int32, torch.int64, torch.int8, torch.float16, torch.bfloat16,
                                    torch.float32, torch.float8_e4m3fn)

# kind, maker options; the layouts below follow vLLM 0.26's create_weights for each
CASES = {
    "gptq4": ("gptq", {}), "gptq4-act": ("gptq", {"desc_act": True}), "gptq8": ("gptq", {"bits": 8}),
    "gptq8-act": ("gptq", {"bits": 8, "desc_act": True}), "awq": ("awq", {}),
    "ct-w4a16": ("ct-wna16", {}), "ct-w4a16-asym": ("ct-wna16", {"symmetric": False}),
    "ct-w4a16-act": ("ct-wna16", {"actorder": True}), "ct-w8a16": ("ct-wna16", {"num_bits": 8}),
    "ct-int8": ("ct-int8", {}), "ct-int8-static": ("ct-int8", {"dynamic": False}),
    "ct-fp8-channel": ("ct-fp8", {}), "ct-fp8-tensor-static-kv": ("ct-fp8", {"strategy": "tensor", "dynamic": False,
                                                                             "kv_cache": True}),
    "modelopt-fp8": ("modelopt-fp8", {}), "fp8-block": ("fp8-block", {}),
}
MOE_CASES = ("gptq4-act", "awq", "ct-w4a16-asym", "ct-int8", "ct-fp8-tensor-static-kv", "modelopt-fp8")


def expected_layout(kind: str, out: int, inp: int, opts: dict) -> dict[str, tuple[torch.dtype, tuple]]:
    """Suffix -> (dtype, shape) of one linear layer's (or one expert's projection's) tensors on disk."""
    groups = inp // opts.get("group_size", 128)
    if kind == "gptq":  # AutoGPTQLinearMethod.create_weights: qweight [in/pf, out], qzeros [G, out/pf], scales [G, out]
        pf = 32 // opts.get("bits", 4)
        return {"qweight": (I32, (inp // pf, out)), "qzeros": (I32, (groups, out // pf)),
                "scales": (F16, (groups, out)), "g_idx": (I32, (inp,))}
    if kind == "awq":  # AutoAWQMarlinLinearMethod.create_weights: qweight [in, out/8], qzeros [G, out/8]
        return {"qweight": (I32, (inp, out // 8)), "qzeros": (I32, (groups, out // 8)), "scales": (F16, (groups, out))}
    if kind == "ct-wna16":  # CompressedTensorsWNA16.create_weights: packed along the input dim, zero points along out
        pf = 32 // opts.get("num_bits", 4)
        layout = {"weight_packed": (I32, (out, inp // pf)), "weight_scale": (BF16, (out, groups)),
                  "weight_shape": (I64, (2,))}
        if not opts.get("symmetric", True):
            layout["weight_zero_point"] = (I32, (out // pf, groups))
        if opts.get("actorder"):
            layout["weight_g_idx"] = (I32, (inp,))
        return layout
    if kind in ("ct-fp8", "ct-int8"):  # create_fp8_scale_parameter (channel [out, 1], tensor one per shard)
        tensor = opts.get("strategy") == "tensor"
        layout = {"weight": (F8 if kind == "ct-fp8" else I8, (out, inp)),
                  "weight_scale": (F32, (1,) if tensor else (out, 1))}
        if not opts.get("dynamic", True):
            layout["input_scale"] = (F32, (1,))
        return layout
    if kind == "modelopt-fp8":  # ModelOptFp8LinearMethod: PerTensorScaleParameter, one scalar per shard
        return {"weight": (F8, (out, inp)), "weight_scale": (F32, ()), "input_scale": (F32, ())}
    if kind == "fp8-block":  # Fp8LinearMethod block: BlockQuantScaleParameter [ceil(out/128), ceil(in/128)]
        return {"weight": (F8, (out, inp)), "weight_scale_inv": (F32, (math.ceil(out / 128), math.ceil(inp / 128)))}
    raise AssertionError(kind)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The bf16 checkpoint each maker starts from (same family, seed and shape): module -> weight."""
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("bases")
    out = {}
    for family, shape in SHAPES.items():
        path = make_checkpoint(root / family, family, dtype=torch.bfloat16, seed=0, **shape)
        out[family] = load_file(str(path / "model.safetensors"))
    return out


def _read(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _make(tmp_path: Path, case: str, family: str) -> Path:
    kind, opts = CASES[case]
    return q.MAKERS[kind](tmp_path / f"{case}-{family}", family, **opts, **SHAPES[family])


@pytest.mark.parametrize("family, case", [("qwen3", c) for c in CASES] + [("qwen3_moe", c) for c in MOE_CASES]
                         + [("mixtral", "gptq4"), ("mixtral", "ct-fp8-channel")])
def test_every_tensor_has_the_layout_vllm_creates_for_it(tmp_path, bases, family, case):
    kind, opts = CASES[case]
    tensors = _read(_make(tmp_path, case, family))
    base = bases[family]
    targets = [n for n, t in base.items() if q._is_quant_target(n, t.shape)]
    assert targets and any(".experts." in n for n in targets) == (family != "qwen3")
    seen = set()
    for name in targets:
        module = name[: -len(".weight")]
        out, inp = base[name].shape
        for suffix, (dtype, shape) in expected_layout(kind, out, inp, opts).items():
            t = tensors[f"{module}.{suffix}"]
            assert (t.dtype, tuple(t.shape)) == (dtype, shape), f"{module}.{suffix}"
            seen.add(f"{module}.{suffix}")
    kv = {n for n in tensors if n.endswith(("k_scale", "v_scale"))}
    assert bool(kv) == bool(opts.get("kv_cache", kind == "modelopt-fp8"))
    assert all(tensors[n].dtype == F32 and tensors[n].numel() == 1 for n in kv)
    untouched = {n for n in base if n not in targets}
    assert set(tensors) == seen | untouched | kv, "no tensor beyond the layout"
    assert all(torch.equal(tensors[n], base[n]) for n in untouched)  # embeddings, norms, routers, LM head


def test_quantization_configs_are_the_tools(tmp_path):
    gptq = json.loads((_make(tmp_path, "gptq4-act", "qwen3") / "config.json").read_text())["quantization_config"]
    assert (gptq["quant_method"], gptq["bits"], gptq["group_size"], gptq["desc_act"], gptq["sym"]) == \
        ("gptq", 4, 128, True, True)
    assert "self_attn.q_proj" in gptq["modules_in_block_to_quantize"][0]
    awq = json.loads((_make(tmp_path, "awq", "qwen3_moe") / "config.json").read_text())["quantization_config"]
    assert (awq["quant_method"], awq["version"], awq["zero_point"]) == ("awq", "gemm", True)
    assert "model.layers.0.mlp.gate" in awq["modules_to_not_convert"] and "lm_head" in awq["modules_to_not_convert"]
    ct = json.loads((_make(tmp_path, "ct-w4a16-act", "qwen3_moe") / "config.json").read_text())["quantization_config"]
    group = ct["config_groups"]["group_0"]
    assert (ct["quant_method"], ct["format"], group["weights"]["actorder"], group["input_activations"]) == \
        ("compressed-tensors", "pack-quantized", "group", None)
    assert ct["ignore"] == ["lm_head", "re:.*mlp.gate$"]
    kv = json.loads((_make(tmp_path, "ct-fp8-tensor-static-kv", "qwen3") / "config.json").read_text())
    assert kv["quantization_config"]["kv_cache_scheme"]["type"] == "float"
    mo = _make(tmp_path, "modelopt-fp8", "qwen3_moe")
    assert "quantization_config" not in json.loads((mo / "config.json").read_text())
    hf = json.loads((mo / "hf_quant_config.json").read_text())
    assert hf["producer"]["name"] == "modelopt" and hf["quantization"]["quant_algo"] == "FP8"
    assert hf["quantization"]["exclude_modules"] == ["lm_head", "model.layers.*.mlp.gate"]
    lazy = json.loads((q.make_gptq_checkpoint(tmp_path / "lazy", describe_modules=False, **DENSE) /
                       "config.json").read_text())["quantization_config"]
    assert lazy["modules_in_block_to_quantize"] is None
    block = json.loads((_make(tmp_path, "fp8-block", "qwen3_moe") / "config.json").read_text())["quantization_config"]
    assert block["modules_to_not_convert"] == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]


def test_packing_puts_value_i_in_bits_i_times_b():
    v = torch.arange(16, dtype=torch.int32).reshape(2, 8) % 16
    assert pack_int32(v, 4, dim=1)[0, 0].item() == 0x76543210
    assert pack_int32(v.t(), 4, dim=0)[0, 0].item() == 0x76543210
    assert pack_int32(torch.full((1, 8), 15), 4, dim=1).item() == -1  # all bits set: the int32 -1
    assert pack_int32(torch.tensor([[1, 2, 3, 255]]), 8, dim=1).item() == 0xFF030201 - (1 << 32)
    cols = torch.arange(8, dtype=torch.int32).reshape(1, 8)
    assert awq_pack(cols).item() == 0x75316420  # slot i <- column (0, 2, 4, 6, 1, 3, 5, 7)[i]
    with pytest.raises(ValueError, match="multiple of 8 values per word"):
        pack_int32(torch.zeros(1, 6, dtype=torch.int32), 4, dim=1)
    g = group_index(8, 4, torch.tensor([3, 1, 0, 2, 7, 4, 6, 5]))
    assert g.tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and group_index(8, 4).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert group_index(8, 2, torch.tensor([7, 6, 5, 4, 3, 2, 1, 0])).tolist() == [3, 3, 2, 2, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_index(10, 4)


@pytest.mark.parametrize("bits, symmetric, act", [(4, True, False), (8, True, True), (4, False, False)])
def test_group_quantization_is_within_half_a_step(bits, symmetric, act):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(2)) if act else None
    qv, scale, zero, g_idx = quantize_groups(w, bits, 128, symmetric=symmetric, perm=perm)
    assert qv.min() >= 0 and qv.max() < 2 ** bits and torch.equal(scale, scale.to(torch.bfloat16).float())
    back = (qv - zero[:, g_idx.long()]).float() * scale[:, g_idx.long()]
    assert ((back - w).abs() <= scale[:, g_idx.long()] / 2 + 1e-7).all()
    assert (g_idx.bincount() == 128).all()


# ---- decoding with vLLM's own unpacking ------------------------------------------------------------------------


def _module_weights(base: dict):
    return {n[: -len(".weight")]: t.float() for n, t in base.items() if q._is_quant_target(n, t.shape)}


def _close(module, back, w, step):
    assert ((back - w).abs() <= step / 2 + 1e-3 * step + 1e-8).all(), module


@pytest.mark.vllm
@pytest.mark.parametrize("case", ["gptq4", "gptq4-act", "gptq8-act", "awq", "ct-w4a16", "ct-w4a16-asym",
                                  "ct-w4a16-act", "ct-w8a16"])
def test_integers_decode_to_the_weights_with_vllms_unpacking(tmp_path, bases, case, monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    import vllm.model_executor.parameter as vllm_parameter

    monkeypatch.setattr(vllm_parameter, "get_tensor_model_parallel_rank", lambda: 0)  # vLLM's parameters ask
    monkeypatch.setattr(vllm_parameter, "get_tensor_model_parallel_world_size", lambda: 1)
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    kind, opts = CASES[case]
    family = "qwen3_moe" if case in MOE_CASES else "qwen3"
    tensors = _read(_make(tmp_path, case, family))
    for module, w in _module_weights(bases[family]).items():
        t = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == module}
        if kind == "gptq":
            bits = opts.get("bits", 4)
            vals = unpack_quantized_values_into_int32(t["qweight"], scalar_types.uint4 if bits == 4 else
                                                      scalar_types.uint8, packed_dim=0).t()  # [out, in]
            g = t["g_idx"].long()
            scale = t["scales"].float().t()[:, g]
            back = (vals - (1 << (bits - 1))).float() * scale  # symmetric: the b8 / b128 offset
            zeros = unpack_quantized_values_into_int32(t["qzeros"], scalar_types.uint4 if bits == 4 else
                                                       scalar_types.uint8, packed_dim=1)
            assert (zeros == (1 << (bits - 1)) - 1).all()  # AutoGPTQ stores zero - 1
        elif kind == "awq":
            back, scale = _awq_through_vllm(t)
        else:
            bits = opts.get("num_bits", 4)
            stype = scalar_types.uint4 if bits == 4 else scalar_types.uint8
            vals = unpack_quantized_values_into_int32(t["weight_packed"], stype, packed_dim=1)
            g = t["weight_g_idx"].long() if "weight_g_idx" in t else torch.arange(w.shape[1]) // 128
            scale = t["weight_scale"].float()[:, g]
            zero = (unpack_quantized_values_into_int32(t["weight_zero_point"], stype, packed_dim=0)[:, g]
                    if "weight_zero_point" in t else 1 << (bits - 1))
            back = (vals - zero).float() * scale
            assert t["weight_shape"].tolist() == list(w.shape)
        _close(module, back, w, scale)


def _awq_through_vllm(t: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's tensors converted by vLLM's own AutoAWQ reader to the standard (GPTQ-like) layout, then decoded."""
    from torch import nn
    from vllm.model_executor.layers.quantization.auto_awq import _convert_awq_to_standard_format
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    layer = nn.Module()
    layer.qweight = nn.Parameter(t["qweight"], requires_grad=False)
    layer.qzeros = nn.Parameter(t["qzeros"], requires_grad=False)
    _convert_awq_to_standard_format(layer, "qweight", "qzeros", 4)
    vals = unpack_quantized_values_into_int32(layer.qweight.data, scalar_types.uint4, packed_dim=0).t()  # [out, in]
    zeros = unpack_quantized_values_into_int32(layer.qzeros.data, scalar_types.uint4, packed_dim=0)  # [out, G]
    g = torch.arange(vals.shape[1]) // 128
    scale = t["scales"].float().t()[:, g]
    return (vals - zeros[:, g]).float() * scale, scale


@pytest.mark.parametrize("case", ["ct-fp8-channel", "ct-fp8-tensor-static-kv", "modelopt-fp8", "ct-int8"])
def test_eight_bit_weights_decode_to_the_weights(tmp_path, bases, case):
    tensors = _read(_make(tmp_path, case, "qwen3"))
    for module, w in _module_weights(bases["qwen3"]).items():
        qv, s = tensors[f"{module}.weight"].float(), tensors[f"{module}.weight_scale"].float()
        back = qv * (s if s.dim() else s.reshape(()))
        if case == "ct-int8":
            _close(module, back, w, s.expand_as(w))
        else:  # e4m3: 3 mantissa bits, a relative error of at most 1/16
            assert ((back - w).abs() <= w.abs() / 16 + s * 2 ** -9).all(), module


@pytest.mark.parametrize("family, case", [("qwen3_moe", "ct-fp8-tensor-static-kv"), ("qwen3_moe", "ct-int8-static"),
                                          ("mixtral", "modelopt-fp8")])
def test_static_input_scales_are_shared_by_the_layers_that_read_the_same_input(tmp_path, family, case):
    """vLLM fuses q/k/v and gate/up (an expert's w1/w3) and refuses w1 and w3 input scales that differ."""
    scales = {k[: -len(".input_scale")]: v.item() for k, v in _read(_make(tmp_path, case, family)).items()
              if k.endswith(".input_scale")}
    same = [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")]
    same += [("block_sparse_moe.experts.1.w1", "block_sparse_moe.experts.1.w3")] if family == "mixtral" else \
        [("mlp.experts.1.gate_proj", "mlp.experts.1.up_proj")]
    for group in same:
        assert len({scales[f"model.layers.0.{m}"] for m in group}) == 1, group
    assert len(set(scales.values())) > len(scales) // 3  # the rest differ, as calibrated scales do


@pytest.mark.vllm
def test_vllm_builds_the_routers_of_a_block_fp8_moe_checkpoint_unquantized(tmp_path):
    """The bf16 routers are named in modules_to_not_convert: vLLM's Fp8Config skips them (else it builds a router
    as a block-FP8 layer whose scales the checkpoint never fills)."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    cfg = json.loads((_make(tmp_path, "fp8-block", "qwen3_moe") / "config.json").read_text())["quantization_config"]
    qc = Fp8Config.from_config(cfg)
    assert is_layer_skipped("model.layers.1.mlp.gate", qc.ignored_layers, {})
    assert not is_layer_skipped("model.layers.1.self_attn.q_proj", qc.ignored_layers, {})


LLAMA = dict(hidden_size=256, num_layers=2, intermediate_size=512, num_heads=4, num_kv_heads=2, vocab_size=1024)


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as opened:
            out.update({k: opened.get_tensor(k) for k in opened.keys()})  # noqa: SIM118
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_a_large_gptq_checkpoint_is_written_in_gptqs_layout_shard_by_shard(tmp_path, bits):
    """The at-scale GPTQ maker (for memory runs) writes what the quantizing maker writes: the same names, dtypes,
    shapes and config, the symmetric zero point, each channel's group, positive scales; in several shards."""
    from weightcache.testing.checkpoints import llama_param_shapes

    path = q.make_large_gptq_checkpoint(tmp_path / "big", bits=bits, max_shard_bytes=200_000, **LLAMA)
    tensors = _read_all(path)
    assert len(list(path.glob("*.safetensors"))) > 2 and (path / "model.safetensors.index.json").exists()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == q.gptq_llama_bytes(bits=bits, **LLAMA)
    expected, modules = {}, []
    for name, dims in llama_param_shapes(**LLAMA).items():
        if q._is_quant_target(name, dims):
            module, (out, inp) = name[: -len(".weight")], dims
            modules.append(module)
            expected.update({f"{module}.{k}": v for k, v in expected_layout("gptq", out, inp, {"bits": bits}).items()})
        else:
            expected[name] = (F16, dims)
    assert {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()} == expected
    per_word = 32 // bits
    for module in modules:
        zeros = tensors[f"{module}.qzeros"]
        shifts = torch.arange(per_word) * bits
        values = (zeros.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        assert bool((values == (1 << (bits - 1)) - 1).all()), module  # GPTQ stores zero - 1
        inp = tensors[f"{module}.g_idx"].numel()
        assert torch.equal(tensors[f"{module}.g_idx"], (torch.arange(inp) // 128).to(torch.int32))
        scales = tensors[f"{module}.scales"].float()
        assert bool((scales > 0).all() and scales.isfinite().all())
    assert tensors[f"{modules[0]}.qweight"].unique().numel() > 100  # random words, not a constant
    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    assert cfg == q._gptq_config(bits, 128, False, modules)
    assert cfg["modules_in_block_to_quantize"] == [sorted({m.split(".", 3)[3] for m in modules})]
    assert (path / "tokenizer.json").exists()


@pytest.mark.parametrize("target", [50e6, 16e9, 52e9])
def test_a_gptq_llama_is_fitted_to_the_size_asked_for(target):
    shape = q.gptq_llama_shape_for_bytes(int(target))
    assert abs(q.gptq_llama_bytes(**shape) / target - 1) < 0.05
    assert shape["intermediate_size"] % 128 == 0 and shape["hidden_size"] % 128 == 0


def test_a_large_gptq_checkpoint_refuses_a_shape_gptq_cannot_pack(tmp_path):
    with pytest.raises(ValueError, match="GPTQ needs in % 128"):
        q.make_large_gptq_checkpoint(tmp_path / "bad", **{**LLAMA, "intermediate_size": 200})
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        q.make_large_gptq_checkpoint(tmp_path / "bad", bits=3, **LLAMA)


# ---- vLLM's CPU build loads them -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_work(tmp_path_factory):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from vllm_harness import new_work

    return new_work(tmp_path_factory.mktemp("qcpu"), {"max_tokens": 8}, tiny="")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("pair", [("gptq4", "ct-w4a16"), ("awq", "ct-w4a16-asym")])
def test_vllm_cpu_decodes_two_formats_to_the_same_model(cpu_work, tmp_path, pair):
    """The same weights in two tools' layouts (scales snapped to values both store exactly): vLLM's CPU build
    generates the same tokens from both, so both layouts are read as the same numbers."""
    from vllm_harness import ok, run_engine

    a, b = (ok(run_engine(cpu_work, {"model": str(_make(tmp_path, c, "qwen3"))})) for c in pair)
    assert a["tokens"] == b["tokens"] and len(a["tokens"][0]) == 8


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_cpu_runs_the_large_gptq_layout(cpu_work, tmp_path):
    """vLLM reads the at-scale GPTQ maker's shards as a GPTQ model and generates (its memory runs are real loads)."""
    from vllm_harness import ok, run_engine

    path = q.make_large_gptq_checkpoint(tmp_path / "big", max_shard_bytes=400_000, **LLAMA)
    assert len(ok(run_engine(cpu_work, {"model": str(path)}))["tokens"][0]) == 8


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("case", ["ct-int8", "ct-fp8-channel", "ct-fp8-tensor-static-kv", "modelopt-fp8"])
def test_vllm_cpu_loads_the_eight_bit_layouts(cpu_work, tmp_path, case):
    """INT8 and FP8-dynamic run on vLLM's CPU build; static FP8 loads and then stops at the first forward for
    want of a CPU FP8 quantization kernel (never at loading)."""
    from vllm_harness import run_engine

    res = run_engine(cpu_work, {"model": str(_make(tmp_path, case, "qwen3"))})
    if "error" in res:
        assert "static_scaled_fp8_quant" in res["error"]["message"], res["error"]["message"]
        assert "static" in case or case == "modelopt-fp8"
    else:
        assert len(res["tokens"][0]) == 8


@pytest.mark.vllm
@pytest.mark.slow
def test_preload_refuses_a_method_it_cannot_capture_in_one_line(cpu_work, tmp_path):
    """vLLM 0.32 declares which methods can be rebuilt from processed weights; compressed-tensors does not: the
    preload stops after constructing the model, before reading a weight, with one line naming it."""
    import subprocess
    import sys

    from vllm_harness import VLLM_FLAGS, sockdir

    model = str(_make(tmp_path, "ct-int8", "qwen3"))
    sd = sockdir(cpu_work, "refuse")
    r = subprocess.run([sys.executable, "-m", "weightcache.cli", "preload", "--engine", "vllm", model, *VLLM_FLAGS,
                        "--weight-cache-socket-dir", sd], capture_output=True, text=True, env=cpu_work["env"],
                       timeout=600)
    assert r.returncode != 0 and "READY" not in r.stdout
    lines = [ln for ln in r.stderr.splitlines() if "exited with code" in ln]
    assert lines, r.stderr[-3000:]
    assert "UnsupportedQuantization: weightcache cannot capture" in lines[-1]
    assert "CompressedTensorsLinearMethod: 8 layer(s), e.g. model.layers.0.self_attn.qkv_proj" in lines[-1]
    assert "load this model from disk instead" in lines[-1]
    assert "Loading weights took" not in r.stderr

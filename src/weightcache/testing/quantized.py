"""Pre-quantized random checkpoints in the layouts real tools write, made locally for tests: block-128 FP8 (as
DeepSeek-V3 and Qwen3-FP8 ship it), llm-compressor's compressed-tensors (FP8, INT8, packed INT4/INT8), GPTQ
(AutoGPTQ / optimum), AutoAWQ and NVIDIA ModelOpt FP8.

Each maker writes a bf16 random checkpoint of a model family (``checkpoints.make_checkpoint``), then replaces the
weights of every linear layer and expert (attention and MLP projections; embeddings, norms, routers and the LM
head stay bf16) with the quantized tensors under the names and shapes the tool writes, and the tool's
``quantization_config``. The integer packing is in ``int_packing``."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from .checkpoints import (
    _random_chunks,
    _write_random_shards,
    llama_config,
    llama_config_for_bytes,
    llama_param_shapes,
    make_checkpoint,
    make_tokenizer,
)
from .int_packing import awq_pack, pack_int32, quantize_groups

FP8_BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn
MOE_FAMILIES = ("qwen3_moe", "mixtral")


def _is_quant_target(name: str, shape) -> bool:
    """The linear weights quantization tools quantize: every projection and expert weight; embeddings, the LM
    head, norms and routers stay in bf16."""
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    owner = name[: -len(".weight")]
    leaf = owner.rsplit(".", 1)[-1]
    return "proj" in leaf or ".experts." in name or leaf in ("w1", "w2", "w3")


_is_fp8_target = _is_quant_target


def _rewrite(path: Path, family: str, seed: int, shape: dict, convert) -> tuple[dict, list[str], list[str]]:
    """Write the bf16 checkpoint, then replace each target weight ``<m>.weight`` with ``convert(m, w)`` (a dict of
    suffix -> tensor, e.g. ``{"qweight": ..., "scales": ...}``). Returns (config dict, quantized modules, the
    other modules that hold weights)."""
    from safetensors.torch import load_file, save_file

    make_checkpoint(path, family, dtype=torch.bfloat16, seed=seed, **shape)
    out, quantized, plain = {}, [], []
    for name, t in load_file(str(path / "model.safetensors")).items():
        module = name.rsplit(".", 1)[0]
        if _is_quant_target(name, t.shape):
            quantized.append(module)
            out.update({f"{module}.{suffix}": v.contiguous() for suffix, v in convert(module, t).items()})
        else:
            out[name] = t
            if module not in plain:
                plain.append(module)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    return json.loads((path / "config.json").read_text()), quantized, plain


def _write_config(path: Path, cfg: dict) -> None:
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def _routers(family: str) -> list[str]:
    """The ``ignore`` patterns tools add for a MoE family's router (a linear layer vLLM builds quantizable)."""
    return {"qwen3_moe": ["re:.*mlp.gate$"], "mixtral": ["re:.*block_sparse_moe.gate$"]}.get(family, [])


def _router_modules(plain: list[str]) -> list[str]:
    return [m for m in plain if m.endswith((".mlp.gate", ".block_sparse_moe.gate"))]


_SAME_INPUT = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
               "up_proj": "gate_up_proj", "w1": "w13", "w3": "w13"}


class _StaticInputScales:
    """Random static activation scales as a calibration observes them: modules that read the same input (q/k/v,
    gate/up, an expert's w1/w3) get the same scale, which vLLM's fused layers require."""

    def __init__(self, generator: torch.Generator, shape: tuple):
        self.generator, self.shape, self.seen = generator, shape, {}

    def __call__(self, module: str) -> torch.Tensor:
        owner, leaf = module.rsplit(".", 1)
        key = f"{owner}.{_SAME_INPUT.get(leaf, leaf)}"
        if key not in self.seen:
            self.seen[key] = (0.01 + 0.02 * torch.rand(self.shape, generator=self.generator)).float()
        return self.seen[key].clone()


# ---- FP8 -------------------------------------------------------------------------------------------------------


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 ``weight_scale_inv`` per ``block`` x ``block`` tile): ``w`` ~ q * s."""
    out_f, in_f = w.shape
    rows, cols = -(-out_f // block), -(-in_f // block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32)
    padded[:out_f, :in_f] = w.float()
    tiles = padded.view(rows, block, cols, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows * block, cols * block)[:out_f, :in_f].contiguous(), scale.contiguous()


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def make_fp8_checkpoint(path: str | Path, family: str = "qwen3", *, seed: int = 0, **shape) -> Path:
    """A random checkpoint of ``family`` quantized as DeepSeek-V3 and Qwen3-FP8 ship: each linear weight in
    float8_e4m3fn per 128 x 128 block with a float32 ``weight_scale_inv``, the rest in bf16, and
    ``quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], ...}`` whose
    ``modules_to_not_convert`` names the bf16 LM head and MoE routers, as Qwen3-FP8 MoE checkpoints do (vLLM
    would otherwise build a router as an FP8 layer)."""
    path = Path(path)

    def convert(module, w):
        q, s = quantize_fp8_block(w)
        return {"weight": q, "weight_scale_inv": s}

    cfg, _, plain = _rewrite(path, family, seed, shape, convert)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
                                  "modules_to_not_convert": ["lm_head", *_router_modules(plain)]}
    _write_config(path, cfg)
    return path


# ---- compressed-tensors (llm-compressor) ------------------------------------------------------------------------


def _ct_args(num_bits: int, kind: str, strategy: str, *, dynamic: bool = False, symmetric: bool = True,
             group_size: int | None = None, actorder: str | None = None) -> dict:
    """A compressed-tensors ``QuantizationArgs`` dict as llm-compressor serializes it."""
    return {"num_bits": num_bits, "type": kind, "symmetric": symmetric, "strategy": strategy, "dynamic": dynamic,
            "group_size": group_size, "block_structure": None, "actorder": actorder, "observer": "minmax",
            "observer_kwargs": {}}


def _ct_config(fmt: str, weights: dict, inputs: dict | None, family: str, kv_cache: bool) -> dict:
    return {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "version": "0.12.2",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                      "output_activations": None, "format": fmt}},
        "ignore": ["lm_head", *_routers(family)],
        "kv_cache_scheme": (_ct_args(8, "float", "tensor") if kv_cache else None),
    }


def _kv_scales(plain: list[str], out: dict, names: tuple[str, str], shape: tuple) -> None:
    """FP8 KV-cache scales on every attention block (``<layer>.self_attn``), under the tool's names."""
    layers = sorted({m.split(".self_attn")[0] for m in plain if ".self_attn" in m} |
                    {m.split(".input_layernorm")[0] for m in plain if m.endswith(".input_layernorm")})
    g = torch.Generator().manual_seed(7)
    for layer in layers:
        for name in names:
            out[f"{layer}.self_attn.{name}"] = (0.02 + 0.01 * torch.rand(shape, generator=g)).float()


def _add_tensors(path: Path, extra: dict) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors.update(extra)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def make_compressed_fp8_checkpoint(path: str | Path, family: str = "qwen3", *, seed: int = 0,
                                   strategy: str = "channel", dynamic: bool = True, kv_cache: bool = False,
                                   weight_only: bool = False, **shape) -> Path:
    """compressed-tensors' "float-quantized" format, as llm-compressor writes FP8 models: each linear weight in
    float8_e4m3fn with a float32 ``weight_scale`` per output channel (``strategy="channel"``, shape [out, 1]) or
    per tensor (``"tensor"``, shape [1]); activations dynamic per token (``dynamic=True``, FP8-dynamic) or static
    per tensor with an ``input_scale`` [1], or not quantized (``weight_only``, FP8 W8A16); ``kv_cache``: FP8
    KV-cache scales ``self_attn.k_scale`` / ``v_scale`` and a ``kv_cache_scheme``. The LM head (and a MoE router)
    stays bf16."""
    if strategy not in ("channel", "tensor"):
        raise ValueError(f"strategy must be 'channel' or 'tensor', got {strategy!r}")
    path = Path(path)
    input_scale = _StaticInputScales(torch.Generator().manual_seed(seed + 1), (1,))

    def convert(module, w):
        if strategy == "channel":
            scale = (w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        else:
            scale = (w.float().abs().amax().reshape(1) / FP8_MAX).clamp(min=1e-12)
        out = {"weight": _fp8(w, scale), "weight_scale": scale}
        if not dynamic and not weight_only:
            out["input_scale"] = input_scale(module)
        return out

    cfg, _, plain = _rewrite(path, family, seed, shape, convert)
    fp8 = dict(num_bits=8, kind="float")
    inputs = _ct_args(**fp8, strategy="token", dynamic=True) if dynamic else _ct_args(**fp8, strategy="tensor")
    if weight_only:
        inputs = None
    cfg["quantization_config"] = _ct_config("float-quantized", _ct_args(**fp8, strategy=strategy), inputs, family,
                                            kv_cache)
    _write_config(path, cfg)
    if kv_cache:
        extra: dict = {}
        _kv_scales(plain, extra, ("k_scale", "v_scale"), (1,))
        _add_tensors(path, extra)
    return path


def make_compressed_int8_checkpoint(path: str | Path, family: str = "qwen3", *, seed: int = 0,
                                    dynamic: bool = True, **shape) -> Path:
    """compressed-tensors' "int-quantized" format (llm-compressor's W8A8-INT8): each linear weight in int8 with a
    float32 ``weight_scale`` per output channel [out, 1], symmetric; activations int8 dynamic per token, or static
    per tensor with an ``input_scale`` [1] (``dynamic=False``)."""
    path = Path(path)
    input_scale = _StaticInputScales(torch.Generator().manual_seed(seed + 1), (1,))

    def convert(module, w):
        scale = (w.float().abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
        q = (w.float() / scale).round().clamp(-128, 127).to(torch.int8)
        out = {"weight": q, "weight_scale": scale}
        if not dynamic:
            out["input_scale"] = input_scale(module)
        return out

    cfg, _, _ = _rewrite(path, family, seed, shape, convert)
    inputs = (_ct_args(8, "int", "token", dynamic=True) if dynamic else _ct_args(8, "int", "tensor"))
    cfg["quantization_config"] = _ct_config("int-quantized", _ct_args(8, "int", "channel"), inputs, family, False)
    _write_config(path, cfg)
    return path


def make_compressed_wna16_checkpoint(path: str | Path, family: str = "qwen3", *, seed: int = 0, num_bits: int = 4,
                                     group_size: int = 128, symmetric: bool = True, actorder: bool = False,
                                     **shape) -> Path:
    """compressed-tensors' "pack-quantized" format (llm-compressor's W4A16 / W8A16): per linear layer
    ``weight_packed`` int32 [out, in * bits / 32] (values offset by 2^(bits-1), packed along the input dimension),
    ``weight_scale`` [out, in / group] in the model dtype, ``weight_shape`` int64 [out, in]; asymmetric adds
    ``weight_zero_point`` int32 [out * bits / 32, in / group] (packed along the output dimension); ``actorder``
    (GPTQ's activation order, ``"group"``) adds ``weight_g_idx`` int32 [in]."""
    if num_bits not in (4, 8):
        raise ValueError(f"num_bits must be 4 or 8, got {num_bits}")
    path = Path(path)
    g = torch.Generator().manual_seed(seed + 2)

    def convert(module, w):
        q, scale, zero, g_idx = quantize_groups(w, num_bits, group_size, symmetric=symmetric,
                                                perm=torch.randperm(w.shape[1], generator=g) if actorder else None)
        out = {"weight_packed": pack_int32(q, num_bits, dim=1), "weight_scale": scale.to(torch.bfloat16),
               "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
        if not symmetric:
            out["weight_zero_point"] = pack_int32(zero, num_bits, dim=0)
        if actorder:
            out["weight_g_idx"] = g_idx
        return out

    cfg, _, _ = _rewrite(path, family, seed, shape, convert)
    weights = _ct_args(num_bits, "int", "group", symmetric=symmetric, group_size=group_size,
                       actorder="group" if actorder else None)
    cfg["quantization_config"] = _ct_config("pack-quantized", weights, None, family, False)
    _write_config(path, cfg)
    return path


# ---- GPTQ (AutoGPTQ / optimum) and AutoAWQ ----------------------------------------------------------------------


def make_gptq_checkpoint(path: str | Path, family: str = "qwen3", *, seed: int = 0, bits: int = 4,
                         group_size: int = 128, desc_act: bool = False, describe_modules: bool = True,
                         **shape) -> Path:
    """A GPTQ checkpoint as AutoGPTQ / optimum write it (symmetric, format "gptq"): per linear layer ``qweight``
    int32 [in * bits / 32, out] (packed along the input dimension, values offset by 2^(bits-1)), ``qzeros`` int32
    [groups, out * bits / 32] (the zero point minus one, packed), ``scales`` fp16 [groups, out] and ``g_idx`` int32
    [in] (each input channel's group; a permutation of them with ``desc_act``). ``describe_modules``: the config
    lists the quantized modules (optimum's ``modules_in_block_to_quantize``); without it vLLM reads every
    weight file's header to find them, in every process that builds its config."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    path = Path(path)
    g = torch.Generator().manual_seed(seed + 3)
    zero = 1 << (bits - 1)

    def convert(module, w):
        q, scale, _, g_idx = quantize_groups(w, bits, group_size, symmetric=True,
                                             perm=torch.randperm(w.shape[1], generator=g) if desc_act else None)
        zeros = torch.full((scale.shape[1], w.shape[0]), zero - 1, dtype=torch.int32)
        return {"qweight": pack_int32(q.t(), bits, dim=0), "qzeros": pack_int32(zeros, bits, dim=1),
                "scales": scale.t().to(torch.float16), "g_idx": g_idx}

    cfg, quantized, _ = _rewrite(path, family, seed, shape, convert)
    cfg["quantization_config"] = _gptq_config(bits, group_size, desc_act, quantized if describe_modules else None)
    _write_config(path, cfg)
    return path


def _gptq_config(bits: int, group_size: int, desc_act: bool, quantized: list[str] | None) -> dict:
    """The ``quantization_config`` AutoGPTQ / optimum write (``quantized``: the modules, listed as optimum's
    ``modules_in_block_to_quantize``)."""
    in_block = sorted({m.split(".", 3)[3] for m in quantized or () if m.startswith("model.layers.")})
    return {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": True,
        "damp_percent": 0.1, "true_sequential": True, "static_groups": False, "checkpoint_format": "gptq",
        "use_exllama": True, "exllama_config": {"version": 1}, "use_cuda_fp16": False, "cache_block_outputs": True,
        "dataset": None, "tokenizer": None, "model_seqlen": None, "block_name_to_quantize": None,
        "module_name_preceding_first_block": None, "batch_size": 1, "pad_token_id": None,
        "max_input_length": None, "modules_in_block_to_quantize": [in_block] if quantized is not None else None}


def gptq_llama_bytes(*, bits: int = 4, group_size: int = 128, **shape) -> int:
    """Bytes of :func:`make_large_gptq_checkpoint`'s tensors for a Llama shape."""
    total = 0
    for name, dims in llama_param_shapes(**shape).items():
        if _is_quant_target(name, dims):
            out_f, in_f = dims
            groups = in_f // group_size
            total += in_f * out_f * bits // 8 + groups * out_f * bits // 8 + groups * out_f * 2 + in_f * 4
        else:
            total += math.prod(dims) * 2
    return total


def gptq_llama_shape_for_bytes(target_bytes: int, *, bits: int = 4, group_size: int = 128) -> dict:
    """Llama shape kwargs whose :func:`make_large_gptq_checkpoint` totals about ``target_bytes``."""
    kw = llama_config_for_bytes(target_bytes * 16 // bits)  # bf16 of that many parameters
    kw.pop("num_layers")
    one = gptq_llama_bytes(bits=bits, group_size=group_size, num_layers=1, **kw)
    per_layer = gptq_llama_bytes(bits=bits, group_size=group_size, num_layers=2, **kw) - one
    return dict(kw, num_layers=max(1, round((target_bytes - (one - per_layer)) / per_layer)))


def make_large_gptq_checkpoint(path: str | Path, *, bits: int = 4, group_size: int = 128, seed: int = 0,
                               max_shard_bytes: int = 4 << 30, **shape) -> Path:
    """A GPTQ Llama of any size, written shard by shard as :func:`make_gptq_checkpoint` lays it out (no
    act-order) but without quantizing: random packed values, the symmetric zero point, small random fp16 scales.
    For memory and rates at scale (vLLM repacks it for Marlin), not for tokens."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shapes = llama_param_shapes(**shape)
    bits_pool = torch.randint(-(1 << 31), (1 << 31) - 1, (8 << 20,), dtype=torch.int32,
                              generator=torch.Generator().manual_seed(seed + 3))
    scale_pool = (0.001 + 0.002 * torch.rand(1 << 20, generator=torch.Generator().manual_seed(seed + 4))).half()
    zero_word = pack_int32(torch.full((1, 32 // bits), (1 << (bits - 1)) - 1), bits, dim=1)
    zero_bytes = zero_word.view(torch.uint8).flatten().repeat(1 << 18)

    def repeat(raw: torch.Tensor):
        return lambda n, _g: [memoryview(raw[i: i + min(raw.numel(), n - i)].numpy())
                              for i in range(0, n, raw.numel())]

    specials, layout, quantized = {}, {}, []  # layout: every tensor's shape, in the model's order
    for name, dims in shapes.items():
        if not _is_quant_target(name, dims):
            layout[name] = dims
            continue
        module, (out_f, in_f) = name[: -len(".weight")], dims
        if in_f % group_size or out_f * bits % 32:
            raise ValueError(f"{name} {dims}: GPTQ needs in % {group_size} == 0 and out * {bits} % 32 == 0")
        quantized.append(module)
        groups = in_f // group_size
        g_idx = (torch.arange(in_f) // group_size).to(torch.int32)
        specials[f"{module}.qweight"] = (torch.int32, (in_f * bits // 32, out_f),
                                         lambda n, g: _random_chunks(bits_pool, n, g))
        specials[f"{module}.qzeros"] = (torch.int32, (groups, out_f * bits // 32), repeat(zero_bytes))
        specials[f"{module}.scales"] = (torch.float16, (groups, out_f), lambda n, g: _random_chunks(scale_pool, n, g))
        specials[f"{module}.g_idx"] = (torch.int32, (in_f,), repeat(g_idx.view(torch.uint8)))
        layout.update({n: specials[n][1] for n in (f"{module}.{s}" for s in ("qweight", "qzeros", "scales", "g_idx"))})
    config = llama_config(**shape, dtype=torch.float16)
    config.save_pretrained(str(path))
    _write_random_shards(path, layout, torch.float16, seed, max_shard_bytes, specials=specials)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = _gptq_config(bits, group_size, False, quantized)
    _write_config(path, cfg)
    make_tokenizer(path, shape["vocab_size"])
    return path


def make_awq_checkpoint(path: str | Path, family: str = "qwen3", *, seed: int = 0, group_size: int = 128,
                        describe_modules: bool = True, **shape) -> Path:
    """An AWQ checkpoint as AutoAWQ writes it (GEMM version, 4-bit, zero point): per linear layer ``qweight`` int32
    [in, out / 8] and ``qzeros`` int32 [groups, out / 8], both packed along the output dimension in AWQ's order
    (0, 2, 4, 6, 1, 3, 5, 7), and ``scales`` fp16 [groups, out]. ``describe_modules``: the config lists the
    modules left unquantized (``modules_to_not_convert``); without it vLLM reads every weight file's header."""
    path = Path(path)

    def convert(module, w):
        q, scale, zero, _ = quantize_groups(w, 4, group_size, symmetric=False)
        return {"qweight": awq_pack(q.t()), "qzeros": awq_pack(zero.t()), "scales": scale.t().to(torch.float16)}

    cfg, _, plain = _rewrite(path, family, seed, shape, convert)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                                  "version": "gemm",
                                  "modules_to_not_convert": plain if describe_modules else None}
    _write_config(path, cfg)
    return path


# ---- NVIDIA ModelOpt FP8 ----------------------------------------------------------------------------------------


def make_modelopt_fp8_checkpoint(path: str | Path, family: str = "qwen3", *, seed: int = 0, kv_cache: bool = True,
                                 **shape) -> Path:
    """An FP8 checkpoint as NVIDIA ModelOpt exports it (``quant_algo: FP8``): per linear layer a float8_e4m3fn
    ``weight`` with float32 per-tensor ``weight_scale`` and static ``input_scale`` (scalars); ``kv_cache``: FP8
    KV-cache scales ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale``; the quantization config in the separate
    ``hf_quant_config.json`` of ModelOpt exports (the LM head and MoE routers excluded)."""
    path = Path(path)
    input_scale = _StaticInputScales(torch.Generator().manual_seed(seed + 4), ())

    def convert(module, w):
        scale = (w.float().abs().amax() / FP8_MAX).clamp(min=1e-12).reshape(())
        return {"weight": _fp8(w, scale), "weight_scale": scale, "input_scale": input_scale(module)}

    _, _, plain = _rewrite(path, family, seed, shape, convert)
    if kv_cache:
        extra: dict = {}
        _kv_scales(plain, extra, ("k_proj.k_scale", "v_proj.v_scale"), ())
        _add_tensors(path, extra)
    exclude = ["lm_head"] + [re.sub(r"^model\.layers\.\d+\.", "model.layers.*.", m) for m in _router_modules(plain)]
    hf_quant = {"producer": {"name": "modelopt", "version": "0.29.0"},
                "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" if kv_cache else None,
                                 "exclude_modules": sorted(set(exclude))}}
    (path / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4))
    return path


MAKERS = {
    "fp8-block": make_fp8_checkpoint,
    "ct-fp8": make_compressed_fp8_checkpoint,
    "ct-int8": make_compressed_int8_checkpoint,
    "ct-wna16": make_compressed_wna16_checkpoint,
    "gptq": make_gptq_checkpoint,
    "awq": make_awq_checkpoint,
    "modelopt-fp8": make_modelopt_fp8_checkpoint,
}

"""Pre-quantized random checkpoints in the layouts real tools write (block-128 FP8 as DeepSeek-V3 and Qwen3-FP8
ship it, llm-compressor's compressed-tensors), made locally for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoints import make_checkpoint

FP8_BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn


def _is_fp8_target(name: str, shape) -> bool:
    """The linear weights an FP8 block-quantized checkpoint (DeepSeek-V3, Qwen3-FP8) stores in FP8: every
    projection and expert weight; embeddings, the LM head, norms and routers stay in bf16."""
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    owner = name[: -len(".weight")]
    leaf = owner.rsplit(".", 1)[-1]
    return "proj" in leaf or ".experts." in name or leaf in ("w1", "w2", "w3")


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


def make_fp8_checkpoint(path: str | Path, family: str = "qwen3", *, seed: int = 0, **shape) -> Path:
    """A random checkpoint of ``family`` quantized as DeepSeek-V3 and Qwen3-FP8 ship: each linear weight in
    float8_e4m3fn per 128 x 128 block with a float32 ``weight_scale_inv``, the rest in bf16, and
    ``quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], ...}``."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    make_checkpoint(path, family, dtype=torch.bfloat16, seed=seed, **shape)
    tensors = load_file(str(path / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if _is_fp8_target(name, t.shape):
            out[name], out[name + "_scale_inv"] = quantize_fp8_block(t)
        else:
            out[name] = t
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def make_compressed_fp8_checkpoint(path: str | Path, family: str = "qwen3", *, seed: int = 0, **shape) -> Path:
    """A random checkpoint of ``family`` in compressed-tensors' "float-quantized" format (as llm-compressor
    writes FP8-dynamic models): each linear weight in float8_e4m3fn with a per-channel ``weight_scale``,
    dynamic per-token FP8 activations, the LM head left in bf16."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    make_checkpoint(path, family, dtype=torch.bfloat16, seed=seed, **shape)
    out = {}
    for name, t in load_file(str(path / "model.safetensors")).items():
        if _is_fp8_target(name, t.shape):
            scale = (t.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
            out[name] = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            out[name[: -len("weight")] + "weight_scale"] = scale
        else:
            out[name] = t
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {**fp8, "strategy": "channel", "dynamic": False},
                                      "input_activations": {**fp8, "strategy": "token", "dynamic": True}}},
        "ignore": ["lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path

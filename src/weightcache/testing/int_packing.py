"""Integer weight quantization and packing as GPTQ, AWQ and compressed-tensors write it (for the random
checkpoints of ``testing.quantized``): group-wise scales and zero points, values packed into int32 words."""

from __future__ import annotations

import torch

# AutoAWQ's GEMM format packs the 8 values of a word in this order of output columns (slot i <- column ORDER[i]).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def group_index(in_features: int, group_size: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """Each input channel's quantization group (GPTQ's ``g_idx``), int32 [in]. With ``perm`` (activation order:
    the order GPTQ quantized the channels in) channel ``perm[j]`` is in group ``j // group_size``."""
    if in_features % group_size:
        raise ValueError(f"in_features ({in_features}) must be a multiple of group_size ({group_size})")
    order = torch.arange(in_features) if perm is None else perm
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // group_size).to(torch.int32)
    return g_idx


def quantize_groups(w: torch.Tensor, bits: int, group_size: int, *, symmetric: bool = True,
                    perm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``w`` [out, in] per output channel and input group to unsigned ``bits``-bit values.

    Returns (q int32 [out, in] in [0, 2^bits), scale float32 [out, groups], zero int32 [out, groups], g_idx int32
    [in]) with ``w ~ (q - zero[:, g_idx]) * scale[:, g_idx]``. Symmetric: zero = 2^(bits-1) (the "b8"/"b128"
    offset GPTQ and compressed-tensors store); asymmetric (AWQ): per-group min/max."""
    out_f, in_f = w.shape
    g_idx = group_index(in_f, group_size, perm)
    groups = in_f // group_size
    wf = w.float()
    index = g_idx.long().expand(out_f, in_f)
    maxq = (1 << bits) - 1

    def reduce(x, how):
        return torch.zeros(out_f, groups).scatter_reduce(1, index, x, how, include_self=False)

    if symmetric:
        half = 1 << (bits - 1)
        scale = _snap(reduce(wf.abs(), "amax") / (half - 1))
        zero = torch.full((out_f, groups), half, dtype=torch.int32)
    else:
        lo, hi = reduce(wf, "amin").clamp(max=0), reduce(wf, "amax").clamp(min=0)
        scale = _snap((hi - lo) / maxq)
        zero = (-lo / scale).round().clamp(0, maxq).to(torch.int32)
    q = (wf / scale[:, g_idx.long()]).round() + zero[:, g_idx.long()]
    return q.clamp(0, maxq).to(torch.int32), scale, zero, g_idx


def _snap(scale: torch.Tensor) -> torch.Tensor:
    """Scales rounded up to bf16 values (exact in fp16 and bf16 too: every format then stores the same scales, and
    no value leaves the integer range)."""
    return (scale.clamp(min=1e-8) * (1 + 2 ** -7)).to(torch.bfloat16).float()


def pack_int32(q: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit values along ``dim`` into int32 words, value ``i`` of each word in bits
    ``[i * bits, (i + 1) * bits)`` (GPTQ's qweight/qzeros, compressed-tensors' ``pack_to_int32``)."""
    per_word = 32 // bits
    moved = q.movedim(dim, -1).to(torch.int64)
    if moved.shape[-1] % per_word:
        raise ValueError(f"dimension {dim} ({moved.shape[-1]}) is not a multiple of {per_word} values per word")
    words = moved.reshape(*moved.shape[:-1], -1, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    acc = (words << shifts).sum(-1)
    acc = torch.where(acc >= 1 << 31, acc - (1 << 32), acc)  # the int32 with the same bits
    return acc.to(torch.int32).movedim(-1, dim).contiguous()


def awq_pack(q: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing of 4-bit values [rows, cols] into int32 [rows, cols / 8], along the columns in
    AWQ_ORDER."""
    rows, cols = q.shape
    if cols % 8:
        raise ValueError(f"AWQ packs 8 columns per word; {cols} columns")
    return pack_int32(q.reshape(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)].reshape(rows, cols), 4, dim=1)

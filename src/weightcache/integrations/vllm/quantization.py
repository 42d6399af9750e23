"""Which quantization methods' post-load state weightcache can capture in a daemon and rebuild in an engine.

Where vLLM has its "weights already processed" mode (0.32+), a method says so itself
(``supports_pre_processed_weights``). On releases without it (0.26) the allow-lists below apply: a layer is
accepted when its quantization method, its compressed-tensors scheme (if any) and every linear kernel object they
chose at construction are listed. Each was read in vLLM 0.26's source: its ``process_weights_after_loading``
leaves only tensors (repacked weights, permuted scales, ``g_idx`` sort indices, workspaces), host scalars and
deletions, plus objects the engine makes again from the attached tensors (``REBUILT_ATTRIBUTES``, see
``compat.rebuild_kernels``). Anything else is refused by name before the checkpoint is read.
"""

from __future__ import annotations

import os

from ...errors import WeightCacheError

ALLOWED_QUANT_METHODS = frozenset({
    # unquantized
    "UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod",
    # FP8: checkpoint block/tensor FP8 and online FP8
    "Fp8LinearMethod", "Fp8PerTensorOnlineLinearMethod", "Fp8MoEMethod", "Fp8PerTensorOnlineMoEMethod",
    # KV-cache scales
    "BaseKVCacheMethod", "Fp8KVCacheMethod", "CompressedTensorsKVCacheMethod", "ModelOptKVCacheMethod",
    # compressed-tensors (the linear method's scheme is checked too)
    "CompressedTensorsLinearMethod", "CompressedTensorsW8A8Fp8MoEMethod", "CompressedTensorsW8A8Int8MoEMethod",
    "CompressedTensorsWNA16MarlinMoEMethod",
    # GPTQ and AWQ through vLLM's mixed-precision kernels (Machete, Marlin)
    "AutoGPTQLinearMethod", "AutoGPTQMoEMethod", "AutoAWQMarlinLinearMethod", "AutoAWQMoEMethod",
    # NVIDIA ModelOpt FP8
    "ModelOptFp8LinearMethod", "ModelOptFp8PcPtLinearMethod", "ModelOptFp8MoEMethod",
})
# compressed-tensors linear layers delegate to a per-layer scheme (``layer.scheme``)
ALLOWED_SCHEMES = frozenset({"CompressedTensorsW8A8Fp8", "CompressedTensorsW8A8Int8", "CompressedTensorsWNA16"})
# Linear kernel objects methods and schemes choose at construction (choose_mp_linear_kernel,
# init_fp8_linear_kernel, init_int8_linear_kernel): their post-processing makes tensors and scalars only,
# except Machete's activation permutation (rebuilt) and Marlin's workspace (scratch).
ALLOWED_LINEAR_KERNELS = frozenset({
    "MacheteLinearKernel", "MarlinLinearKernel",
    "CutlassFP8ScaledMMLinearKernel", "FlashInferFP8ScaledMMLinearKernel", "MarlinFP8ScaledMMLinearKernel",
    "PerTensorTorchFP8ScaledMMLinearKernel", "ChannelWiseTorchFP8ScaledMMLinearKernel",
    "RowWiseTorchFP8ScaledMMLinearKernel",
    "CutlassFp8BlockScaledMMKernel", "TritonFp8BlockScaledMMKernel", "DeepGemmFp8BlockScaledMMKernel",
    "FlashInferFp8BlockScaledMMKernel", "FlashInferFp8DeepGEMMDynamicBlockScaledKernel",
    "CutlassInt8ScaledMMLinearKernel", "TritonInt8ScaledMMLinearKernel",
})

# Objects a quantization method makes from the processed weights; the engine rebuilds them from the bound tensors
# (compat.rebuild_kernels), so they are not shipped: the MoE kernels, and Machete's activation permutation (a
# closure over argsort(g_idx) of the attached, untransformed g_idx).
REBUILT_ATTRIBUTES = frozenset({"moe_kernel", "moe_quant_config", "cpu_fused_moe", "act_perm"})
# Tensors kernels write while they run (Marlin's workspace of reduction locks): shipped for their shape and bytes,
# bound as the engine's own writable copy (an engine maps the daemon's tensors read-only).
SCRATCH_ATTRIBUTES = frozenset({"workspace"})

# Environment variables that change which kernel vLLM picks, hence how weights are repacked: part of the cache key.
KERNEL_ENV = ("VLLM_DISABLED_KERNELS", "VLLM_TEST_FORCE_FP8_MARLIN", "VLLM_MARLIN_INPUT_DTYPE", "VLLM_BATCH_INVARIANT",
              "VLLM_USE_DEEP_GEMM", "VLLM_MOE_USE_DEEP_GEMM", "VLLM_USE_DEEP_GEMM_E8M0",
              "VLLM_USE_DEEP_GEMM_TMA_ALIGNED_SCALES", "VLLM_ROCM_USE_AITER", "VLLM_ROCM_USE_AITER_MOE",
              "VLLM_ROCM_FP8_PADDING", "VLLM_ROCM_MOE_PADDING", "VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD",
              "VLLM_CPU_SGL_KERNEL", "VLLM_CPU_INT4_W4A8")
_LISTED = 3


class UnsupportedQuantization(WeightCacheError, ValueError):
    """A quantization method whose post-load state the cache cannot capture faithfully."""


def kernel_choice(vllm_config) -> str:
    """What decides the linear and MoE kernels (and so the repacked weight layout) besides the model: the
    kernel backends of the engine flags and the environment variables that steer vLLM's choice."""
    kc = getattr(vllm_config, "kernel_config", None)
    parts = [f"linear={getattr(kc, 'linear_backend', 'auto')}", f"moe={getattr(kc, 'moe_backend', 'auto')}"]
    parts += [f"{name}={os.environ[name]}" for name in KERNEL_ENV if os.environ.get(name)]
    return ",".join(parts)


def _is_kernel(obj) -> bool:
    """A plain object that computes a linear layer from its weights (vLLM's linear kernel classes)."""
    from torch import nn

    return (not isinstance(obj, (nn.Module, type)) and callable(getattr(obj, "apply_weights", None))
            and callable(getattr(obj, "process_weights_after_loading", None)))


def _kernels(obj) -> list:
    return [v for v in vars(obj).values() if _is_kernel(v)] if hasattr(obj, "__dict__") else []


def describe(layer, qm) -> tuple[str, bool]:
    """(a label naming the method, its scheme and its kernels; whether all of them are on the allow-lists)."""
    name = type(qm).__name__
    ok = name in ALLOWED_QUANT_METHODS
    scheme = getattr(layer, "scheme", None)
    kernels = _kernels(qm)
    if _is_kernel(scheme):
        name += f"/{type(scheme).__name__}"
        ok = ok and type(scheme).__name__ in ALLOWED_SCHEMES
        kernels += _kernels(scheme)
    names = sorted({type(k).__name__ for k in kernels})
    if names:
        name += f" (kernel {', '.join(names)})"
        ok = ok and all(n in ALLOWED_LINEAR_KERNELS for n in names)
    return name, ok


def check_quantization(model) -> None:
    """Refuse, in one line, a model whose quantization methods' post-load state the cache cannot capture: where
    vLLM has a pre-processed mode, each method's own ``supports_pre_processed_weights``; else the allow-lists."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    from .compat import has_pre_processed_mode

    declared = has_pre_processed_mode()
    bad: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if not isinstance(qm, QuantizeMethodBase):
            continue
        if declared:
            label, ok = type(qm).__name__, bool(getattr(qm, "supports_pre_processed_weights", False))
        else:
            label, ok = describe(module, qm)
        if not ok:
            bad.setdefault(label, []).append(name or "<root>")
    if bad:
        listed = "; ".join(f"{label}: {len(layers)} layer(s), e.g. {', '.join(layers[:_LISTED])}"
                           for label, layers in bad.items())
        rule = ("on this vLLM it takes the methods that declare supports_pre_processed_weights" if declared
                else "docs/vllm.md lists what it takes on this vLLM")
        raise UnsupportedQuantization(
            f"weightcache cannot capture the post-load state of these quantization methods faithfully: {listed}; "
            f"load this model from disk instead (without --load-format weightcache; {rule})")
